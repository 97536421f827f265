"""The step of a :class:`~dualpipe_kernels.runtime.executor.Pipeline`: the step's arguments checked and split
into this rank's compute state, the action loop run with its per-step states, the reductions after it.

A mixin of ``Pipeline`` (construction and introspection live in :mod:`.executor`, traces, checkpoints and
accumulation in :mod:`.conveniences`): it reads the subsystems the constructor built (``_loop``,
``_compute``, ``_boundary``, ``_reductions``, ``_loss``, ``activation_memory``, ``weight_grad_store``) and
owns no state beyond ``_broken``.  After the loop it runs the list of gradient reductions
(runtime/reductions.py) and the loss (runtime/loss.py).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dualpipe_kernels.runtime.boundary.exchange import Boundary, BoundaryState
from dualpipe_kernels.runtime.compute import ComputeState, StageCompute
from dualpipe_kernels.runtime.construction import presplit
from dualpipe_kernels.runtime.conveniences import PipelineConveniences
from dualpipe_kernels.runtime.graphs import StageGraphs
from dualpipe_kernels.runtime.loop import ActionLoop, StepRun
from dualpipe_kernels.runtime.loss import LossReduction
from dualpipe_kernels.runtime.memory import ActivationMemory
from dualpipe_kernels.runtime.microbatch import SplitCache, batch_size_of
from dualpipe_kernels.runtime.model_options import ModelOptions
from dualpipe_kernels.runtime.peer_watch import PeerWatch
from dualpipe_kernels.runtime.result import StepResult
from dualpipe_kernels.runtime.timeline import TimelineRecorder
from dualpipe_kernels.runtime.zero_bubble import WeightGradStore
from dualpipe_kernels.transport import TransportError

__all__ = ["PipelineStep", "on_group"]


# ---- pipelines sharing a process group (named in a timeout's error) ----------------------------------------
_PIPELINES: dict[int, weakref.WeakSet[PipelineStep]] = {}


def on_group(pipe: PipelineStep) -> None:
    _PIPELINES.setdefault(id(pipe.group), weakref.WeakSet()).add(pipe)


def _others_on_group(pipe: PipelineStep) -> list[PipelineStep]:
    live = _PIPELINES.get(id(pipe.group), weakref.WeakSet())
    return sorted((p for p in live if p is not pipe and p.group is pipe.group), key=lambda p: p.channel)


def _describe(pipe: PipelineStep) -> str:
    return f"pipeline #{pipe.channel} (schedule {pipe.schedule.name!r}, pipeline rank {pipe.rank})"


class PipelineStep(PipelineConveniences):
    """:meth:`step` of :class:`Pipeline` and its compute-state set-up (see the module docstring)."""

    channel: int
    rank: int
    batch_dim: int
    scale_grads: bool
    model_options: ModelOptions
    activation_memory: ActivationMemory
    weight_grad_store: WeightGradStore
    _broken: str | None
    _compute: StageCompute
    _graphs: StageGraphs
    _loop: ActionLoop
    _boundary: Boundary
    _loss: LossReduction
    _watch: PeerWatch | None
    _first_mbs: list[int]
    _last_mbs: list[int]
    _splits: SplitCache  # the checks of the last batch shape, per argument kind

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
        # DP, the mirror sum, the tie groups: posted as their stages' gradient work ends, waited for after the loop
        red = self._reductions.begin(t0) if not cst.forward_only else None
        if red is not None:
            run.done_hooks = red.hooks()
        cst.mem = self.activation_memory.begin_step(training=not cst.forward_only)
        self.weight_grad_store.clear()
        try:
            with self.weight_grad_store.bind():
                self._loop.run(run)
                if red is not None:
                    red.finish()  # not schedule actions, so not in the timeline (entries must parse as actions)
            self.activation_memory.end_step(cst.mem)
        except BaseException as exc:
            self._broken = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if self._watch is not None:
                self._watch.publish(exc)  # the peers' waits end now, naming this rank and its error
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
        self._graphs.end_step(training=not cst.forward_only)  # the first training step's end captures
        if reduce_loss:  # a collective: every rank enters it now, in the step
            try:
                reduced = self._loss.mean(cst.losses, True, cst.loss_rows)
            except BaseException as exc:
                if self._watch is not None:
                    self._watch.publish(exc)
                raise
            loss_of: Callable[[], torch.Tensor | None] | None = lambda: reduced  # noqa: E731
        elif cst.losses:  # this rank's mean, local: worked out when the result's loss is read
            losses, rows = cst.losses, cst.loss_rows
            loss_of = lambda: self._loss.mean(losses, False, rows)  # noqa: E731
        else:
            loss_of = None
        elapsed = time.perf_counter() - t0
        return StepResult(
            losses=cst.losses,
            outputs=cst.outputs if return_outputs else None,
            timeline=rec.entries,
            step_time_s=elapsed,
            dp_reductions=red.spans if red is not None else [],
            loss_of=loss_of,
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
        uneven = self.model_options.allow_uneven
        bd = self.batch_dim
        # Inputs and labels of the same micro-batches (not DualPipe's two directions, whose callers may pass
        # each end only its own half): their rows must match.
        same_mbs = not first or not last or set(first) == set(last)
        if pre_in is None and pre_lab is None and same_mbs:
            rows_in, rows_lab = batch_size_of(inputs, bd), batch_size_of(labels, bd)
            if rows_in is not None and rows_lab is not None and rows_in != rows_lab:
                raise ValueError(
                    f"labels have {rows_lab} rows along batch_dim {bd} but the inputs have {rows_in}; "
                    "they must match (broadcasting would give a wrong loss)"
                )
        elif pre_in is not None and pre_lab is not None and same_mbs:
            for m, (mi, ml) in enumerate(zip(pre_in, pre_lab, strict=True)):
                ri, rl = batch_size_of(mi, bd), batch_size_of(ml, bd)
                if ri is not None and rl is not None and ri != rl:
                    raise ValueError(f"micro-batch {m}: labels have {rl} rows along batch_dim {bd}, inputs {ri}")
        if pre_in is not None:
            split_in = pre_in if first else []
        else:
            split_in = self._splits.split("inputs", inputs, n, bd, uneven) if first else []
        want_labels = bool(last) and criterion is not None
        if pre_lab is not None:
            split_lab = pre_lab if want_labels else []
        else:
            split_lab = self._splits.split("labels", labels, n, bd, uneven) if want_labels else []
        scale = 1.0 / n if self.scale_grads else 1.0
        loss_scales: dict[int, float] = {}
        loss_rows: dict[int, int] = {}
        if uneven and last and criterion is not None:
            # Each micro-batch's loss weighted by its rows: the gradient of one process's mean loss.
            loss_rows, total = self._rows_of_loss_microbatches(inputs, labels, pre_in, pre_lab, last)
            if self.scale_grads:
                loss_scales = {m: r / total for m, r in loss_rows.items()}
        return ComputeState(
            forward_only=forward_only,
            return_outputs=return_outputs,
            criterion=criterion,
            loss_scale=scale,
            loss_scales=loss_scales,
            loss_rows=loss_rows,
            mb_inputs={m: split_in[m] for m in first},
            mb_labels={m: split_lab[m] for m in last} if split_lab else {},
        )

    def _rows_of_loss_microbatches(
        self,
        inputs: tuple[Any, ...],
        labels: tuple[Any, ...],
        pre_in: list[tuple[Any, ...]] | None,
        pre_lab: list[tuple[Any, ...]] | None,
        last: list[int],
    ) -> tuple[dict[int, int], int]:
        """Rows of each micro-batch whose loss this rank computes (from its labels, else its inputs) and
        the rows of the whole batch."""
        n, bd = self.schedule.num_microbatches, self.batch_dim
        pre = pre_lab if pre_lab is not None else pre_in
        if pre is not None:
            rows = [batch_size_of(mb, bd) for mb in pre]
        else:
            size = batch_size_of(labels, bd) or batch_size_of(inputs, bd)
            rows = [size // n + (1 if m < size % n else 0) for m in range(n)] if size else [None] * n
        known = [r for r in rows if r is not None]
        if len(known) != len(rows):
            raise ValueError(
                f"pipeline rank {self.rank}: allow_uneven weights each loss by its micro-batch's rows; "
                "pass the labels (or inputs) on this loss-stage rank"
            )
        return {m: known[m] for m in last}, sum(known)
