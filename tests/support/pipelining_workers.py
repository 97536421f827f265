"""Rank side of tests/process/test_pipelining_dropin.py: torch's pipelining example, run with torch's schedule
classes and with the drop-in's, the program the same but for the module the class comes from.

The example is torch's documented one (``PipelineStage`` per stage, a schedule over them, the first rank
passes the inputs, the last the target and a ``losses`` list, every other rank calls ``step()`` bare), on a
model of ``Linear + Tanh`` layers in float64, two training steps with SGD.  Each run returns what user code
sees: the return value of ``step``, the losses list and the gradients and weights after each step.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

DIM, ROWS, N, STEPS = 8, 16, 4, 2
TORCH = "torch.distributed.pipelining"
OURS = "dualpipe_kernels.integrations.pipelining"


def layer(i: int) -> nn.Module:
    torch.manual_seed(100 + i)  # layer i has the same weights on every rank and in every run
    return nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()).double()


class ShiftLayer(nn.Module):
    """``tanh(linear(x) + shift)``: ``shift`` a keyword input given to every stage (as torchtitan gives
    ``positions`` / ``attention_masks``)."""

    def __init__(self, i: int) -> None:
        super().__init__()
        torch.manual_seed(100 + i)
        self.linear = nn.Linear(DIM, DIM).double()

    def forward(self, x: torch.Tensor, shift: torch.Tensor | None = None) -> torch.Tensor:
        y = self.linear(x)
        return torch.tanh(y if shift is None else y + shift)


def shift_input() -> torch.Tensor:
    return torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(9), dtype=torch.float64)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return torch.randn(ROWS, DIM, generator=gen, dtype=torch.float64), torch.randn(
        ROWS, DIM, generator=gen, dtype=torch.float64
    )


#: (schedule class name, scale_grads) pairs run by both()
CASES = [
    *((s, scale) for s in ("ScheduleDualPipeV", "Schedule1F1B") for scale in (True, False)),
    *((s, True) for s in ("ScheduleZBVZeroBubble", "ScheduleInterleaved1F1B", "ScheduleGPipe")),
]


def stage_indices(schedule: str, rank: int, world: int) -> list[int]:
    """torch's placement: a V (r and 2R-1-r) for DualPipeV and ZB-V, a loop (r, r+R) for interleaved 1F1B, one
    stage per rank otherwise."""
    if schedule in ("ScheduleDualPipeV", "ScheduleZBVZeroBubble"):
        return [rank, 2 * world - 1 - rank]
    return [rank, rank + world] if schedule == "ScheduleInterleaved1F1B" else [rank]


def example(module_name: str, schedule: str, rank: int, world: int, scale_grads: bool) -> dict[str, Any]:
    """torch's example with the schedule class ``schedule`` taken from ``module_name``."""
    from torch.distributed.pipelining import PipelineStage

    pipelining = importlib.import_module(module_name)
    indices = stage_indices(schedule, rank, world)
    num_stages = world * len(indices)
    mods = {s: layer(s) for s in indices}
    stages = [PipelineStage(mods[s], s, num_stages, torch.device("cpu")) for s in indices]
    cls = getattr(pipelining, schedule)
    loss_fn = F.mse_loss
    sched = (
        cls(stages, N, loss_fn=loss_fn, scale_grads=scale_grads)
        if len(stages) > 1
        else cls(stages[0], N, loss_fn=loss_fn, scale_grads=scale_grads)
    )
    opt = torch.optim.SGD([p for m in mods.values() for p in m.parameters()], lr=0.1)
    x, target = batch()
    first, last = 0 in indices, num_stages - 1 in indices
    out: dict[str, Any] = {"steps": []}
    for _ in range(STEPS):
        losses: list[torch.Tensor] = []
        if first and last:
            result = sched.step(x, target=target, losses=losses)
        elif first:
            result = sched.step(x)
        elif last:
            result = sched.step(target=target, losses=losses)
        else:
            result = sched.step()
        grads = {f"{s}.{n}": p.grad.clone() for s, m in mods.items() for n, p in m.named_parameters()}
        opt.step()
        opt.zero_grad()
        out["steps"].append(
            {
                "result": None if result is None else result.detach().clone(),
                "losses": [float(v.detach()) for v in losses] if last else None,
                "grads": grads,
            }
        )
    close = getattr(sched, "close", None)
    if close is not None:
        close()
    return out


