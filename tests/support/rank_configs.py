"""Rank functions of the shared configuration runs: every ``RunConfig`` of a world size, one spawn.

One spawned group per world size runs many configurations in a row
(:func:`run_configs`) and returns every rank's losses, gradients and outputs;
rank 0 also returns the single-process reference computed on the same
micro-batches.  The parent compares them (``runtime_checks.check_config``), so
a failure names the configuration.  Also the reference's example program
(:func:`example_port`) and compat on CUDA (:func:`cuda_compat`).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from toy_models import (
    DIM,
    ExampleStage,
    MicroBatch,
    RunConfig,
    Tensors,
    build_schedule_for,
    compat_dualpipe_batches,
    cos_diff,
    criterion_of,
    example_criterion,
    make_all_stages,
    make_tensors,
    microbatches_of,
)


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
    pipe = Pipeline(
        schedule,
        local,
        group=group,
        rank_mapping=cfg.mapping,
        transport=cfg.transport,
        timeout_s=timeout_s,
        scale_grads=False,  # reference_step sums the micro-batch losses' gradients
        allow_uneven=True,  # some configurations split unevenly (15 rows over 6); with the plain sum seeds stay 1
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
    """Rank function: compat DualPipe/DualPipeV with CUDA modules (gloo between ranks sharing GPU 0).

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
