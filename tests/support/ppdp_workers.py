"""Rank function and references of the PP x DP tests (module level: spawned workers import it by name).

A tiny float64 model (Linear+tanh layers) is cut into the schedule's model
stages; the global batch is split into DP shards (replica ``d`` takes rows
``[d B, (d+1) B)``), each into the schedule's micro-batches.  The criterion
sums squared errors, so the sum over micro-batches of the per-micro-batch
losses is the full-batch loss, and the full-batch reference is one forward and
backward of the whole batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

DIM = 6
LAYERS = 8  # Linear, Tanh, Linear, Tanh, ...: 4 Linear layers
ROWS_PER_MB = 2


def make_model(seed: int = 0) -> nn.Sequential:
    gen = torch.Generator().manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(LAYERS // 2):
        lin = nn.Linear(DIM, DIM).double()
        with torch.no_grad():
            lin.weight.copy_(torch.randn(DIM, DIM, generator=gen, dtype=torch.float64) / DIM**0.5)
            lin.bias.copy_(torch.randn(DIM, generator=gen, dtype=torch.float64) * 0.1)
        layers += [lin, nn.Tanh()]
    return nn.Sequential(*layers)


def global_batch(rows: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(rows, DIM, generator=gen, dtype=torch.float64),
        torch.randn(rows, DIM, generator=gen, dtype=torch.float64),
    )


def sq_error(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).sum()


def stage_layers(num_model_stages: int) -> list[list[int]]:
    """Layer indices of each model stage (the even split of ``Pipeline.from_sequential``)."""
    base, extra = divmod(LAYERS, num_model_stages)
    sizes = [base + (1 if m < extra else 0) for m in range(num_model_stages)]
    starts = [sum(sizes[:m]) for m in range(num_model_stages)]
    return [list(range(starts[m], starts[m] + sizes[m])) for m in range(num_model_stages)]


def model_grads(model: nn.Sequential, num_model_stages: int) -> list[list[torch.Tensor]]:
    """Per model stage: the gradients of its parameters, in ``parameters()`` order."""
    return [[p.grad.clone() for i in idx for p in model[i].parameters()] for idx in stage_layers(num_model_stages)]


def full_batch_reference(pp: int, dp: int, n: int, num_model_stages: int) -> list[list[torch.Tensor]]:
    """One process, the whole global batch in one forward and backward."""
    model = make_model()
    x, y = global_batch(dp * n * ROWS_PER_MB)
    sq_error(model(x), y).backward()
    return model_grads(model, num_model_stages)


def sharded_reference(pp: int, dp: int, n: int, num_model_stages: int) -> list[list[torch.Tensor]]:
    """Per replica, its micro-batches accumulated in order on a fresh model; then the replicas added in order."""
    x, y = global_batch(dp * n * ROWS_PER_MB)
    total: list[list[torch.Tensor]] | None = None
    for d in range(dp):
        model = make_model()
        for m in range(n):
            lo = (d * n + m) * ROWS_PER_MB
            sq_error(model(x[lo : lo + ROWS_PER_MB]), y[lo : lo + ROWS_PER_MB]).backward()
        g = model_grads(model, num_model_stages)
        total = (
            g
            if total is None
            else [[a + b for a, b in zip(ta, tb, strict=True)] for ta, tb in zip(total, g, strict=True)]
        )
    assert total is not None
    return total


def ppdp_rank(
    rank: int, world: int, schedule_name: str, pp: int, dp: int, n: int, transport: str, dp_op: str = "sum"
) -> dict[str, Any]:
    """One training step of a PP x DP pipeline built from a ("dp", "pp") DeviceMesh; returns grads and timings."""
    from torch.distributed.device_mesh import init_device_mesh

    from dualpipe_kernels.runtime import DiagnosticsOptions, GradientOptions, Pipeline, WireOptions
    from dualpipe_kernels.schedules.generators import build_schedule

    assert world == pp * dp
    mesh = init_device_mesh("cpu", (dp, pp), mesh_dim_names=("dp", "pp"))
    dp_rank = mesh.get_local_rank("dp")
    schedule = build_schedule(schedule_name, pp, n)
    pipe = Pipeline.from_mesh(
        schedule,
        make_model(),
        mesh,
        wire=WireOptions(transport=transport, timeout_s=60),
        diagnostics=DiagnosticsOptions(record_timeline=True),
        # the references sum the micro-batch losses' gradients
        gradients=GradientOptions(dp_op=dp_op, scale_grads=False),
    )
    try:
        x, y = global_batch(dp * n * ROWS_PER_MB)
        rows = slice(dp_rank * n * ROWS_PER_MB, (dp_rank + 1) * n * ROWS_PER_MB)
        res = pipe.step(x[rows], labels=(y[rows],), criterion=sq_error)
        trigger = pipe._dp.trigger if pipe._dp is not None else {}
        grads = {s: [p.grad.clone() for p in m.parameters()] for s, m in pipe.stage_modules.items()}
        # Accumulation over two steps of the same shard, reduced only at the second: twice the first step's sum.
        pipe.zero_grad(set_to_none=True)
        with pipe.no_sync():
            local = pipe.step(x[rows], labels=(y[rows],), criterion=sq_error)
        pipe.step(x[rows], labels=(y[rows],), criterion=sq_error)
        return {
            "pp_rank": pipe.rank,
            "dp_rank": dp_rank,
            "grads": grads,
            "accumulated": {s: [p.grad.clone() for p in m.parameters()] for s, m in pipe.stage_modules.items()},
            "no_sync_reductions": local.dp_reductions,
            "model_stage": {s: schedule.model_stage[s] for s in pipe.stage_modules},
            "timeline": res.timeline,
            "dp_reductions": res.dp_reductions,
            "last_grad_action": {s: str(pipe._loop.actions[i]) for s, i in trigger.items()},
            "losses": {m: float(v) for m, v in res.losses.items()},
            "folds_mirrors": pipe._dp is not None and pipe._dp.folds_mirrors,
        }
    finally:
        pipe.close()


def bad_layouts(pp: int, n: int) -> list[str]:
    """The errors of a mesh without "pp"/"dp" dimensions and of an unknown ``dp_op`` (one per line)."""
    from torch.distributed.device_mesh import init_device_mesh

    from dualpipe_kernels.runtime import Pipeline
    from dualpipe_kernels.schedules.generators import build_schedule

    schedule = build_schedule("dualpipev", pp, n)
    errors = []
    flat = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("world",))
    for kw in ({"mesh": flat}, {"mesh": None, "dp_op": "avg"}):
        try:
            if kw["mesh"] is None:
                Pipeline(schedule, {}, dp_group=dist.group.WORLD, dp_op=kw["dp_op"])
            else:
                Pipeline.from_mesh(schedule, make_model(), kw["mesh"])
            errors.append("no error")
        except ValueError as exc:
            errors.append(str(exc))
    return errors


#: tied_uneven: Linear layers 0 and 6 share their weight (declared: the ranks build separate copies); each
#: replica's 7 rows do not divide into its 4 micro-batches; two SGD steps of the global batch's mean loss
TIED = ("0.weight", "6.weight")
UNEVEN_ROWS, TIED_STEPS, LR = 7, 2, 0.1


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def tied_model(shared: bool) -> nn.Sequential:
    """:func:`make_model` with layer 6's weight layer 0's: the same Parameter (``shared``, the one-process
    reference) or a copy of its values (the pipeline's ranks, which declare the tie)."""
    model = make_model()
    if shared:
        model[6].weight = model[0].weight
    else:
        with torch.no_grad():
            model[6].weight.copy_(model[0].weight)
    return model


def tied_uneven_reference(dp: int) -> dict[str, Any]:
    """One process, the global batch, the tied weight one Parameter: losses of each step and the final state."""
    model = tied_model(shared=True)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = global_batch(dp * UNEVEN_ROWS)
    losses = []
    for _ in range(TIED_STEPS):
        opt.zero_grad()
        loss = mse(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    grads = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}
    params = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return {"losses": losses, "grads": grads, "params": params}


def tied_uneven_rank(pp: int, dp: int, n: int, transport: str) -> dict[str, Any]:
    """:func:`tied_uneven_reference`'s training on a ("dp", "pp") mesh: ``from_mesh`` with ``model_options``
    declaring the tie and ``allow_uneven``; 1F1B puts the two tied layers on different pipeline ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    from dualpipe_kernels.runtime import ModelOptions, Pipeline, WireOptions
    from dualpipe_kernels.schedules.generators import build_schedule

    mesh = init_device_mesh("cpu", (dp, pp), mesh_dim_names=("dp", "pp"))
    dp_rank = mesh.get_local_rank("dp")
    pipe = Pipeline.from_mesh(
        build_schedule("1f1b", pp, n),
        tied_model(shared=False),
        mesh,
        wire=WireOptions(transport=transport, timeout_s=60),
        model_options=ModelOptions(tied_parameters=(TIED,), allow_uneven=True),
    )
    try:
        opt = torch.optim.SGD(pipe.parameters(), lr=LR)
        x, y = global_batch(dp * UNEVEN_ROWS)
        rows = slice(dp_rank * UNEVEN_ROWS, (dp_rank + 1) * UNEVEN_ROWS)
        losses = []
        for _ in range(TIED_STEPS):
            opt.zero_grad()
            res = pipe.step(x[rows], labels=(y[rows],), criterion=mse, reduce_loss=True)
            opt.step()
            losses.append(float(res.loss))
        named = [(m.full_name(local), p) for m in pipe.stage_modules.values() for local, p in m.named_parameters()]
        return {
            "losses": losses,
            "grads": {name: p.grad.clone() for name, p in named},
            "params": {name: p.detach().clone() for name, p in named},
            "microbatch_rows": [len(mb) for mb in x[rows].tensor_split(n)],
        }
    finally:
        pipe.close()


def ppdp_ranks(rank: int, world: int, configs: tuple[tuple[str, str, int, int, int], ...], transport: str) -> dict:
    """:func:`ppdp_rank` for each ``(schedule, dp_op, pp, dp, n)`` in one process group (start-up costs seconds),
    then :func:`tied_uneven_rank` (PP=2 x DP=2, 4 micro-batches) and the bad layouts."""
    out: dict[Any, Any] = {c: ppdp_rank(rank, world, c[0], c[2], c[3], c[4], transport, c[1]) for c in configs}
    out["tied_uneven"] = tied_uneven_rank(2, world // 2, 4, transport)
    out["errors"] = bad_layouts(2, 4)
    return out
