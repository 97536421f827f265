"""Toy stage models, criteria, a single-process reference and the rank functions of the runtime tests.

Everything here is module level so spawned worker processes can import it by
name (``tests/`` is on ``sys.path``: conftest.py puts it there, and the spawn
start method hands the parent's ``sys.path`` to its children).

One spawned group per world size runs many configurations (``RunConfig``) in
a row and returns every rank's losses, gradients and outputs; rank 0 also
returns the single-process reference computed on the same micro-batches.  The
parent (the test) compares them, so a failure names the configuration.

All models are fp32 and tiny (8 features) so a configuration costs
milliseconds; what is under test is the runtime's bookkeeping, not the maths.
"""

from __future__ import annotations

import gc
import os
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

DIM = 8
VOCAB = 16

Tensors = tuple[torch.Tensor, ...]
MicroBatch = tuple[Tensors, Tensors]  # (stage-0 inputs, criterion labels) of one micro-batch


# --------------------------------------------------------------------------------------------
# Stage models
# --------------------------------------------------------------------------------------------
class ToyStage(nn.Module):
    """x [b, DIM] -> tanh(linear(x)) [b, DIM]."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class RichStage(nn.Module):
    """Several tensors per boundary, an integer side input and an unused output.

    ``(x [b, DIM] float, ids [b] int64, unused [b, DIM] float) -> (y, ids, aux)``.
    ``ids`` passes through unchanged (no grad); ``unused`` is ignored, so the
    previous stage's ``aux`` output gets no gradient (its ``aux`` weights keep
    ``grad is None``); only the last stage's ``aux`` reaches the loss.
    """

    def __init__(self, dim: int = DIM, vocab: int = VOCAB) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.emb = nn.Embedding(vocab, dim)
        self.aux = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, unused: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = torch.tanh(self.linear(x) + self.emb(ids))
        return y, ids, self.aux(x)


class ViewStage(nn.Module):
    """Returns a view of its input (forbidden, as in the reference: the runtime frees sent outputs)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape)


class ExitStage(nn.Module):
    """A ToyStage whose ``exit_on``-th forward call kills the process (``os._exit(exit_code)``)."""

    def __init__(self, exit_on: int, exit_code: int = 3, dim: int = DIM) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.exit_on = exit_on
        self.exit_code = exit_code
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.exit_on:
            os._exit(self.exit_code)
        return torch.tanh(self.linear(x))


# ---- the reference's example model (examples/example_dualpipe.py), written for the compat API ----
class _ExampleLinearFunc(torch.autograd.Function):
    """y = x @ W^T whose weight gradient goes through ``WeightGradStore`` when it is enabled."""

    @staticmethod
    def forward(ctx: Any, inp: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inp, weight)
        return F.linear(inp, weight)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        from dualpipe_kernels.compat import WeightGradStore

        inp, weight = ctx.saved_tensors
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)

        def grad_weight_fn() -> None:
            weight.grad += grad_output.flatten(0, -2).T @ inp.flatten(0, -2)

        if WeightGradStore.enabled:
            weight.deferred_w = getattr(weight, "deferred_w", 0) + 1  # counted so tests see the store was used
            WeightGradStore.put(grad_weight_fn)
        else:
            grad_weight_fn()
        return grad_output @ weight, None


class _ExampleLinear(nn.Linear):
    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        return _ExampleLinearFunc.apply(inp, self.weight)


class ExampleStage(nn.Module):
    """The reference example's stage: linear (DIM -> 4 DIM), gelu, linear (4 DIM -> DIM), no bias.

    Defines ``overlapped_forward_backward`` (the reference's contract); each call
    is counted in ``fb_calls`` so tests can check the hook ran.
    """

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.linear1 = _ExampleLinear(dim, dim * 4, bias=False)
        self.linear2 = _ExampleLinear(dim * 4, dim, bias=False)
        self.fb_calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(F.gelu(self.linear1(x)))

    @classmethod
    def overlapped_forward_backward(
        cls,
        module0: ExampleStage,
        inputs0: Sequence[torch.Tensor],
        criterion0: Callable[..., torch.Tensor] | None,
        labels0: Sequence[torch.Tensor],
        module1: ExampleStage,
        loss1: torch.Tensor | None,
        outputs1: Sequence[torch.Tensor],
        output_grads1: Sequence[torch.Tensor],
    ) -> tuple[Sequence[torch.Tensor], torch.Tensor | None]:
        from dualpipe_kernels.compat import run_backward

        module0.fb_calls += 1
        outputs0 = module0(*inputs0)
        outputs0 = [outputs0] if isinstance(outputs0, torch.Tensor) else outputs0
        loss0 = criterion0(*outputs0, *labels0) if criterion0 is not None else None
        if loss1 is not None:
            loss1.backward()
            loss1.detach_()
        else:
            run_backward(outputs1, output_grads1)
        return outputs0, loss0


# --------------------------------------------------------------------------------------------
# Criteria (module level: picklable)
# --------------------------------------------------------------------------------------------
def mse_criterion(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, label)


