"""The pipeline: runs this rank's lowered action list for one training or inference step.

The work is split into rooms, each with its own state:

* :mod:`.loop`: the action loop and its window of posted receives;
* :mod:`.compute`: stage compute (F, B, I/W split, F&B pair and the overlap hook);
* :mod:`.boundary`: boundary communication (post, complete, reap);
* :mod:`.mirror`: DualPipe's mirror-gradient sync at the end of a step;
* :mod:`.data_parallel`: the per-stage data-parallel gradient reduction (PP x DP);
* :mod:`.construction`: checking the arguments and cutting an ``nn.Sequential`` into stages.

:class:`Pipeline` wires them together once at construction; a step builds the
per-step states, runs the loop and drops them.  What each comm action moves,
and to which rank, is read from the schedule's dependency program
(``schedules.deps.Program``), the same one the validator and simulator read.

Errors name this pipeline rank, the peer pipeline rank, the action and the
micro-batch.  After an error the pipeline refuses further steps (pending
transfers may be left in the process group).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from dualpipe_kernels.runtime.boundary.codec import BoundaryFormat
from dualpipe_kernels.runtime.boundary.codec import boundary_format as parse_boundary_format
from dualpipe_kernels.runtime.boundary.exchange import Boundary, BoundaryState, Wire, pair_order_digest
from dualpipe_kernels.runtime.boundary.header import TagSpace
from dualpipe_kernels.runtime.boundary.inline import INLINE_MAX_BYTES, inline_limit
from dualpipe_kernels.runtime.boundary.layout_memory import LayoutMemory
from dualpipe_kernels.runtime.checks import check_stage_devices, check_timeout
from dualpipe_kernels.runtime.compute import ComputeState, StageCompute
from dualpipe_kernels.runtime.construction import (
    check_mapping,
    check_modules,
    module_device,
    presplit,
)
from dualpipe_kernels.runtime.conveniences import PipelineConveniences
from dualpipe_kernels.runtime.data_parallel import DP_OPS, DataParallelReducer, ReductionSpan, mirror_dp_groups
from dualpipe_kernels.runtime.fingerprint import Fingerprint, agree, fingerprint, resolved_transport
from dualpipe_kernels.runtime.loop import ActionLoop, StepRun
from dualpipe_kernels.runtime.memory import ActivationMemory
from dualpipe_kernels.runtime.memory_plan import MemoryPolicy, parse_memory_policy
from dualpipe_kernels.runtime.microbatch import split_microbatches
from dualpipe_kernels.runtime.mirror import MirrorSync, mirrors
from dualpipe_kernels.runtime.timeline import TimelineEntry, TimelineRecorder
from dualpipe_kernels.runtime.zero_bubble import WeightGradStore
from dualpipe_kernels.schedules.deps import Program
from dualpipe_kernels.schedules.ir import Schedule
from dualpipe_kernels.transport import Transport, TransportError, make_transport

__all__ = ["Pipeline", "StepResult"]

_log = logging.getLogger(__name__)  # under "dualpipe_kernels": what each pipeline chose, at debug level


@dataclass
class StepResult:
    """What one step returns on this rank.

    ``losses``: micro-batch -> detached scalar loss, for the micro-batches whose
    loss stage this rank holds.  ``loss``: the mean of those losses as a 0-d
    float32 tensor (summed in float64), None when this rank has none; with
    ``step(..., reduce_loss=True)`` the mean over all the step's micro-batches,
    the same value on every rank of the pipeline group.  ``outputs``: micro-batch -> detached outputs of
    the loss stage when ``return_outputs`` (else None).  ``timeline``:
    ``(pipeline rank, action, start_s, end_s)`` relative to the step start when
    ``record_timeline``.  ``step_time_s``: wall time of the step on this rank.
    ``dp_reductions``: ``(stage, start_s, end_s)`` of each data-parallel
    reduction (posted after the stage's last gradient action, waited for at the
    end), relative to the step start; empty without a ``dp_group``.
    """

    losses: dict[int, torch.Tensor]
    outputs: dict[int, tuple[torch.Tensor, ...]] | None
    timeline: list[TimelineEntry]
    step_time_s: float
    dp_reductions: list[ReductionSpan] = field(default_factory=list)
    loss: torch.Tensor | None = None


# ---- pipelines sharing a process group (named in a timeout's error) ----------------------------------------
_PIPELINES: dict[int, weakref.WeakSet[Pipeline]] = {}


def _on_group(pipe: Pipeline) -> None:
    _PIPELINES.setdefault(id(pipe.group), weakref.WeakSet()).add(pipe)


def _others_on_group(pipe: Pipeline) -> list[Pipeline]:
    live = _PIPELINES.get(id(pipe.group), weakref.WeakSet())
    return sorted((p for p in live if p is not pipe and p.group is pipe.group), key=lambda p: p.channel)


def _describe(pipe: Pipeline) -> str:
    return f"pipeline #{pipe.channel} (schedule {pipe.schedule.name!r}, pipeline rank {pipe.rank})"


# -------------------------------------------------------------------------------------------------------------


def _lowered_program(schedule: Schedule) -> Program:
    """The validated dependency program of ``schedule`` in its lowered form (lowering it when compute-only).

    Validation is the full validator (O(actions)): a schedule that would compute wrong gradients or
    deadlock raises ScheduleError on every rank, each on its own, before anything runs.
    """
    from dualpipe_kernels.schedules.lowering import lower_program
    from dualpipe_kernels.schedules.validate import validate

    program = validate(schedule)
    return program if schedule.lowered else lower_program(program)


class Pipeline(PipelineConveniences, nn.Module):
    """Runs ``schedule`` on this process's pipeline rank with its stage modules.

    ``schedule``: compute-only (lowered here with ``lower_comms``) or lowered.
    ``modules``: ``{stage: module}`` for ``schedule.stages_of_rank(rank)`` (or a
    sequence in that order).  ``group``: the process group (default group when
    None); ``rank_mapping[group_rank]`` is the pipeline rank of a group member
    (identity when None).  ``transport``: ``"auto"`` (default: the native
    engine for same-host peers when it is built, else torch), ``"torch"``,
    ``"native"`` or a Transport instance (a given instance is not closed by :meth:`close`).
    ``timeout_s``: every wait.  ``sync_mirror_grads``: DualPipe only, sum the
    gradients of the two copies of a model stage at the end of the step.
    ``record_timeline``: fill ``StepResult.timeline``.  ``recv_lookahead``: how
    many compute actions ahead receives are posted (default: the transport's
    ``recv_lookahead``, 9 over gloo, else 2); ``early_small_receives``: post
    every receive whose message repeats the last step's small inline layout
    when a step starts (default: the transport's choice, on over gloo).  ``zero_bubble``:
    ``"split"`` (I/W autograd-graph split, default) or ``"store"`` (the
    reference's behaviour: I runs the full backward with the WeightGradStore
    enabled, W only pops the store).  ``device``: where received tensors go
    (default: the device of the modules' parameters).  ``boundary_format``: how
    stage-boundary messages travel, ``"none"`` (default: one transfer per tensor),
    ``"packed"`` (one lossless message), ``"bf16"`` or ``"fp8"``; one name for both
    directions, or ``(activations, gradients)`` / ``"fp8,bf16"`` / a BoundaryFormat
    (runtime/boundary/codec.py; every rank must pass the same).

    PP x DP: ``dp_group`` is this rank's data-parallel group (the ranks
    holding the same pipeline rank of the other replicas; ``group`` is then
    this replica's pipeline group), or build from a 2-D mesh with
    :meth:`from_mesh`.  Each stage's gradients are all-reduced over
    ``dp_group`` as soon as its last gradient action of the step is done and
    the step returns once all are complete (runtime/data_parallel.py).
    ``dp_op`` follows ``scale_grads`` by default, so the gradients are those of
    one process running the whole global batch with the same loss reduction:
    ``"mean"`` (with ``scale_grads=True``: the global batch's mean-loss
    gradients) or ``"sum"`` (with ``scale_grads=False``: per-micro-batch losses
    summed over every replica).  DualPipe's mirror copies: one
    all_reduce over every copy of every replica replaces the DP sum and the
    mirror exchange (copies on one rank: mirror sum after the DP sum).

    ``scale_grads``: seed
    each micro-batch loss's backward with ``1/N`` (N = the schedule's
    micro-batches), so a mean criterion gives the full batch's mean-loss
    gradients, as torch.distributed.pipelining does by default; ``False``
    accumulates the plain sum over micro-batches (the DualPipe reference's and
    ``compat``'s semantics).  Only this step's contribution is scaled:
    gradients already in ``.grad`` (accumulation over steps) are left alone.

    ``memory_policy``: what
    happens to each stage's saved activations, one for all stages or
    ``{stage: policy}``: ``"keep"`` (default), ``"recompute"``,
    ``"compress"`` / ``"compress:fp8"`` (lossy), ``"offload"``, or a
    :class:`MemoryPolicy` (see ``runtime/memory_plan.py``).  ``memory_policy``
    (the attribute) is then ``{stage: policy name}``; ``activation_memory.peaks``
    the peak device-resident saved bytes of every training step.

    The module is an ``nn.Module`` holding the stage modules (``parameters()``,
    ``zero_grad()`` work on it); ``stage_modules`` maps stage -> module.
    """

    def __init__(
        self,
        schedule: Schedule,
        modules: Mapping[int, nn.Module] | Sequence[nn.Module],
        group: dist.ProcessGroup | None = None,
        rank_mapping: Sequence[int] | None = None,
        transport: str | Transport = "auto",
        batch_dim: int = 0,
        timeout_s: float = 120.0,
        sync_mirror_grads: bool = True,
        record_timeline: bool = False,
        recv_lookahead: int | None = None,
        zero_bubble: str = "split",
        device: torch.device | str | None = None,
        dp_group: dist.ProcessGroup | None = None,
        dp_op: str | None = None,
        boundary_format: str | tuple[str, str] | BoundaryFormat | None = "none",
        scale_grads: bool = True,
        memory_policy: str | MemoryPolicy | Mapping[int, str | MemoryPolicy] = "keep",
        early_small_receives: bool | None = None,
    ) -> None:
        """Check the arguments, lower the schedule and set up the transport (collective: every rank builds it)."""
        super().__init__()
        fmt = parse_boundary_format(boundary_format)
        if not isinstance(schedule, Schedule):
            raise ValueError(f"schedule must be a dualpipe_kernels Schedule, got {type(schedule).__name__}")
        timeout_s = check_timeout(timeout_s)
        if recv_lookahead is not None and recv_lookahead < 1:
            raise ValueError(f"recv_lookahead must be >= 1, got {recv_lookahead}")
        dp_op = dp_op if dp_op is not None else ("mean" if scale_grads else "sum")
        if dp_op not in DP_OPS:
            raise ValueError(f"dp_op must be one of {', '.join(DP_OPS)}, got {dp_op!r}")
        if zero_bubble not in ("split", "store"):
            raise ValueError(f"zero_bubble must be 'split' or 'store', got {zero_bubble!r}")
        self.program = _lowered_program(schedule)  # validates: a broken schedule fails here, on every rank
        if not dist.is_initialized():
            raise ValueError("Pipeline needs an initialised torch.distributed process group")
        self.group = group if group is not None else dist.group.WORLD
        self.group_rank = dist.get_rank(self.group)
        size = dist.get_world_size(self.group)
        if size != schedule.num_ranks:
            raise ValueError(
                f"schedule {schedule.name!r} has {schedule.num_ranks} ranks but the process group has {size}"
            )
        self.rank_mapping = check_mapping(rank_mapping, size)
        self.to_group_rank = [0] * size
        for g, p in enumerate(self.rank_mapping):
            self.to_group_rank[p] = g
        self.rank = self.rank_mapping[self.group_rank]
        self.schedule = schedule = self.program.schedule
        self.stages = schedule.stages_of_rank(self.rank)
        # micro-batches whose first / loss stage is on this rank (fixed by the schedule; read every step)
        self._first_mbs = [m for m in range(schedule.num_microbatches) if schedule.path(m)[0] in self.stages]
        self._last_mbs = [m for m in range(schedule.num_microbatches) if schedule.path(m)[-1] in self.stages]
        self.stage_modules = check_modules(modules, self.stages, self.rank, schedule.name)
        check_stage_devices(self.stage_modules)
        self.stage_module_dict = nn.ModuleDict({str(s): m for s, m in self.stage_modules.items()})
        self.batch_dim = batch_dim
        self.timeout_s = float(timeout_s)
        self.sync_mirror_grads = sync_mirror_grads
        self.record_timeline = record_timeline
        self.zero_bubble = zero_bubble
        #: how boundary messages travel (part of what every rank must agree on)
        self.boundary_format = fmt
        self.scale_grads = scale_grads
        self.device = torch.device(device) if device is not None else module_device(self.stage_modules)
        if self.device.type == "cuda" and self.device.index is None:
            # Receive buffers may be allocated on a transport thread, whose current device differs.
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.weight_grad_store = WeightGradStore()
        mine = fingerprint(
            schedule,
            self.rank,
            self.rank_mapping,
            resolved_transport(transport, self.device),
            extra={
                "sync_mirror_grads": str(bool(sync_mirror_grads and mirrors(schedule))),
                "boundary_format": str(fmt),
                # one policy for every stage must be the same everywhere; per-stage mappings may list only a rank's own
                "memory_policy": memory_policy if isinstance(memory_policy, str) else "per-stage",
                # the order both ends of each pair post its messages in, on an in-order (NCCL) channel
                "pair order": pair_order_digest(self.program),
            },
        )
        # RanksDisagree on every rank: ranks, field.  The exchange's number is the pipeline's on its group, the
        # same on every rank: its block of tags and its in-order channel (two pipelines' messages never match).
        self.channel = agree(mine, self.group, self.timeout_s, self.rank_mapping)
        self.tags = TagSpace(schedule.num_stages, schedule.num_microbatches, channel=self.channel)
        # Message layouts of the previous step, so receives are posted before the metadata arrives (transfer.py).
        self._layouts = LayoutMemory(inline_max_bytes=INLINE_MAX_BYTES, channel=self.channel)
        _on_group(self)
        self._transport = make_transport(transport, self.group, self.device, self.timeout_s)
        self._owns_transport = not isinstance(transport, Transport)
        # A larger inline limit where the transport takes whole larger messages.  Both ends of a message must
        # use the same one (it decides how the message travels): a transport that reports different values on
        # different ranks fails here, on every rank, naming them (RanksDisagree), not at its first large message.
        self._layouts.inline_max_bytes = inline_limit(self._transport)
        field = ("inline message limit (Transport.message_inline_bytes)", str(self._layouts.inline_max_bytes))
        agree(Fingerprint(self.rank, (field,)), self.group, self.timeout_s, self.rank_mapping)
        self.recv_lookahead = recv_lookahead if recv_lookahead is not None else self._transport.recv_lookahead
        self.early_small_receives = (
            bool(early_small_receives) if early_small_receives is not None else self._transport.early_small_receives
        )
        self._broken: str | None = None
        policies = parse_memory_policy(memory_policy, self.stages)
        self.memory_policy = {s: p.name for s, p in policies.items()}
        self.activation_memory = ActivationMemory(
            self.rank, policies, schedule.actions[self.rank], self.stage_modules, self.device
        )
        self._compute = StageCompute(
            self.rank,
            self.program.topo,
            self.stage_modules,
            self.weight_grad_store,
            zero_bubble,
            self.activation_memory,
        )
        self.overlap_hook = self._compute.overlap_hook
        wire = Wire(
            self.rank, self._transport, self.to_group_rank, self.tags, self._layouts, self.device, self.timeout_s, fmt
        )
        self._boundary = Boundary(wire, self.program)
        self._mirrors = MirrorSync(wire, schedule, self.stage_modules)
        self.mirror_of = self._mirrors.mirror_of
        self._loop = ActionLoop(schedule.actions[self.rank], self.recv_lookahead, self.early_small_receives)
        self.dp_group = dp_group
        self._dp: DataParallelReducer | None = None
        if dp_group is not None:
            folded = (
                mirror_dp_groups(schedule, self.rank, self.group, self.to_group_rank, dp_group)
                if sync_mirror_grads and self._mirrors
                else None
            )
            self._dp = DataParallelReducer(
                dp_group, self.rank, self._loop.actions, self.stage_modules, dp_op, self.timeout_s, folded
            )
        if _log.isEnabledFor(logging.DEBUG):
            _log.debug("%s", self._describe())

    def close(self) -> None:
        """Release the transport if this pipeline created it (a given Transport stays the caller's). Idempotent."""
        self._layouts.clear()  # pooled receive buffers
        if self._owns_transport:
            self._transport.close()

    # ---- the step ---------------------------------------------------------
    def step(
        self,
        *inputs: Any,
        labels: Sequence[Any] = (),
        criterion: Callable[..., torch.Tensor] | None = None,
        return_outputs: bool = False,
        microbatches: Sequence[Sequence[Any]] | None = None,
        microbatch_labels: Sequence[Sequence[Any]] | None = None,
        reduce_loss: bool = False,
    ) -> StepResult:
        """Run one step: forward+backward (or forward only under ``torch.no_grad()``).

        ``inputs`` / ``labels``: the full batch, split into the schedule's
        micro-batches along ``batch_dim``; needed only on ranks holding a first
        / loss stage.  ``criterion(*outputs, *labels) -> scalar`` on loss stages.
        Gradients accumulate into the stage modules' ``.grad`` (divided by the
        number of micro-batches unless ``scale_grads=False``).

        ``microbatches`` / ``microbatch_labels``: instead of ``inputs`` /
        ``labels``, the micro-batches already split: one tuple of inputs
        (labels) per micro-batch, ``schedule.num_microbatches`` of them (no
        padding or splitting is done; shapes may differ between micro-batches).

        ``reduce_loss``: give every rank the step's mean loss in
        ``StepResult.loss`` (one 2-element all-reduce over the pipeline group:
        every rank must pass the same value).
        """
        if self._broken is not None:
            raise RuntimeError(f"pipeline rank {self.rank}: a previous step failed ({self._broken}); rebuild it")
        cst = self._compute_state(inputs, tuple(labels), criterion, return_outputs, microbatches, microbatch_labels)
        rec = TimelineRecorder(self.rank, self.record_timeline)
        t0 = rec.t0
        red = self._dp.begin(t0) if self._dp is not None and not cst.forward_only else None
        run = StepRun(self._loop, self._compute, self._boundary, cst, BoundaryState(cst.forward_only), rec)
        if red is not None:
            run.done_hooks = red.hooks()
        cst.mem = self.activation_memory.begin_step(training=not cst.forward_only)
        self.weight_grad_store.clear()
        try:
            with self.weight_grad_store.bind():
                self._loop.run(run)
                if red is not None:
                    red.finish()  # before an unfolded mirror sum: each copy first sums over its replicas
                folded = self._dp is not None and self._dp.folds_mirrors  # also under no_sync()
                if not cst.forward_only and self.sync_mirror_grads and self._mirrors and not folded:
                    # Not a schedule action, so not in the timeline (entries must parse as actions).
                    self._mirrors.run()
            self.activation_memory.end_step(cst.mem)
        except BaseException as exc:
            self._broken = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            others = _others_on_group(self)
            if isinstance(exc, TransportError) and others:  # a timeout, or a peer that gave up on one
                raise type(exc)(
                    f"{exc}. {_describe(self)} shares its process group with {', '.join(map(_describe, others))} "
                    "in this process: a rank running another pipeline's step waits for messages this step "
                    "sends (every rank must step the pipelines of one group in the same order)"
                ) from exc
            raise
        finally:
            self.weight_grad_store.clear()
        loss = self._mean_loss(cst.losses, reduce_loss)
        elapsed = time.perf_counter() - t0
        return StepResult(
            losses=cst.losses,
            outputs=cst.outputs if return_outputs else None,
            timeline=rec.entries,
            step_time_s=elapsed,
            dp_reductions=red.spans if red is not None else [],
            loss=loss,
        )

    def _compute_state(
        self,
        inputs: tuple[Any, ...],
        labels: tuple[Any, ...],
        criterion: Callable[..., torch.Tensor] | None,
        return_outputs: bool,
        microbatches: Sequence[Sequence[Any]] | None,
        microbatch_labels: Sequence[Sequence[Any]] | None,
    ) -> ComputeState:
        """Check the step's arguments and split them into this rank's micro-batch inputs and labels."""
        sched = self.schedule
        n = sched.num_microbatches
        forward_only = not torch.is_grad_enabled()
        first, last = self._first_mbs, self._last_mbs
        pre_in = presplit(microbatches, n, "microbatches", inputs)
        pre_lab = presplit(microbatch_labels, n, "microbatch_labels", labels)
        if first and not inputs and pre_in is None:
            raise ValueError(
                f"pipeline rank {self.rank} holds first stage(s) {sorted({sched.path(m)[0] for m in first})}: "
                "step() needs the inputs"
            )
        if last and criterion is None and not forward_only:
            raise ValueError(
                f"pipeline rank {self.rank} holds loss stage(s) {sorted({sched.path(m)[-1] for m in last})}: "
                "training needs a criterion"
            )
        if pre_in is not None:
            split_in = pre_in if first else []
        else:
            split_in = split_microbatches(inputs, n, self.batch_dim) if first else []
        want_labels = bool(last) and criterion is not None
        if pre_lab is not None:
            split_lab = pre_lab if want_labels else []
        else:
            split_lab = split_microbatches(labels, n, self.batch_dim) if want_labels else []
        return ComputeState(
            forward_only=forward_only,
            return_outputs=return_outputs,
            criterion=criterion,
            loss_scale=1.0 / n if self.scale_grads else 1.0,
            mb_inputs={m: split_in[m] for m in first},
            mb_labels={m: split_lab[m] for m in last} if split_lab else {},
        )
