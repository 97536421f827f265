"""Data-parallel gradient reduction of a pipeline rank: one async all_reduce per stage, started early.

In a PP x DP layout every pipeline rank has ``dp`` replicas (same stages, other
data).  Each stage's gradients are summed over the data-parallel group as soon
as that stage's last gradient work of the step is done: the action after which
it starts is read from this rank's lowered action list (the last B, I, W or
F&B backward half of the stage), not re-derived from the schedule's shape, so
the reduction overlaps the rest of the schedule.  The step waits for every
reduction before it returns.

Semantics: ``op="sum"`` (default) sums over replicas, exactly as the pipeline
already sums over micro-batches, so the gradients equal those of one process
running the full batch (all replicas' micro-batches) with the same criterion,
its per-micro-batch losses summed.  ``op="mean"`` divides by the DP size
(a full-batch reference whose loss is the mean of the replicas' losses).

DualPipe's mirror copies (mirror.py) are folded in: when every duplicated
stage of this rank has its mirror on another pipeline rank (DualPipe), the
reduction group of such a stage holds both copies of all replicas (``2 x dp``
ranks, built once with :func:`mirror_dp_groups`), so one all_reduce, started as
early as the DP one, replaces the DP sum and the end-of-step mirror exchange;
all copies end bit-identical.  Otherwise (copies on one rank, or
``sync_mirror_grads=False``) the mirror sum runs after the DP reduction: each
copy first gets the sum over its replicas, then the two copies are added.

Buffers: one flat buffer per (stage, dtype) holds the stage's gradients during
the reduction; it is the reducer's until :meth:`StepReduction.finish` copies it
back into ``param.grad``.  Replicas must hold the same stage modules (the same
parameters with gradients), as they do when built from one model.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from dualpipe_kernels.runtime.mirror import mirrors
from dualpipe_kernels.runtime.options import DP_OPS
from dualpipe_kernels.schedules.ir import T_B, T_I, T_W, Action, Schedule

__all__ = ["DP_OPS", "DataParallelReducer", "StepReduction", "last_grad_actions", "mirror_dp_groups", "ReductionSpan"]

_GRAD_KINDS = (T_B, T_I, T_W)

#: ``(stage, start_s, end_s)``: one stage's DP reduction, from posting to completion, relative to the step start
ReductionSpan = tuple[int, float, float]


def last_grad_actions(actions: Sequence[Action], stages: Sequence[int]) -> dict[int, int]:
    """stage -> index in ``actions`` of its last gradient action (B, I, W or a pair's backward half).

    Stages of ``stages`` with no gradient action in the list are left out.
    """
    last: dict[int, int] = {}
    wanted = set(stages)
    for i, a in enumerate(actions):
        for c in a.computes():
            if c.type in _GRAD_KINDS and c.stage in wanted:
                last[c.stage] = i
    return last


def mirror_dp_groups(
    schedule: Schedule,
    rank: int,
    pp_group: dist.ProcessGroup,
    to_group_rank: Sequence[int],
    dp_group: dist.ProcessGroup,
) -> dict[int, dist.ProcessGroup] | None:
    """stage -> a group of every copy of its model stage in every replica, for this rank's duplicated stages.

    None when some duplicated stage of this rank has its mirror on this rank too
    (then the mirror sum is local and runs after the DP reduction).  Collective
    over the pipeline and DP groups; each mirror group is created by its members
    only, in model-stage order, so every member creates the same groups in the
    same order.
    """
    mirror_of = mirrors(schedule)
    mine = [s for s in schedule.stages_of_rank(rank) if s in mirror_of]
    if any(schedule.stage_to_rank[mirror_of[s]] == rank for s in mine):
        return None
    pp_globals = dist.get_process_group_ranks(pp_group)
    global_of = [pp_globals[to_group_rank[p]] for p in range(schedule.num_ranks)]
    table: list[Any] = [None] * dist.get_world_size(dp_group)
    dist.all_gather_object(table, global_of, group=dp_group)  # table[replica][pipeline rank] -> global rank
    backend = dist.get_backend(dp_group)
    out: dict[int, dist.ProcessGroup] = {}
    pairs = sorted({tuple(sorted((s, t))) for s, t in mirror_of.items()}, key=lambda st: schedule.model_stage[st[0]])
    for s, t in pairs:
        holders = (schedule.stage_to_rank[s], schedule.stage_to_rank[t])
        if rank not in holders:
            continue
        members = sorted({row[r] for row in table for r in holders})
        group = dist.new_group(members, backend=backend, use_local_synchronization=True)
        if not isinstance(group, dist.ProcessGroup):  # new_group's answer to a non-member
            raise RuntimeError(f"rank {rank}: not a member of its own mirror group {members}")
        out[s if holders[0] == rank else t] = group
    return out


@dataclass
class _Bucket:
    """The in-flight reduction of one stage: flat buffers (one per dtype) and their works."""

    stage: int
    params: list[nn.Parameter]
    flats: list[torch.Tensor]
    works: list[Any]
    start_s: float


@dataclass
class StepReduction:
    """One step's reductions on this rank: started by :meth:`start`, completed by :meth:`finish`."""

    reducer: DataParallelReducer
    t0: float
    buckets: list[_Bucket] = field(default_factory=list)
    spans: list[ReductionSpan] = field(default_factory=list)

    def hooks(self) -> dict[int, Any]:
        """Action index -> what to call once that action is done (the loop's ``done_hooks``)."""
        by_index: dict[int, list[int]] = {}
        for s, i in self.reducer.trigger.items():
            by_index.setdefault(i, []).append(s)
        return {i: functools.partial(self.start_all, tuple(sorted(ss))) for i, ss in by_index.items()}

    def start_all(self, stages: Sequence[int]) -> None:
        for s in stages:
            self.start(s)

    def start(self, stage: int) -> None:
        """Post the async all_reduce of ``stage``'s gradients on the DP group."""
        r = self.reducer
        params = [p for p in r.params_of[stage] if p.grad is not None]
        flats: list[torch.Tensor] = []
        works: list[Any] = []
        group = r.groups.get(stage, r.group)
        for dtype in sorted({p.dtype for p in params}, key=str):
            flat = torch.cat([g.reshape(-1) for p in params if p.dtype == dtype and (g := p.grad) is not None])
            flats.append(flat)
            works.append(dist.all_reduce(flat, group=group, async_op=True))
        self.buckets.append(_Bucket(stage, params, flats, works, time.perf_counter()))

    def finish(self) -> None:
        """Wait for every posted reduction and write the results into ``param.grad`` (scaled for ``mean``)."""
        r = self.reducer
        for b in self.buckets:
            for w in b.works:
                try:
                    w.wait(timeout=timedelta(seconds=r.timeout_s))
                except Exception as exc:  # noqa: BLE001 - gloo and NCCL raise several types
                    raise RuntimeError(
                        f"pipeline rank {r.rank} (DP rank {r.dp_rank} of {r.dp_size}): data-parallel gradient "
                        f"reduction of stage {b.stage} failed or timed out after {r.timeout_s:.3g} s: {exc}"
                    ) from exc
            end = time.perf_counter()
            self.spans.append((b.stage, b.start_s - self.t0, end - self.t0))
            by_dtype = dict(zip(sorted({p.dtype for p in b.params}, key=str), b.flats, strict=True))
            offsets = dict.fromkeys(by_dtype, 0)
            with torch.no_grad():
                for p in b.params:
                    flat, o = by_dtype[p.dtype], offsets[p.dtype]
                    g = flat[o : o + p.numel()].view_as(p)
                    offsets[p.dtype] = o + p.numel()
                    assert p.grad is not None
                    if r.op == "mean":
                        p.grad.copy_(g / r.dp_size)
                    else:
                        p.grad.copy_(g)
        self.buckets.clear()


class DataParallelReducer:
    """The DP reduction of this pipeline rank's stages over ``group`` (the data-parallel group).

    ``actions``: this rank's lowered action list (where each stage's reduction
    starts); ``modules``: ``{stage: module}`` of this rank; ``op``: "sum" or
    "mean" (see the module docstring); ``timeout_s``: the wait for each reduction.
    ``mirror_groups``: from :func:`mirror_dp_groups` when the mirror sum is
    folded in (:attr:`folds_mirrors`), else None.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        rank: int,
        actions: Sequence[Action],
        modules: Mapping[int, nn.Module],
        op: str = "sum",
        timeout_s: float = 120.0,
        mirror_groups: Mapping[int, dist.ProcessGroup] | None = None,
    ) -> None:
        if op not in DP_OPS:
            raise ValueError(f"dp_op must be one of {', '.join(DP_OPS)}, got {op!r}")
        self.group = group
        self.rank = rank
        self.dp_rank = dist.get_rank(group)
        self.dp_size = dist.get_world_size(group)
        self.modules = modules
        self.op = op
        self.timeout_s = timeout_s
        #: stage -> its reduction group where it is not the DP group (folded mirror copies)
        self.groups: dict[int, dist.ProcessGroup] = dict(mirror_groups or {})
        self.folds_mirrors = mirror_groups is not None
        self.paused = False
        #: stage -> index of the action after which its reduction starts
        self.trigger = last_grad_actions(actions, list(modules))
        # A parameter object shared by two of this rank's stages (a weight tied within the rank) is reduced
        # once, with the stage whose gradient work ends last (reducing it twice would double it).
        owner: dict[int, int] = {}
        for s in sorted(self.trigger, key=lambda st: self.trigger[st]):
            for p in modules[s].parameters():
                owner[id(p)] = s
        #: stage -> the parameters its reduction covers
        self.params_of = {s: [p for p in m.parameters() if owner.get(id(p), s) == s] for s, m in modules.items()}
        missing = sorted(set(modules) - set(self.trigger))
        if missing:
            raise ValueError(
                f"pipeline rank {rank}: stage(s) {missing} have no backward action in this rank's action list; "
                "a data-parallel reduction needs one"
            )

    def begin(self, t0: float) -> StepReduction | None:
        """The reductions of a new training step whose timeline starts at ``t0`` (None inside :meth:`pause`)."""
        return None if self.paused else StepReduction(self, t0)

    @contextmanager
    def pause(self) -> Iterator[None]:
        """Steps inside skip the reduction (and a folded mirror sum): gradients accumulate locally."""
        before, self.paused = self.paused, True
        try:
            yield
        finally:
            self.paused = before