def keyword_example(module_name: str, schedule: str, rank: int, world: int) -> dict[str, Any]:
    """torch's example with a keyword input for every stage: ``step(x, target=t, shift=s)`` on the first
    rank, ``step(shift=s)`` elsewhere (torch splits it and gives every stage its micro-batch's slice)."""
    from torch.distributed.pipelining import PipelineStage

    pipelining = importlib.import_module(module_name)
    indices = stage_indices(schedule, rank, world)
    num_stages = world * len(indices)
    mods = {s: ShiftLayer(s) for s in indices}
    stages = [PipelineStage(mods[s], s, num_stages, torch.device("cpu")) for s in indices]
    extra = {"keyword_inputs": True} if module_name == OURS else {}
    cls = getattr(pipelining, schedule)
    arg = stages if len(stages) > 1 else stages[0]
    sched = cls(arg, N, loss_fn=F.mse_loss, **extra)
    x, target = batch()
    shift = shift_input()
    first, last = 0 in indices, num_stages - 1 in indices
    losses: list[torch.Tensor] = []
    kw: dict[str, Any] = {"target": target, "losses": losses} if last else {}
    result = sched.step(*((x,) if first else ()), shift=shift, **kw)
    out = {
        "result": None if result is None else result.detach().clone(),
        "losses": [float(v.detach()) for v in losses] if last else None,
        "grads": {f"{s}.{n}": p.grad.clone() for s, m in mods.items() for n, p in m.named_parameters()},
    }
    if module_name == OURS:
        sched.close()
    return out


def both(rank: int, world: int) -> dict[str, Any]:
    """Every (schedule, scale_grads) with torch's classes and ours, from the same weights and data."""
    runs: dict[str, Any] = {}
    for schedule, scale in CASES:
        for module in (TORCH, OURS):
            runs[f"{schedule}/{scale}/{module}"] = example(module, schedule, rank, world, scale)
    for schedule in ("ScheduleDualPipeV", "Schedule1F1B"):
        for module in (TORCH, OURS):
            runs[f"keywords/{schedule}/{module}"] = keyword_example(module, schedule, rank, world)
    runs["rank"] = rank
    runs["errors"] = errors(rank, world)
    runs["eval"] = evaluation(rank, world)
    dist.barrier()
    return runs


def errors(rank: int, world: int) -> dict[str, str]:
    """The messages of what the drop-in refuses: a placement that is not the schedule's, keyword inputs."""
    from torch.distributed.pipelining import PipelineStage

    from dualpipe_kernels.integrations.pipelining import Schedule1F1B, ScheduleDualPipeV

    out = {}
    loop = [rank, rank + world]  # torch's loop placement, not DualPipeV's V
    stages = [PipelineStage(layer(s), s, 2 * world, torch.device("cpu")) for s in loop]
    try:
        ScheduleDualPipeV(stages, N, loss_fn=F.mse_loss)
    except ValueError as exc:
        out["placement"] = str(exc)
    sched = Schedule1F1B(PipelineStage(layer(rank), rank, world, torch.device("cpu")), N, loss_fn=F.mse_loss)
    try:
        x, target = batch()
        sched.step(x, mask=x > 0, target=target)
    except ValueError as exc:
        out["kwargs"] = str(exc)
    sched.close()
    return out


def _titan_loss(pred: torch.Tensor, labels: torch.Tensor, global_valid_tokens: torch.Tensor) -> tuple[Any, Any]:
    """A torchtitan-style loss: (sum over the micro-batch / the global token count, the count)."""
    return F.mse_loss(pred, labels, reduction="sum") / global_valid_tokens, global_valid_tokens


