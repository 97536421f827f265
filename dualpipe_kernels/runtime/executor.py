"""The pipeline: runs this rank's lowered action list for one training or inference step.

The work is split into rooms, each with its own state:

* :mod:`.loop`: the action loop and its window of posted receives;
* :mod:`.compute`: stage compute (F, B, I/W split, F&B pair and the overlap hook);
* :mod:`.boundary`: boundary communication (post, complete, reap);
* :mod:`.mirror`: DualPipe's mirror-gradient sync at the end of a step;
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
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from dualpipe_kernels.runtime.boundary import Boundary, BoundaryState, Wire
from dualpipe_kernels.runtime.compute import ComputeState, StageCompute
from dualpipe_kernels.runtime.construction import (
    check_mapping,
    check_modules,
    module_device,
    presplit,
)
from dualpipe_kernels.runtime.loop import ActionLoop, StepRun
from dualpipe_kernels.runtime.microbatch import split_microbatches
from dualpipe_kernels.runtime.mirror import MirrorSync
from dualpipe_kernels.runtime.p2p import LayoutMemory, TagSpace
from dualpipe_kernels.runtime.timeline import TimelineEntry, TimelineRecorder
from dualpipe_kernels.runtime.zero_bubble import WeightGradStore
from dualpipe_kernels.schedules.deps import Program
from dualpipe_kernels.schedules.ir import Schedule
from dualpipe_kernels.transport import Transport, make_transport

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
    """

    losses: dict[int, torch.Tensor]
    outputs: dict[int, tuple[torch.Tensor, ...]] | None
    timeline: list[TimelineEntry]
    step_time_s: float
    loss: torch.Tensor | None = None


def _lowered_program(schedule: Schedule) -> Program:
    """The dependency program of ``schedule`` in its lowered form (lowering it when it is compute-only)."""
    if schedule.lowered:
        return Program(schedule)
    from dualpipe_kernels.schedules.lowering import lower_program

    return lower_program(Program(schedule))