def example_criterion(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    # .clone() as in the reference example: the runtime may detach_() the loss in place.
    return F.mse_loss(out, label).clone()


def rich_criterion(y: torch.Tensor, ids: torch.Tensor, aux: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(y, label) + 0.125 * aux.pow(2).mean() + 0.0 * ids.sum()


MODEL_KINDS = ("toy", "rich", "example")


def make_stage(kind: str, model_stage: int, seed: int = 0) -> nn.Module:
    """A fresh stage module of ``kind`` whose weights depend only on (kind, model_stage, seed)."""
    torch.manual_seed(1000 * seed + 17 * model_stage + 1)
    if kind == "toy":
        return ToyStage()
    if kind == "rich":
        return RichStage()
    if kind == "example":
        return ExampleStage()
    raise ValueError(f"unknown model kind {kind!r}; expected one of {MODEL_KINDS}")


def criterion_of(kind: str) -> Callable[..., torch.Tensor]:
    return {"toy": mse_criterion, "rich": rich_criterion, "example": example_criterion}[kind]


# --------------------------------------------------------------------------------------------
# Configurations and data
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunConfig:
    """One pipeline run: schedule, size, API, transport, model; ``key`` names it in test ids."""

    schedule: str
    ranks: int
    microbatches: int
    stages_per_rank: int | None = None
    api: str = "native"  # "native" (Pipeline) | "compat" (dualpipe_kernels.compat)
    transport: str = "torch"
    model: str = "toy"
    batch: int | None = None  # rows of the full batch; default 2 * microbatches
    train_outputs: bool = False  # also ask for outputs in the training step
    seed: int = 0
    reversed_mapping: bool = False  # rank_mapping[group rank] = ranks - 1 - group rank
    subgroup: tuple[int, ...] | None = None  # world ranks of the pipeline's process group (None: the default group)

    @property
    def key(self) -> str:
        spr = f"x{self.stages_per_rank}" if self.stages_per_rank else ""
        rows = f"-b{self.batch}" if self.batch is not None else ""
        extra = "-revmap" if self.reversed_mapping else ""
        extra += "-group" + "".join(map(str, self.subgroup)) if self.subgroup else ""
        name = f"{self.schedule}{spr}-r{self.ranks}-n{self.microbatches}"
        return f"{name}-{self.api}-{self.transport}-{self.model}{rows}{extra}"

    @property
    def mapping(self) -> list[int]:
        """rank_mapping: group rank -> pipeline rank."""
        return [self.ranks - 1 - g for g in range(self.ranks)] if self.reversed_mapping else list(range(self.ranks))

    @property
    def world(self) -> int:
        """Processes the spawned run needs."""
        return max(self.subgroup) + 1 if self.subgroup else self.ranks

    @property
    def rows(self) -> int:
        return self.batch if self.batch is not None else 2 * self.microbatches


def make_tensors(kind: str, rows: int, seed: int) -> tuple[Tensors, Tensors]:
    """Deterministic (inputs, labels) for ``rows`` samples."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, DIM, generator=g)
    label = torch.randn(rows, DIM, generator=g)
    if kind == "rich":
        ids = torch.randint(0, VOCAB, (rows,), generator=g)
        unused = torch.randn(rows, DIM, generator=g)
        return (x, ids, unused), (label,)
    return (x,), (label,)


def split(tensors: Tensors, chunks: int, dim: int = 0) -> list[Tensors]:
    """``tensor_split`` every tensor into ``chunks`` and regroup per micro-batch."""
    parts = [t.tensor_split(chunks, dim=dim) for t in tensors]
    return [tuple(p[i] for p in parts) for i in range(chunks)]


def compat_dualpipe_batches(cfg: RunConfig) -> tuple[tuple[Tensors, Tensors], tuple[Tensors, Tensors]]:
    """The reference DualPipe's two half batches: ((x_first_rank, l_first_rank), (x_last_rank, l_last_rank)).

    The first rank feeds micro-batches 0..N/2-1 and holds the labels of
    N/2..N-1 (its loss is theirs); the last rank the other way round.
    """
    x0, l0 = make_tensors(cfg.model, cfg.rows, cfg.seed + 1)
    x1, l1 = make_tensors(cfg.model, cfg.rows, cfg.seed + 2)
    return (x0, l1), (x1, l0)


def microbatches_of(cfg: RunConfig) -> list[MicroBatch]:
    """The micro-batches the pipeline sees, in micro-batch order (ground truth for the reference)."""
    n = cfg.microbatches
    if cfg.api == "compat" and cfg.schedule == "dualpipe":
        (x0, l1), (x1, l0) = compat_dualpipe_batches(cfg)
        xs = split(x0, n // 2) + split(x1, n // 2)
        ls = split(l0, n // 2) + split(l1, n // 2)
        return list(zip(xs, ls, strict=True))
    x, label = make_tensors(cfg.model, cfg.rows, cfg.seed + 1)
    return list(zip(split(x, n), split(label, n), strict=True))


def build_schedule_for(cfg: RunConfig) -> Any:
    from dualpipe_kernels.schedules.generators import build_schedule

    return build_schedule(cfg.schedule, cfg.ranks, cfg.microbatches, stages_per_rank=cfg.stages_per_rank)


def make_all_stages(cfg: RunConfig, schedule: Any, shared: bool = False) -> dict[int, nn.Module]:
    """One module per IR stage (copies of a model stage get equal weights), or with ``shared`` one per model stage."""
    by_model: dict[int, nn.Module] = {}
    out: dict[int, nn.Module] = {}
    for s in range(schedule.num_stages):
        ms = schedule.model_stage[s]
        if shared:
            if ms not in by_model:
                by_model[ms] = make_stage(cfg.model, ms, cfg.seed)
            out[s] = by_model[ms]
        else:
            out[s] = make_stage(cfg.model, ms, cfg.seed)
    return out


# --------------------------------------------------------------------------------------------
# Single-process reference
# --------------------------------------------------------------------------------------------
def as_tuple(out: Any) -> Tensors:
    return (out,) if isinstance(out, torch.Tensor) else tuple(out)


def reference_step(
    stages: dict[int, nn.Module],
    schedule: Any,
    microbatches: Sequence[MicroBatch],
    criterion: Callable[..., torch.Tensor],
    forward_only: bool = False,
) -> tuple[dict[int, torch.Tensor], dict[int, Tensors]]:
    """Each micro-batch in order: forward along its path of stages, loss, backward (unscaled).

    Gradients accumulate in ``stages``. Returns (losses, outputs) per micro-batch, detached.
    """
    losses: dict[int, torch.Tensor] = {}
    outputs: dict[int, Tensors] = {}
    for mb, (inputs, labels) in enumerate(microbatches):
        with torch.set_grad_enabled(not forward_only):
            h = tuple(inputs)
            for s in schedule.path(mb):
                h = as_tuple(stages[s](*h))
            loss = criterion(*h, *labels)
            if not forward_only:
                loss.backward()
        losses[mb] = loss.detach()
        outputs[mb] = tuple(t.detach() for t in h)
    return losses, outputs


def grads_of(module: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: (p.grad.detach().clone() if p.grad is not None else None) for n, p in module.named_parameters()}


def reference_results(cfg: RunConfig) -> dict[str, Any]:
    """Reference losses/outputs/grads per IR stage (distinct copies) and, for DualPipe, per model stage (shared)."""
    schedule = build_schedule_for(cfg)
    mbs = microbatches_of(cfg)
    crit = criterion_of(cfg.model)
    stages = make_all_stages(cfg, schedule)
    losses, _ = reference_step(stages, schedule, mbs, crit)
    res: dict[str, Any] = {"losses": losses, "grads": {s: grads_of(m) for s, m in stages.items()}}
    if len(set(schedule.model_stage)) != schedule.num_stages:
        shared = make_all_stages(cfg, schedule, shared=True)
        reference_step(shared, schedule, mbs, crit)
        res["shared_grads"] = {schedule.model_stage[s]: grads_of(m) for s, m in shared.items()}
    infer_losses, infer_outputs = reference_step(make_all_stages(cfg, schedule), schedule, mbs, crit, forward_only=True)
    res["infer_losses"] = infer_losses
    res["infer_outputs"] = infer_outputs
    res["paths"] = [schedule.path(m) for m in range(cfg.microbatches)]
    res["model_stage"] = tuple(schedule.model_stage)
    res["stage_to_rank"] = tuple(schedule.stage_to_rank)
    return res


# --------------------------------------------------------------------------------------------
# What one rank does for one configuration
# --------------------------------------------------------------------------------------------
def _rank_inputs(schedule: Any, pp_rank: int, mbs_inputs: Tensors, labels: Tensors) -> tuple[Tensors, Tensors]:
    """Full-batch inputs only on ranks holding a first stage, labels only on ranks holding a loss stage."""
    mine = set(schedule.stages_of_rank(pp_rank))
    n = schedule.num_microbatches
    first = any(schedule.path(m)[0] in mine for m in range(n))
    last = any(schedule.path(m)[-1] in mine for m in range(n))
    return (mbs_inputs if first else ()), (labels if last else ())


def run_native(cfg: RunConfig, rank: int, group: Any, timeout_s: float) -> dict[str, Any]:
    """Training step then inference step through ``Pipeline`` on pipeline rank ``rank``; losses, grads, outputs."""
    from dualpipe_kernels.runtime import Pipeline

    schedule = build_schedule_for(cfg)
    stages = make_all_stages(cfg, schedule)
    local = {s: stages[s] for s in schedule.stages_of_rank(rank)}
    x, label = make_tensors(cfg.model, cfg.rows, cfg.seed + 1)
    x, label = _rank_inputs(schedule, rank, x, label)
    crit = criterion_of(cfg.model)
    pipe = Pipeline(  # scale_grads=False: reference_step sums the micro-batch losses (as compat does)
        schedule,
        local,
        group=group,
        rank_mapping=cfg.mapping,
        transport=cfg.transport,
        timeout_s=timeout_s,
        scale_grads=False,
    )
    try:
        res = pipe.step(*x, labels=label, criterion=crit, return_outputs=cfg.train_outputs)
        out: dict[str, Any] = {
            "losses": dict(res.losses),
            "grads": {s: grads_of(m) for s, m in local.items()},
            "train_outputs": dict(res.outputs) if res.outputs is not None else None,
        }
        for m in local.values():
            m.zero_grad(set_to_none=True)
        with torch.no_grad():
            res = pipe.step(*x, labels=label, criterion=crit, return_outputs=True)
        out["infer_losses"] = dict(res.losses)
        out["infer_outputs"] = dict(res.outputs) if res.outputs is not None else {}
        out["fb_calls"] = sum(getattr(m, "fb_calls", 0) for m in local.values())
        out["deferred_w"] = sum(getattr(p, "deferred_w", 0) for m in local.values() for p in m.parameters())
    finally:
        pipe.close()
    return out


def run_compat(cfg: RunConfig, rank: int, group: Any, timeout_s: float) -> dict[str, Any]:
    """The reference's calling convention through ``dualpipe_kernels.compat``.

    Returns what ``step`` returned (``loss``/``outputs``, per the reference: only
    on the first/last rank) plus this rank's grads keyed by IR stage.
    """
    from dualpipe_kernels import compat

    schedule = build_schedule_for(cfg)
    stages = make_all_stages(cfg, schedule)
    r, n = cfg.ranks, cfg.microbatches
    s0, s1 = rank, 2 * r - 1 - rank  # module[0] and module[1] of pp rank `rank` (both DualPipe and DualPipeV)
    modules = (stages[s0], stages[s1])
    crit = criterion_of(cfg.model)
    if cfg.schedule == "dualpipev":
        cls: Any = compat.DualPipeV
        x, label = make_tensors(cfg.model, cfg.rows, cfg.seed + 1)
        feeds = rank == 0
    elif cfg.schedule == "dualpipe":
        cls = compat.DualPipe
        (x0, l0), (x1, l1) = compat_dualpipe_batches(cfg)
        x, label = (x0, l0) if rank == 0 else (x1, l1)
        feeds = rank in (0, r - 1)
    else:
        raise ValueError(f"compat has no class for schedule {cfg.schedule!r}")
    if not feeds:  # middle ranks pass None, as in the reference's example
        x, label = (None,) * len(x), (None,) * len(label)
    compat.set_p2p_tensor_shapes([(2, DIM)])  # accepted and ignored: shapes travel at run time
    compat.set_p2p_tensor_dtype(torch.float32)
    model = cls(modules, 0, group, cfg.mapping, transport=cfg.transport, timeout_s=timeout_s)
    try:
        loss, outputs = model.step(*x, num_chunks=n, criterion=crit, labels=label, return_outputs=cfg.train_outputs)
        out: dict[str, Any] = {
            "loss": loss,
            "outputs": outputs,
            "grads": {s0: grads_of(stages[s0]), s1: grads_of(stages[s1])},
        }
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            loss, outputs = model.step(*x, num_chunks=n, criterion=crit, labels=label, return_outputs=True)
        out["infer_loss"] = loss
        out["infer_outputs"] = outputs
        out["fb_calls"] = sum(getattr(m, "fb_calls", 0) for m in modules)
        out["deferred_w"] = sum(getattr(p, "deferred_w", 0) for m in modules for p in m.parameters())
    finally:
        model.close()
    return out


def _run_one(cfg: RunConfig, rank: int, group: Any, members: list[int], timeout_s: float) -> dict[str, Any]:
    if cfg.api == "port":
        return example_port(rank, len(members), cfg.schedule, cfg.microbatches)
    if rank not in members:
        return {"skipped": True}
    pp_rank = cfg.mapping[members.index(rank)]
    runner = run_compat if cfg.api == "compat" else run_native
    res = runner(cfg, pp_rank, group, timeout_s)
    res["pp_rank"] = pp_rank
    return res


def run_configs(rank: int, world_size: int, configs: Sequence[RunConfig], timeout_s: float = 30.0) -> dict[str, Any]:
    """Rank function: run every configuration in order and return ``{key: result}``.

    A configuration that raises maps to ``{"error": traceback}``.  After each
    configuration the ranks compare notes (``all_gather_object``); once one has
    failed, every later configuration runs on a fresh process group (the failed
    step may have left transfers in flight on the old one) and its result
    carries ``"after_failure"``.  Rank 0 adds ``{"ref:" + key: reference_results(cfg)}``.
    """
    torch.use_deterministic_algorithms(True)
    results: dict[str, Any] = {}
    failed: str | None = None
    for cfg in configs:
        if cfg.world != world_size:
            raise ValueError(f"config {cfg.key} needs {cfg.world} processes, world size is {world_size}")
        # torch orders a group's ranks by world rank, whatever order new_group() was given
        members = sorted(cfg.subgroup) if cfg.subgroup else list(range(world_size))
        group = dist.new_group(members) if (cfg.subgroup or failed) else None  # collective: every rank calls it
        try:
            res = _run_one(cfg, rank, group, members, timeout_s)
        except Exception:  # noqa: BLE001 - reported to the parent, which fails the test that owns cfg
            res = {"error": f"rank {rank}:\n{traceback.format_exc()}"}
        if failed is not None:
            res["after_failure"] = failed
        results[cfg.key] = res
        status: list[Any] = [None] * world_size
        dist.all_gather_object(status, "error" in res)
        if failed is None and any(status):
            failed = cfg.key
        if rank == 0 and cfg.api != "port":
            try:
                results["ref:" + cfg.key] = reference_results(cfg)
            except Exception:  # noqa: BLE001
                results["ref:" + cfg.key] = {"error": traceback.format_exc()}
    return results


# --------------------------------------------------------------------------------------------
# Two pipelines alive in one process
# --------------------------------------------------------------------------------------------
def _sgd(modules: Sequence[nn.Module], lr: float = 0.125) -> None:
    with torch.no_grad():
        for m in modules:
            for p in m.parameters():
                if p.grad is not None:
                    p -= lr * p.grad
                    p.grad = None


@dataclass
class _PipeUnderTest:
    """A pipeline plus what it needs to take a step; ``record`` collects (losses, grads) per step."""

    step: Callable[[], Any]
    modules: list[nn.Module]
    close: Callable[[], None]
    record: list[Any] = field(default_factory=list)


def _make_native_dualpipev(rank: int, world: int, seed: int, timeout_s: float) -> _PipeUnderTest:
    from dualpipe_kernels.runtime import Pipeline

    cfg = RunConfig("dualpipev", world, 2 * world + 1, seed=seed)
    schedule = build_schedule_for(cfg)
    stages = make_all_stages(cfg, schedule)
    local = {s: stages[s] for s in schedule.stages_of_rank(rank)}
    x, label = make_tensors(cfg.model, cfg.rows, seed + 1)
    pipe = Pipeline(schedule, local, transport="torch", timeout_s=timeout_s)

    def step() -> Any:
        res = pipe.step(*x, labels=label, criterion=mse_criterion)
        return {k: v.clone() for k, v in res.losses.items()}

    return _PipeUnderTest(step, list(local.values()), pipe.close)


def _make_compat_example(rank: int, world: int, seed: int, timeout_s: float) -> _PipeUnderTest:
    from dualpipe_kernels import compat

    cfg = RunConfig("dualpipev", world, 2 * world + 2, api="compat", model="example", seed=seed)
    schedule = build_schedule_for(cfg)
    stages = make_all_stages(cfg, schedule)
    modules = [stages[rank], stages[2 * world - 1 - rank]]
    x, label = make_tensors(cfg.model, cfg.rows, seed + 1)
    model = compat.DualPipeV(modules, timeout_s=timeout_s)

    def step() -> Any:
        loss, _ = model.step(
            *(x if rank == 0 else (None,)),
            num_chunks=cfg.microbatches,
            criterion=example_criterion,
            labels=label if rank == 0 else (None,),
        )
        return loss

    return _PipeUnderTest(step, modules, model.close)


def _run_steps(pipes: Sequence[_PipeUnderTest], steps: int) -> None:
    for _ in range(steps):
        for p in pipes:
            loss = p.step()
            p.record.append((loss, [grads_of(m) for m in p.modules]))
            _sgd(p.modules)


def two_pipelines(rank: int, world_size: int, steps: int = 3, timeout_s: float = 30.0) -> dict[str, Any]:
    """Rank function: a native DualPipeV and a compat DualPipeV (WeightGradStore model), alone then interleaved."""
    makers = (_make_native_dualpipev, _make_compat_example)
    alone = []
    for i, make in enumerate(makers):
        p = make(rank, world_size, 10 + i, timeout_s)
        try:
            _run_steps([p], steps)
        finally:
            p.close()
        alone.append(p.record)
    together = [make(rank, world_size, 10 + i, timeout_s) for i, make in enumerate(makers)]
    try:
        _run_steps(together, steps)
    finally:
        for p in together:
            p.close()
    return {"alone": alone, "together": [p.record for p in together]}


# --------------------------------------------------------------------------------------------
# Error handling
# --------------------------------------------------------------------------------------------
def _bad_input_case(rank: int, world_size: int, case: str, group: Any, timeout_s: float) -> None:
    """One kind of bad input on a DualPipeV over ``group``; returns only if nothing raised."""
    from dualpipe_kernels import compat
    from dualpipe_kernels.runtime import Pipeline

    cfg = RunConfig("dualpipev", world_size, 2 * world_size)
    schedule = build_schedule_for(cfg)
    stages = make_all_stages(cfg, schedule)
    x, label = make_tensors("toy", cfg.rows, 1)
    mine = {s: stages[s] for s in schedule.stages_of_rank(rank)}
    two = (stages[rank], stages[2 * world_size - 1 - rank])
    crit: Any = mse_criterion
    if case == "compat_few_microbatches":  # N < 2 * ranks, same mistake on every rank
        model = compat.DualPipeV(two, process_group=group, timeout_s=timeout_s)
        try:
            model.step(*x, num_chunks=2 * world_size - 1, criterion=crit, labels=label)
        finally:
            model.close()
        return
    if case == "compat_wrong_module_count":  # rank 0 passes one module; the others go on to step
        model = compat.DualPipeV(two[:1] if rank == 0 else two, process_group=group, timeout_s=timeout_s)
        try:
            model.step(*x, num_chunks=cfg.microbatches, criterion=crit, labels=label)
        finally:
            model.close()
        return
    if case == "batch_smaller_than_microbatches":  # rank 0 (which feeds) has fewer rows than micro-batches
        x = tuple(t[: cfg.microbatches - 1] for t in x)
        label = tuple(t[: cfg.microbatches - 1] for t in label)
    elif case == "wrong_module_count":  # rank 0 forgets one of its two stages
        if rank == 0:
            mine = dict(list(mine.items())[:1])
    elif case == "no_criterion":  # rank 0 holds the loss stage
        crit = None
    elif case == "view_output":  # stage 2 (rank 1, sends to stage 3 on rank 0) returns a view of its input
        if 2 in mine:
            mine[2] = ViewStage()
    else:
        raise ValueError(f"unknown bad-input case {case!r}")
    pipe = Pipeline(schedule, mine, group=group, timeout_s=timeout_s)
    try:
        pipe.step(*x, labels=label, criterion=crit)
    finally:
        pipe.close()


def bad_inputs(rank: int, world_size: int, cases: Sequence[str], timeout_s: float) -> dict[str, Any]:
    """Rank function: every bad-input case in turn, each on a fresh process group.

    Returns ``{case: {"error": traceback or None, "elapsed_s": seconds}}``; a
    rank that does not raise has ``error`` None.  A fresh group per case keeps
    transfers left in flight by one failed case away from the next.
    """
    out: dict[str, Any] = {}
    for case in cases:
        group = dist.new_group(list(range(world_size)))
        t0 = time.monotonic()
        err: str | None = None
        try:
            _bad_input_case(rank, world_size, case, group, timeout_s)
        except Exception:  # noqa: BLE001 - the point of the test
            err = traceback.format_exc()
        out[case] = {"error": err, "elapsed_s": time.monotonic() - t0}
        dist.barrier()  # on the default group, untouched by the cases
    return out


def kill_mid_step(rank: int, world_size: int, victim: int, exit_on: int, timeout_s: float) -> float:
    """Rank function: DualPipeV where ``victim``'s first stage exits the process on its ``exit_on``-th forward.

    Survivors return nothing: they must raise; the error is checked by the parent.
    """
    from dualpipe_kernels.runtime import Pipeline

    cfg = RunConfig("dualpipev", world_size, 2 * world_size + 2)
    schedule = build_schedule_for(cfg)
    stages = make_all_stages(cfg, schedule)
    if rank == victim:
        stages[victim] = ExitStage(exit_on)
    x, label = make_tensors("toy", cfg.rows, 1)
    pipe = Pipeline(schedule, {s: stages[s] for s in schedule.stages_of_rank(rank)}, timeout_s=timeout_s)
    t0 = time.monotonic()
    try:
        pipe.step(*x, labels=label, criterion=mse_criterion)
    finally:
        pipe.close()
    return time.monotonic() - t0


# --------------------------------------------------------------------------------------------
# Memory across steps
# --------------------------------------------------------------------------------------------
def live_tensors() -> int:
    """Number of gc-tracked torch.Tensor objects (parameters and grads included)."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def many_steps(rank: int, world_size: int, schedule_name: str, api: str, steps: int) -> dict[str, Any]:
    """Rank function: ``steps`` training steps (SGD in between); live tensors and RSS after each."""
    from dualpipe_kernels import compat
    from dualpipe_kernels.runtime import Pipeline

    n = 2 * world_size + 2
    cfg = RunConfig(schedule_name, world_size, n, api=api, model="example" if api == "compat" else "toy")
    schedule = build_schedule_for(cfg)
    stages = make_all_stages(cfg, schedule)
    x, label = make_tensors(cfg.model, 4096, 1)  # ~20 KB per activation: leaking them would show in RSS
    if api == "compat":
        mods = [stages[rank], stages[2 * world_size - 1 - rank]]
        model = compat.DualPipeV(mods, timeout_s=30.0)

        def step() -> None:
            model.step(
                *(x if rank == 0 else (None,)),
                num_chunks=n,
                criterion=example_criterion,
                labels=label if rank == 0 else (None,),
            )

        close = model.close
    else:
        mods = [stages[s] for s in schedule.stages_of_rank(rank)]
        pipe = Pipeline(schedule, {s: stages[s] for s in schedule.stages_of_rank(rank)}, timeout_s=30.0)

        def step() -> None:
            pipe.step(*x, labels=label, criterion=mse_criterion)

        close = pipe.close
    tensors: dict[int, int] = {}  # step -> live tensors after it (every 5th step: a gc scan costs ~0.1 s)
    rss: list[int] = []
    t0 = time.perf_counter()
    try:
        for i in range(1, steps + 1):
            step()
            _sgd(mods, lr=1e-3)
            if i % 5 == 0:
                tensors[i] = live_tensors()
            rss.append(rss_bytes())
    finally:
        close()
    dist.barrier()
    return {"tensors": tensors, "rss": rss, "seconds": time.perf_counter() - t0}


def lifecycle(rank: int, world_size: int, steps: int) -> dict[str, Any]:
    """Rank function: two pipelines in one process, then ``steps`` steps native and compat (memory)."""
    return {
        "two_pipelines": two_pipelines(rank, world_size),
        "memory_native": many_steps(rank, world_size, "dualpipev", "native", steps),
        "memory_compat": many_steps(rank, world_size, "dualpipev", "compat", steps),
    }


# --------------------------------------------------------------------------------------------
# The configurations each world size runs (one spawn per world size serves every test file)
# --------------------------------------------------------------------------------------------
def configs_for_world(world: int) -> list[RunConfig]:
    """Every configuration of the shared spawned run with ``world`` processes, in run order.

    toy: bit-exactness of every schedule (native API and compat); rich: uneven
    batch, several tensors per boundary, integer ids, an unused output;
    example: the reference's example model (overlap hook, WeightGradStore)
    through compat; port: the reference's example program.  A reversed
    rank_mapping and a pipeline on a subgroup of the world check that no code
    assumes pipeline rank == world rank.  The "native" transport goes last so
    a failure there cannot disturb the rest.
    """
    r = world
    n_v = 2 * r + 1 if r % 2 else 2 * r + 2  # DualPipeV: odd N allowed; N >= 2R
    n_d, n_1 = 2 * r + 2, 2 * r + 1
    out: list[RunConfig] = [
        RunConfig("dualpipev", r, n_v),
        RunConfig("dualpipev", r, n_v, api="compat"),
        RunConfig("dualpipev", r, n_v, api="compat", model="example"),
    ]
    if r in (2, 4):
        out += [
            RunConfig("dualpipe", r, n_d),
            RunConfig("dualpipe", r, n_d, api="compat"),
            RunConfig("dualpipe", r, n_d, api="compat", model="example"),
            RunConfig("1f1b", r, n_1),
            RunConfig("gpipe", r, n_1),
            RunConfig("zb1p", r, n_1),
            RunConfig("interleaved1f1b", r, 2 * r, stages_per_rank=2),
            # uneven batch (2N + 3 rows), three tensors per boundary, int ids, an unused output
            RunConfig("dualpipev", r, n_v, model="rich", batch=2 * n_v + 3, train_outputs=True),
            RunConfig("dualpipe", r, n_d, model="rich", batch=2 * n_d + 3, train_outputs=True),
            RunConfig("dualpipe", r, n_d, api="compat", model="rich", batch=n_d + 1, train_outputs=True),
            RunConfig("dualpipev", r, n_v, api="compat", model="rich", batch=2 * n_v + 3, train_outputs=True),
        ]
    if r == 2:
        out += [
            RunConfig("1f1b", r, n_1, model="rich", batch=2 * n_1 + 3, train_outputs=True),
            RunConfig("zb1p", r, n_1, model="rich", batch=2 * n_1 + 3, train_outputs=True),
            RunConfig("interleaved1f1b", r, 2 * r, stages_per_rank=2, model="rich", batch=4 * r + 3),
        ]
    if r == 4:
        out += [
            RunConfig("dualpipev", r, n_v, reversed_mapping=True),
            RunConfig("dualpipe", r, n_d, reversed_mapping=True),
            RunConfig("dualpipe", r, n_d, api="compat", reversed_mapping=True),
            RunConfig("dualpipev", 2, 6, subgroup=(1, 3)),
            RunConfig("dualpipev", 2, 6, api="compat", model="example", subgroup=(0, 3), reversed_mapping=True),
            RunConfig("dualpipe", r, 10, api="port", model="example"),
            RunConfig("dualpipev", r, 10, api="port", model="example"),
        ]
    # the native transport last
    if r in (2, 4):
        out += [RunConfig("dualpipev", r, n_v, transport="native")]
    if r == 2:
        out += [
            RunConfig("1f1b", r, n_1, transport="native"),
            RunConfig("dualpipe", r, n_d, transport="native"),
            RunConfig("dualpipev", r, n_v, api="compat", transport="native"),
            RunConfig("dualpipev", r, n_v, transport="native", model="rich", batch=2 * n_v + 3),
        ]
    if r == 4:
        out += [RunConfig("dualpipev", r, n_v, api="compat", transport="native", model="example")]
    return out


# --------------------------------------------------------------------------------------------
# Checks (run in the parent on what the ranks returned)
# --------------------------------------------------------------------------------------------
COS_TOL = 1e-13


def cos_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """1 - 2 sum(xy) / (sum(xx) + sum(yy)) in float64 (0 for identical tensors, 0 when both are zero)."""
    x, y = x.detach().double(), y.detach().double()
    den = float((x * x).sum() + (y * y).sum())
    return 0.0 if den == 0.0 else 1.0 - 2.0 * float((x * y).sum()) / den


def _same(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))


def _describe(a: Any) -> str:
    if isinstance(a, torch.Tensor):
        return f"tensor{tuple(a.shape)} {a.dtype} {a.flatten()[:4].tolist()}"
    if a is None:
        return "None"
    return "(" + ", ".join(_describe(x) for x in a) + ")"


def _expect_same(what: str, got: Any, want: Any, errors: list[str]) -> None:
    if not _same(got, want):
        errors.append(f"{what}: got {_describe(got)}, want {_describe(want)}")


def _count_actions(schedule: Any, rank: int) -> tuple[int, int]:
    """(OVERLAP_F_B pairs, backward halves that are I) in ``rank``'s compute actions."""
    pairs = inputs_grad = 0
    for a in schedule.compute_actions(rank):
        pairs += a.type.value == "OVERLAP_F_B"
        inputs_grad += sum(c.type.value == "I" for c in a.computes())
    return pairs, inputs_grad


def _gather(outs: Sequence[Tensors]) -> Any:
    cat = tuple(torch.cat(parts, dim=0) for parts in zip(*outs, strict=True))
    return cat[0] if len(cat) == 1 else cat


def check_config(cfg: RunConfig, results: Sequence[dict[str, Any]]) -> list[str]:
    """Compare every rank's results for ``cfg`` with the reference; return the mismatches (empty: all good)."""
    got = [res.get(cfg.key, {"error": "missing"}) for res in results]
    errors = [f"process {r}: {res['error']}" for r, res in enumerate(got) if "error" in res]
    if errors:
        return errors
    ranks: list[dict[str, Any]] = [{} for _ in range(cfg.ranks)]  # indexed by pipeline rank
    for res in got:
        if not res.get("skipped"):
            ranks[res["pp_rank"]] = res
    after = got[0].get("after_failure")
    note = f" (NB: ran after the failed configuration {after}; may be collateral)" if after else ""
    ref = results[0]["ref:" + cfg.key]
    if "error" in ref:
        return [f"reference failed: {ref['error']}"]
    schedule = build_schedule_for(cfg)
    if cfg.api == "compat":
        _check_compat(cfg, schedule, ranks, ref, errors)
    else:
        _check_native(cfg, schedule, ranks, ref, errors)
    _check_grads(cfg, schedule, ranks, ref, errors)
    if cfg.model == "example":
        for r, res in enumerate(ranks):
            pairs, n_i = _count_actions(schedule, r)
            if res["fb_calls"] != pairs:
                errors.append(
                    f"rank {r}: overlapped_forward_backward ran {res['fb_calls']} times, schedule has {pairs}"
                )
            if res["deferred_w"] != 2 * n_i:
                errors.append(
                    f"rank {r}: WeightGradStore got {res['deferred_w']} deferred weight grads, "
                    f"want 2 per I action = {2 * n_i}"
                )
    return [e + note for e in errors]


def _check_native(cfg: RunConfig, schedule: Any, ranks: Sequence[dict], ref: dict, errors: list[str]) -> None:
    n = cfg.microbatches
    for phase, loss_key, out_key in (("train", "losses", "train_outputs"), ("infer", "infer_losses", "infer_outputs")):
        ref_losses = ref["losses"] if phase == "train" else ref["infer_losses"]
        got: dict[int, torch.Tensor] = {}
        for r, res in enumerate(ranks):
            for mb, loss in res[loss_key].items():
                want_rank = schedule.stage_to_rank[schedule.path(mb)[-1]]
                if want_rank != r:
                    errors.append(
                        f"{phase}: loss of micro-batch {mb} returned on rank {r}, its loss stage is on {want_rank}"
                    )
                got[mb] = loss
        if sorted(got) != list(range(n)):
            errors.append(f"{phase}: losses returned for micro-batches {sorted(got)}, want 0..{n - 1}")
        for mb in sorted(got):
            _expect_same(f"{phase} loss of micro-batch {mb}", got[mb], ref_losses[mb], errors)
        if phase == "train" and not cfg.train_outputs:
            continue
        outs: dict[int, Tensors] = {}
        for res in ranks:
            outs.update(res[out_key] or {})
        if sorted(outs) != list(range(n)):
            errors.append(f"{phase}: outputs returned for micro-batches {sorted(outs)}, want 0..{n - 1}")
        for mb in sorted(outs):
            _expect_same(f"{phase} outputs of micro-batch {mb}", tuple(outs[mb]), ref["infer_outputs"][mb], errors)


def _compat_mbs(cfg: RunConfig, rank: int) -> list[int] | None:
    """The micro-batches whose loss/outputs ``step`` returns on ``rank`` (None: it returns nothing)."""
    n, r = cfg.microbatches, cfg.ranks
    if cfg.schedule == "dualpipev":
        return list(range(n)) if rank == 0 else None
    if rank == 0:
        return list(range(n // 2, n))
    if rank == r - 1:
        return list(range(n // 2))
    return None


def _check_compat(cfg: RunConfig, schedule: Any, ranks: Sequence[dict], ref: dict, errors: list[str]) -> None:
    for r, res in enumerate(ranks):
        mbs = _compat_mbs(cfg, r)
        for phase, lk, ok_, rl in (
            ("train", "loss", "outputs", "losses"),
            ("infer", "infer_loss", "infer_outputs", "infer_losses"),
        ):
            want_loss = None if mbs is None else torch.stack([ref[rl][m] for m in mbs])
            _expect_same(f"rank {r} {phase} loss", res[lk], want_loss, errors)
            with_outputs = phase == "infer" or cfg.train_outputs
            want_out = None if mbs is None or not with_outputs else _gather([ref["infer_outputs"][m] for m in mbs])
            _expect_same(f"rank {r} {phase} outputs", res[ok_], want_out, errors)


def _check_grads(cfg: RunConfig, schedule: Any, ranks: Sequence[dict], ref: dict, errors: list[str]) -> None:
    """Per-copy grads bit-exact; DualPipe's mirror copies summed within COS_TOL of the shared-model reference."""
    grads: dict[int, dict[str, torch.Tensor | None]] = {}
    for r, res in enumerate(ranks):
        for s, g in res["grads"].items():
            if schedule.stage_to_rank[s] != r:
                errors.append(f"rank {r} returned grads for stage {s}, which lives on rank {schedule.stage_to_rank[s]}")
            grads[s] = g
    if sorted(grads) != list(range(schedule.num_stages)):
        errors.append(f"grads returned for stages {sorted(grads)}, want 0..{schedule.num_stages - 1}")
        return
    mirrored = "shared_grads" in ref
    synced = mirrored and cfg.api == "native"  # Pipeline's sync_mirror_grads=True default; compat leaves copies alone
    copies: dict[int, list[int]] = {}
    for s in range(schedule.num_stages):
        copies.setdefault(schedule.model_stage[s], []).append(s)
    for ms, stages in copies.items():
        if not synced:
            for s in stages:
                for name, want in ref["grads"][s].items():
                    _expect_same(f"grad of stage {s} {name}", grads[s].get(name), want, errors)
        if not mirrored:
            continue
        for name, want in ref["shared_grads"][ms].items():
            got = [grads[s].get(name) for s in stages]
            if any(g is None for g in got) or want is None:
                if not all(g is None for g in got) or want is not None:
                    errors.append(f"model stage {ms} {name}: None-ness differs: copies {got}, shared reference {want}")
                continue
            total = got[0] if synced else got[0] + got[1]
            if synced and not torch.equal(got[0], got[1]):
                errors.append(f"model stage {ms} {name}: the two synced copies differ (stages {stages})")
            d = cos_diff(total, want)
            if not d < COS_TOL:
                errors.append(
                    f"model stage {ms} {name}: summed copies vs shared reference: cos diff {d:.3e} >= {COS_TOL}"
                )


# --------------------------------------------------------------------------------------------
# A port of the reference's example program (examples/example_dualpipe.py), compat import
# --------------------------------------------------------------------------------------------
def example_port(rank: int, world_size: int, which: str, num_chunks: int) -> dict[str, Any]:
    """Rank function: the reference example's flow through compat; returns what it checked.

    The full model (``ExampleStage`` with ``overlapped_forward_backward`` and
    WeightGradStore linears) runs in one process micro-batch by micro-batch;
    each rank then loads its two stages' weights into fresh modules, takes one
    training and one inference step, and compares as the example does (losses
    ``torch.equal``; grads, after summing DualPipe's mirror copies with an
    all_gather, within ``cos_diff < 1e-13``), plus bit-exact per-copy grads.
    """
    from dualpipe_kernels.compat import DualPipe, DualPipeV, set_p2p_tensor_dtype, set_p2p_tensor_shapes

    torch.manual_seed(233)
    micro_batch, r = 3, world_size
    n_model = r if which == "dualpipe" else 2 * r
    set_p2p_tensor_shapes([(micro_batch, DIM)])
    set_p2p_tensor_dtype(torch.float32)
    full = nn.Sequential(*[ExampleStage() for _ in range(n_model)])
    full_x = torch.randn(num_chunks * micro_batch, DIM)
    full_l = torch.randn(num_chunks * micro_batch, DIM)

    # reference step: micro-batch by micro-batch in one process
    losses, ys = [], []
    for mx, ml in zip(full_x.chunk(num_chunks), full_l.chunk(num_chunks), strict=True):
        y = full(mx)
        loss = example_criterion(y, ml)
        loss.backward()
        losses.append(loss.detach())
        ys.append(y.detach())
    loss_ref, out_ref = torch.stack(losses), torch.cat(ys)

    other = r - 1 - rank if which == "dualpipe" else 2 * r - 1 - rank
    local_full = nn.Sequential(full[rank], full[other])
    local = nn.Sequential(ExampleStage(), ExampleStage())
    local[0].load_state_dict(local_full[0].state_dict())
    local[1].load_state_dict(local_full[1].state_dict())
    model = (DualPipe if which == "dualpipe" else DualPipeV)(local)

    if which == "dualpipe":
        x = full_x.chunk(2)[0] if rank == 0 else full_x.chunk(2)[1] if rank == r - 1 else None
        lab = full_l.chunk(2)[1] if rank == 0 else full_l.chunk(2)[0] if rank == r - 1 else None
        want = loss_ref.chunk(2)[1] if rank == 0 else loss_ref.chunk(2)[0] if rank == r - 1 else None
        want_out = out_ref.chunk(2)[1] if rank == 0 else out_ref.chunk(2)[0] if rank == r - 1 else None
    else:
        x, lab = (full_x, full_l) if rank == 0 else (None, None)
        want, want_out = (loss_ref, out_ref) if rank == 0 else (None, None)

    checks: dict[str, Any] = {}
    try:
        loss, outputs = model.step(x, num_chunks=num_chunks, criterion=example_criterion, labels=(lab,))
        checks["loss_equal"] = (loss is None and want is None) or (loss is not None and torch.equal(loss, want))
        checks["outputs_none"] = outputs is None
        checks["per_copy_grads_equal"] = (
            all(torch.equal(p.grad, q.grad) for p, q in zip(local.parameters(), local_full.parameters(), strict=True))
            if which == "dualpipev"
            else None
        )
        if which == "dualpipe":  # the example sums the mirror copies itself
            for p0, p1 in zip(local[0].parameters(), local[1].parameters(), strict=True):
                # (the example uses all_gather_into_tensor on NCCL; gloo takes a list)
                p0all = [torch.empty_like(p0) for _ in range(r)]
                p1all = [torch.empty_like(p1) for _ in range(r)]
                dist.all_gather(p0all, p0.grad.detach().contiguous())
                dist.all_gather(p1all, p1.grad.detach().contiguous())
                p0.grad += p1all[r - 1 - rank]
                p1.grad += p0all[r - 1 - rank]
        checks["grad_cos_diff"] = max(
            cos_diff(p.grad, q.grad) for p, q in zip(local.parameters(), local_full.parameters(), strict=True)
        )
        model.zero_grad()
        with torch.no_grad():
            loss, outputs = model.step(
                x, num_chunks=num_chunks, criterion=example_criterion, labels=(lab,), return_outputs=True
            )
        checks["infer_loss_equal"] = (loss is None and want is None) or (loss is not None and torch.equal(loss, want))
        checks["infer_outputs_equal"] = (outputs is None and want_out is None) or (
            outputs is not None and torch.equal(outputs, want_out)
        )
        checks["fb_calls"] = local[0].fb_calls + local[1].fb_calls
    finally:
        model.close()
    return checks


# --------------------------------------------------------------------------------------------
# compat on CUDA (tests marked gpu)
# --------------------------------------------------------------------------------------------
def cuda_compat(rank: int, world_size: int, which: str, num_chunks: int) -> dict[str, bool]:
    """Rank function: compat DualPipe/DualPipeV with CUDA modules, ranks sharing GPU 0 (transport "auto").

    Same checks as the CPU configurations, against a single-process run on the same GPU.
    """
    from dualpipe_kernels import compat

    torch.use_deterministic_algorithms(True)
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    cfg = RunConfig(which, world_size, num_chunks, api="compat", model="example")
    schedule = build_schedule_for(cfg)
    stages = {s: m.to(dev) for s, m in make_all_stages(cfg, schedule).items()}
    ref_stages = {s: m.to(dev) for s, m in make_all_stages(cfg, schedule).items()}
    mbs = [(tuple(t.to(dev) for t in x), tuple(t.to(dev) for t in y)) for x, y in microbatches_of(cfg)]
    ref_losses, _ = reference_step(ref_stages, schedule, mbs, example_criterion)
    s0, s1 = rank, 2 * world_size - 1 - rank
    model = (compat.DualPipeV if which == "dualpipev" else compat.DualPipe)((stages[s0], stages[s1]))
    if which == "dualpipev":
        x, label = make_tensors(cfg.model, cfg.rows, cfg.seed + 1)
        feeds, mine = rank == 0, list(range(num_chunks))
    else:
        (x0, l0), (x1, l1) = compat_dualpipe_batches(cfg)
        x, label = (x0, l0) if rank == 0 else (x1, l1)
        feeds = rank in (0, world_size - 1)
        mine = list(range(num_chunks // 2, num_chunks)) if rank == 0 else list(range(num_chunks // 2))
    x = tuple(t.to(dev) for t in x) if feeds else (None,)
    label = tuple(t.to(dev) for t in label) if feeds else (None,)
    try:
        loss, _ = model.step(*x, num_chunks=num_chunks, criterion=example_criterion, labels=label)
    finally:
        model.close()
    out = {"loss_on_cuda": loss is None or loss.device.type == "cuda"}
    out["loss_equal"] = (loss is None) if not feeds else torch.equal(loss, torch.stack([ref_losses[m] for m in mine]))
    out["grads_equal"] = all(
        torch.equal(p.grad, q.grad)
        for s in (s0, s1)
        for p, q in zip(stages[s].parameters(), ref_stages[s].parameters(), strict=True)
    )
    return out