def titan(rank: int, world: int, real: bool) -> dict[str, Any]:
    """torchtitan's way to a schedule, with torch's DualPipeV and after ``use_dualpipe_kernels``: the class from
    the config's name, the placement from comparing it with the V classes, the construction and the train
    step's call (pre-split micro-batches, ``loss_kwargs``, ``return_outputs=False``).  ``real``: torchtitan's own
    functions (``torchtitan.distributed.pipeline_parallel``); else the same calls written out here over a
    module holding torch's names, as torchtitan 0.3.0 makes them."""
    import types

    from torch.distributed.pipelining import PipelineStage, schedules

    from dualpipe_kernels.integrations.torchtitan import use_dualpipe_kernels

    if real:
        import torchtitan.distributed.pipeline_parallel as mod
    else:
        mod = types.ModuleType("stand_in")
        mod.get_schedule_class = schedules.get_schedule_class  # type: ignore[attr-defined]
        mod.ScheduleDualPipeV = schedules.ScheduleDualPipeV  # type: ignore[attr-defined]
        mod.ScheduleZBVZeroBubble = schedules.ScheduleZBVZeroBubble  # type: ignore[attr-defined]
    x, target = batch()
    tokens = torch.tensor(float(target.numel()), dtype=torch.float64)
    out: dict[str, Any] = {}
    for which in ("torch", "ours"):
        restore = use_dualpipe_kernels(["DualPipeV"], module=mod) if which == "ours" else None
        cls = mod.get_schedule_class("DualPipeV")
        if real:
            indices = list(mod._get_pp_rank_to_stage_indices_mapping(rank, world, "DualPipeV", 2 * world))
        else:
            v = cls in (mod.ScheduleZBVZeroBubble, mod.ScheduleDualPipeV)
            indices = [rank, 2 * world - 1 - rank] if v else [rank, rank + world]
        mods = {s: ShiftLayer(s) for s in indices}
        stages = [PipelineStage(mods[s], s, 2 * world, torch.device("cpu")) for s in indices]
        if real:
            from torchtitan.config import ParallelismConfig

            par = ParallelismConfig(
                pipeline_parallel_schedule="DualPipeV",
                pipeline_parallel_degree=world,
                pipeline_parallel_microbatch_size=ROWS // N,
            )
            sched = mod._build_pipeline_schedule(
                parallelism=par, local_batch_size=ROWS, stages=stages, loss_fn=_titan_loss
            )
        else:

            def scalar_loss(*args: Any, **kwargs: Any) -> torch.Tensor:
                return _titan_loss(*args, **kwargs)[0]

            sched = cls(
                stages, n_microbatches=N, loss_fn=scalar_loss, scale_grads=False, backward_requires_autograd=True
            )
        first, last = 0 in indices, 2 * world - 1 in indices
        losses: list[torch.Tensor] | None = [] if last else None
        sched.step(
            arg_mbs=[(c,) for c in x.chunk(N)] if first else None,
            kwarg_mbs=[{"shift": c} for c in shift_input().chunk(N)],  # as torchtitan passes positions
            target_mbs=list(target.chunk(N)) if last else None,
            losses=losses,
            loss_kwargs={"global_valid_tokens": tokens},
            return_outputs=False,
        )
        out[which] = {
            "class": f"{type(sched).__module__}.{type(sched).__name__}",
            "stages": indices,
            "loss": None if losses is None else float(torch.sum(torch.stack(losses)).detach()),
            "grads": {f"{s}.{n}": p.grad.clone() for s, m in mods.items() for n, p in m.named_parameters()},
        }
        if restore is not None:
            sched.close()
            restore()
    out["restored"] = mod.get_schedule_class("DualPipeV") is schedules.ScheduleDualPipeV
    dist.barrier()
    return out


def evaluation(rank: int, world: int) -> dict[str, Any]:
    """``eval()`` of the drop-in's DualPipeV (torch's own fails on its B actions in torch 2.14, so the reference
    is the model's forward in one process): the merged outputs, the losses, no gradients; then a ``step``
    with ``return_outputs=False`` returns None."""
    from torch.distributed.pipelining import PipelineStage

    from dualpipe_kernels.integrations.pipelining import ScheduleDualPipeV

    indices = stage_indices("ScheduleDualPipeV", rank, world)
    stages = [PipelineStage(layer(s), s, 2 * world, torch.device("cpu")) for s in indices]
    sched = ScheduleDualPipeV(stages, N, loss_fn=F.mse_loss)
    x, target = batch()
    losses: list[torch.Tensor] = []
    result = sched.eval(x, target=target, losses=losses) if rank == 0 else sched.eval()
    no_grads = all(p.grad is None for st in stages for p in st.submod.parameters())
    after = sched.step(x, target=target, return_outputs=False) if rank == 0 else sched.step()
    sched.close()
    return {"result": result, "losses": [float(v) for v in losses], "no_grads": no_grads, "after": after}