class Pipeline(nn.Module):
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
    many compute actions ahead receives are posted.  ``zero_bubble``:
    ``"split"`` (I/W autograd-graph split, default) or ``"store"`` (the
    reference's behaviour: I runs the full backward with the WeightGradStore
    enabled, W only pops the store).  ``device``: where received tensors go
    (default: the device of the modules' parameters).  ``scale_grads``: seed
    each micro-batch loss's backward with ``1/N`` (N = the schedule's
    micro-batches), so a mean criterion gives the full batch's mean-loss
    gradients, as torch.distributed.pipelining does by default; ``False``
    accumulates the plain sum over micro-batches (the DualPipe reference's and
    ``compat``'s semantics).  Only this step's contribution is scaled:
    gradients already in ``.grad`` (accumulation over steps) are left alone.

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
        recv_lookahead: int = 2,
        zero_bubble: str = "split",
        device: torch.device | str | None = None,
        scale_grads: bool = True,
    ) -> None:
        """Check the arguments, lower the schedule and set up the transport (collective: every rank builds it)."""
        super().__init__()
        if not isinstance(schedule, Schedule):
            raise ValueError(f"schedule must be a dualpipe_kernels Schedule, got {type(schedule).__name__}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if recv_lookahead < 1:
            raise ValueError(f"recv_lookahead must be >= 1, got {recv_lookahead}")
        if zero_bubble not in ("split", "store"):
            raise ValueError(f"zero_bubble must be 'split' or 'store', got {zero_bubble!r}")
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
        self.program = _lowered_program(schedule)
        self.schedule = schedule = self.program.schedule
        self.stages = schedule.stages_of_rank(self.rank)
        self.stage_modules = check_modules(modules, self.stages, self.rank, schedule.name)
        self.stage_module_dict = nn.ModuleDict({str(s): m for s, m in self.stage_modules.items()})
        self.batch_dim = batch_dim
        self.timeout_s = float(timeout_s)
        self.sync_mirror_grads = sync_mirror_grads
        self.record_timeline = record_timeline
        self.recv_lookahead = recv_lookahead
        self.zero_bubble = zero_bubble
        self.scale_grads = scale_grads
        self.device = torch.device(device) if device is not None else module_device(self.stage_modules)
        if self.device.type == "cuda" and self.device.index is None:
            # Receive buffers may be allocated on a transport thread, whose current device differs.
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.tags = TagSpace(schedule.num_stages, schedule.num_microbatches)
        # Message layouts of the previous step, so receives are posted before the metadata arrives (p2p.py).
        self._layouts = LayoutMemory()
        self.weight_grad_store = WeightGradStore()
        self._transport = make_transport(transport, self.group, self.device, self.timeout_s)
        self._owns_transport = not isinstance(transport, Transport)
        self._broken: str | None = None
        self._compute = StageCompute(
            self.rank, self.program.topo, self.stage_modules, self.weight_grad_store, zero_bubble
        )
        self.overlap_hook = self._compute.overlap_hook
        wire = Wire(
            self.rank, self._transport, self.to_group_rank, self.tags, self._layouts, self.device, self.timeout_s
        )
        self._boundary = Boundary(wire, self.program)
        self._mirrors = MirrorSync(wire, schedule, self.stage_modules)
        self.mirror_of = self._mirrors.mirror_of
        self._loop = ActionLoop(schedule.actions[self.rank], recv_lookahead)
        if _log.isEnabledFor(logging.DEBUG):
            _log.debug("%s", self._describe())

    def _describe(self) -> str:
        """One line: what this pipeline runs and what it chose (transport per peer, policies)."""
        t = self._base_transport()
        local = getattr(t, "local_peers", None)  # native: same-host peers; the others go through torch
        single_of = getattr(t, "single_copy_peers", None)
        single = set(single_of()) if callable(single_of) else set()
        kinds = []
        for p in sorted({a.peer for a in self._loop.actions if a.is_comm and a.peer is not None}):
            g = self.to_group_rank[p]
            kind = self.transport_name if local is None or g in local else "torch (other host)"
            kinds.append(f"{p}: {kind}{' single-copy' if g in single else ''}")
        return (
            f"pipeline rank {self.rank} (group rank {self.group_rank}) of {self.schedule.name!r}: stages "
            f"{list(self.stages)}, {len(self._loop.actions)} actions; transport per peer {{{', '.join(kinds)}}}; "
            f"device {self.device}, zero_bubble={self.zero_bubble}, scale_grads={self.scale_grads}, "
            f"recv_lookahead={self.recv_lookahead}, sync_mirror_grads={self.sync_mirror_grads}, "
            f"overlap hook={'on' if self.overlap_hook else 'off'}"
        )

    def _base_transport(self) -> Transport:
        inner = getattr(self._transport, "inner", None)  # a wrapper (the benchmarks' payload switch) names its inner
        return inner if isinstance(inner, Transport) else self._transport

    @property
    def transport_name(self) -> str:
        """The transport actually in use (``"native"``, ``"torch"``, ``"cuda_ipc"``...), never ``"auto"``."""
        return str(self._base_transport().name)

    # ---- construction helpers -------------------------------------------
    @classmethod
    def from_sequential(
        cls,
        schedule: Schedule,
        model: nn.Sequential,
        partition: Sequence[int] | None = None,
        **kw: Any,
    ) -> Pipeline:
        """A pipeline running this rank's share of the full ``model`` (every rank builds the same model).

        ``partition[m]``: number of layers of model stage ``m`` (default: as even
        as possible, earlier stages one layer more).  ``kw``: ``Pipeline``'s
        keywords.  The stage modules are :func:`build_stage_modules`'s
        (``StageLayers`` sharing the model's layers; a second copy of a model
        stage held by the same rank is a deep copy), so parameter names map back
        to ``model``'s (``runtime.checkpoint``).  Example::

            model = nn.Sequential(*layers)  # same seed on every rank
            pipe = Pipeline.from_sequential(build_schedule("dualpipev", 2, 8), model)
        """
        from dualpipe_kernels.runtime.stages import build_stage_modules

        mods = build_stage_modules(
            schedule, model, partition=partition, group=kw.get("group"), rank_mapping=kw.get("rank_mapping")
        )
        return cls(schedule, mods, **kw)

    def write_trace(self, path: str | os.PathLike[str], result: StepResult) -> str | None:
        """Write the measured step ``result`` of every rank as one chrome-trace JSON (open in ui.perfetto.dev).

        Collective over the pipeline group (every rank calls it with its own
        result of the same step); group rank 0 writes ``path`` and returns it,
        the others return None.  Needs ``Pipeline(record_timeline=True)``.
        Each rank's times are relative to its own step start.
        """
        from dualpipe_kernels.schedules.trace import write_chrome_trace

        if not self.record_timeline:
            raise ValueError("write_trace needs a step recorded with Pipeline(record_timeline=True)")
        timelines: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(timelines, list(result.timeline), group=self.group)
        if self.group_rank != 0:
            return None
        merged = [e for t in timelines for e in t]
        write_chrome_trace(path, merged, schedule=self.schedule.name, step_time_s=result.step_time_s)
        return os.fspath(path)

    def model_state_dict(self, full_name: Callable[[int, str], str] | None = None) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers under the full model's names (``runtime.checkpoint``)."""
        from dualpipe_kernels.runtime.checkpoint import stage_state_dict

        return stage_state_dict(self.schedule, self.stage_modules, full_name)

    def close(self) -> None:
        """Release the transport if this pipeline created it (a given Transport stays the caller's). Idempotent."""
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
        run = StepRun(self._loop, self._compute, self._boundary, cst, BoundaryState(cst.forward_only), rec)
        self.weight_grad_store.clear()
        try:
            with self.weight_grad_store.bind():
                self._loop.run(run)
                if not cst.forward_only and self.sync_mirror_grads and self._mirrors:
                    # Not a schedule action, so not in the timeline (entries must parse as actions).
                    self._mirrors.run()
        except BaseException as exc:
            self._broken = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
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
            loss=loss,
        )

    def _mean_loss(self, losses: Mapping[int, torch.Tensor], reduce: bool) -> torch.Tensor | None:
        """Mean of ``losses`` (this rank's, or every rank's with ``reduce``) as a 0-d float32 tensor."""
        # Summed in float64, this rank's and the reduced mean alike (adding the zeros of ranks
        # without losses is exact), so the two agree bit for bit on a rank holding every loss.
        total = torch.stack([v.detach().reshape(()).double() for v in losses.values()]).sum() if losses else None
        if not reduce:
            return None if total is None else (total / len(losses)).float()
        acc = torch.zeros(2, dtype=torch.float64, device=self.device)
        if total is not None:
            acc[0], acc[1] = total, len(losses)
        dist.all_reduce(acc, group=self.group)
        if acc[1].item() == 0:  # no rank had a loss (no criterion, or inference without one)
            return None
        return (acc[0] / acc[1]).float()

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
        first = [m for m in range(n) if sched.path(m)[0] in self.stages]
        last = [m for m in range(n) if sched.path(m)[-1] in self.stages]
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
