"""The pipeline executor: runs this rank's lowered action list for one training or inference step.

Ownership and lifetimes (per step, all in :class:`_StepState`, dropped at the end):

* stage inputs ``(stage, mb)``: micro-batch slices of the caller's tensors on a
  first stage, otherwise tensors received into buffers the executor allocated
  (leaves with ``requires_grad`` when the sender's tensor required grad).  Kept
  until the backward of that (stage, mb) has read their ``.grad``.
* stage outputs: the executor keeps only the autograd *edges* of outputs (enough
  for backward); the tensors themselves are held by the send in flight and
  released when it completes, so an activation's memory goes as soon as its
  send is done (unless autograd saved it).  With an ``overlapped_forward_backward``
  hook the outputs must be handed to the hook, so they are kept and their
  storage is swapped for an empty one after the send (the reference's way).
* receives are posted ``recv_lookahead`` compute actions ahead of need (metadata
  first, data the moment the metadata is in), sends are posted when the
  schedule says and waited lazily (polled between actions, all waited at the
  end of the step).  Every wait has ``timeout_s``.

Errors name this pipeline rank, the peer pipeline rank, the action and the
micro-batch.  After an error the pipeline refuses further steps (pending
transfers may be left in the process group).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from dualpipe_kernels.runtime.checks import call_criterion, check_schedule, check_stage_devices, check_timeout
from dualpipe_kernels.runtime.fingerprint import agree, fingerprint, resolved_transport
from dualpipe_kernels.runtime.microbatch import split_microbatches
from dualpipe_kernels.runtime.p2p import BoundaryRecv, BoundarySend, LayoutMemory, TagSpace
from dualpipe_kernels.runtime.timeline import TimelineEntry, TimelineRecorder
from dualpipe_kernels.runtime.zero_bubble import DeferredWeightGrad, WeightGradStore, backward_full, backward_input
from dualpipe_kernels.schedules.ir import Action, ActionType, Schedule
from dualpipe_kernels.transport import Transport, make_transport

__all__ = ["Pipeline", "StepResult"]

_F, _B, _I, _W, _PAIR = ActionType.F, ActionType.B, ActionType.I, ActionType.W, ActionType.OVERLAP_F_B
_SEND_F, _RECV_F, _SEND_B, _RECV_B = ActionType.SEND_F, ActionType.RECV_F, ActionType.SEND_B, ActionType.RECV_B
_DIR_F, _DIR_B, _DIR_MIRROR = 0, 1, 2

Key = tuple[int, int]  # (stage, micro-batch)


@dataclass
class StepResult:
    """What one step returns on this rank.

    ``losses``: micro-batch -> detached scalar loss, for the micro-batches whose
    loss stage this rank holds.  ``outputs``: micro-batch -> detached outputs of
    the loss stage when ``return_outputs`` (else None).  ``timeline``:
    ``(pipeline rank, action, start_s, end_s)`` relative to the step start when
    ``record_timeline``.  ``step_time_s``: wall time of the step on this rank.
    """

    losses: dict[int, torch.Tensor]
    outputs: dict[int, tuple[torch.Tensor, ...]] | None
    timeline: list[TimelineEntry]
    step_time_s: float


@dataclass
class _StepState:
    forward_only: bool
    return_outputs: bool
    criterion: Callable[..., torch.Tensor] | None
    mb_inputs: dict[int, tuple[Any, ...]]
    mb_labels: dict[int, tuple[Any, ...]]
    inputs: dict[Key, list[Any]] = field(default_factory=dict)
    roots: dict[Key, list[tuple[GradientEdge, int]]] = field(default_factory=dict)
    loss_tensors: dict[Key, torch.Tensor] = field(default_factory=dict)
    hook_outputs: dict[Key, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    to_send_f: dict[Key, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    to_send_b: dict[Key, list[torch.Tensor | None]] = field(default_factory=dict)
    out_grads: dict[Key, list[torch.Tensor | None]] = field(default_factory=dict)
    deferred: dict[Key, DeferredWeightGrad] = field(default_factory=dict)
    recvs: dict[tuple[ActionType, int, int], BoundaryRecv] = field(default_factory=dict)
    # RECV actions reached in the action list but not yet waited for: (type, stage, mb) -> the action.
    # They are waited for by the compute that needs their data (see ``_run``).
    deferred_recvs: dict[tuple[ActionType, int, int], Action] = field(default_factory=dict)
    sent_early: set[int] = field(default_factory=set)  # indices of SEND_F actions already posted
    rec: TimelineRecorder | None = None
    sends: list[tuple[BoundarySend, tuple[torch.Tensor, ...]]] = field(default_factory=list)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)


def _as_tuple(out: Any, stage: int) -> tuple[Any, ...]:
    if isinstance(out, torch.Tensor):
        return (out,)
    if isinstance(out, (tuple, list)):
        return tuple(out)
    raise ValueError(f"stage {stage} returned {type(out).__name__}; a stage must return a tensor or a tuple of tensors")


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
    (default: the device of the modules' parameters).

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
    ) -> None:
        super().__init__()
        if not isinstance(schedule, Schedule):
            raise ValueError(f"schedule must be a dualpipe_kernels Schedule, got {type(schedule).__name__}")
        timeout_s = check_timeout(timeout_s)
        check_schedule(schedule)  # ScheduleError on every rank, before anything runs
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
        self.rank_mapping = _check_mapping(rank_mapping, size)
        self.to_group_rank = [0] * size
        for g, p in enumerate(self.rank_mapping):
            self.to_group_rank[p] = g
        self.rank = self.rank_mapping[self.group_rank]
        if not schedule.lowered:
            from dualpipe_kernels.schedules.lowering import lower_comms

            schedule = lower_comms(schedule)
        self.schedule = schedule
        self.stages = schedule.stages_of_rank(self.rank)
        self.stage_modules = _check_modules(modules, self.stages, self.rank, schedule.name)
        check_stage_devices(self.stage_modules)
        self.stage_module_dict = nn.ModuleDict({str(s): m for s, m in self.stage_modules.items()})
        self.batch_dim = batch_dim
        self.timeout_s = float(timeout_s)
        self.sync_mirror_grads = sync_mirror_grads
        self.record_timeline = record_timeline
        self.recv_lookahead = recv_lookahead
        self.zero_bubble = zero_bubble
        self.device = torch.device(device) if device is not None else _module_device(self.stage_modules)
        if self.device.type == "cuda" and self.device.index is None:
            # Receive buffers may be allocated on a transport thread, whose current device differs.
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.tags = TagSpace(schedule.num_stages, schedule.num_microbatches)
        # Message layouts of the previous step, so receives are posted before the metadata arrives (p2p.py).
        self._layouts = LayoutMemory()
        self.weight_grad_store = WeightGradStore()
        self.mirror_of = _mirrors(schedule)
        self._actions = list(schedule.actions[self.rank])
        self._window_end = _window_ends(self._actions, recv_lookahead)
        self._labels = [str(a) for a in self._actions]  # timeline labels, built once
        # (stage, mb) -> index of its SEND_F: a pair posts its forward half's send before its backward half.
        self._send_f_index = {(a.stage, a.microbatch): i for i, a in enumerate(self._actions) if a.type is _SEND_F}
        mine = fingerprint(
            schedule,
            self.rank,
            self.rank_mapping,
            resolved_transport(transport, self.device),
            extra={"sync_mirror_grads": str(bool(sync_mirror_grads and self.mirror_of))},
        )
        agree(mine, self.group, self.timeout_s, self.rank_mapping)  # RanksDisagree on every rank: ranks, field
        self._transport = make_transport(transport, self.group, self.device, self.timeout_s)
        self._owns_transport = not isinstance(transport, Transport)
        self._broken: str | None = None
        types = {type(m) for m in self.stage_modules.values()}
        self.overlap_hook = len(types) == 1 and hasattr(next(iter(types)), "overlapped_forward_backward")

    # ---- construction helpers -------------------------------------------
    @classmethod
    def from_sequential(
        cls,
        schedule: Schedule,
        model: nn.Sequential,
        partition: Sequence[int] | None = None,
        **kw: Any,
    ) -> Pipeline:
        """Build this rank's stage modules from a full ``nn.Sequential``.

        ``partition[m]``: number of layers of model stage ``m`` (default: as even
        as possible, earlier stages one layer more).  Stage modules share the
        model's layers, except a second copy of a model stage held by the same
        rank, which is a deep copy (so both copies start identical).
        """
        import copy

        num_model = max(schedule.model_stage) + 1
        layers = list(model)
        if partition is None:
            if len(layers) < num_model:
                raise ValueError(f"model has {len(layers)} layers, fewer than the {num_model} model stages")
            base, extra = divmod(len(layers), num_model)
            partition = [base + (1 if m < extra else 0) for m in range(num_model)]
        partition = list(partition)
        if len(partition) != num_model or any(n < 1 for n in partition) or sum(partition) != len(layers):
            raise ValueError(
                f"partition {partition} must give >= 1 layer to each of {num_model} model stages and sum to "
                f"{len(layers)} layers"
            )
        starts = [sum(partition[:m]) for m in range(num_model)]
        group = kw.get("group")
        g = group if group is not None else dist.group.WORLD
        mapping = _check_mapping(kw.get("rank_mapping"), dist.get_world_size(g))
        rank = mapping[dist.get_rank(g)]
        modules: dict[int, nn.Module] = {}
        seen: set[int] = set()
        for s in schedule.stages_of_rank(rank):
            m = schedule.model_stage[s]
            piece = nn.Sequential(*layers[starts[m] : starts[m] + partition[m]])
            modules[s] = copy.deepcopy(piece) if m in seen else piece
            seen.add(m)
        return cls(schedule, modules, **kw)

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
    ) -> StepResult:
        """Run one step: forward+backward (or forward only under ``torch.no_grad()``).

        ``inputs`` / ``labels``: the full batch, split into the schedule's
        micro-batches along ``batch_dim``; needed only on ranks holding a first
        / loss stage.  ``criterion(*outputs, *labels) -> scalar`` on loss stages.
        Gradients accumulate into the stage modules' ``.grad``.

        ``microbatches`` / ``microbatch_labels``: instead of ``inputs`` /
        ``labels``, the micro-batches already split: one tuple of inputs
        (labels) per micro-batch, ``schedule.num_microbatches`` of them (no
        padding or splitting is done; shapes may differ between micro-batches).
        """
        if self._broken is not None:
            raise RuntimeError(f"pipeline rank {self.rank}: a previous step failed ({self._broken}); rebuild it")
        sched = self.schedule
        n = sched.num_microbatches
        forward_only = not torch.is_grad_enabled()
        first = [m for m in range(n) if sched.path(m)[0] in self.stages]
        last = [m for m in range(n) if sched.path(m)[-1] in self.stages]
        pre_in = _presplit(microbatches, n, "microbatches", inputs)
        pre_lab = _presplit(microbatch_labels, n, "microbatch_labels", tuple(labels))
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
            split_lab = split_microbatches(tuple(labels), n, self.batch_dim) if want_labels else []
        state = _StepState(
            forward_only=forward_only,
            return_outputs=return_outputs,
            criterion=criterion,
            mb_inputs={m: split_in[m] for m in first},
            mb_labels={m: split_lab[m] for m in last} if split_lab else {},
        )
        rec = TimelineRecorder(self.rank, self.record_timeline)
        t0 = rec.t0
        self.weight_grad_store.clear()
        try:
            with self.weight_grad_store.bind():
                self._run(state, rec)
                self._finish_sends(state)
                if not forward_only and self.sync_mirror_grads and self.mirror_of:
                    # Not a schedule action, so not in the timeline (entries must parse as actions).
                    self._sync_mirrors()
        except BaseException as exc:
            self._broken = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            raise
        finally:
            self.weight_grad_store.clear()
        elapsed = time.perf_counter() - t0
        return StepResult(
            losses=state.losses,
            outputs=state.outputs if return_outputs else None,
            timeline=rec.entries,
            step_time_s=elapsed,
        )

    # ---- action loop ------------------------------------------------------
    def _run(self, st: _StepState, rec: TimelineRecorder) -> None:
        st.rec = rec
        acts = self._actions
        next_post = 0
        for i, a in enumerate(acts):
            # Post the receives of the next `recv_lookahead` compute actions after
            # this one (double buffering with the default 2: while compute i runs,
            # the data of computes i+1 and i+2 is already on its way).
            end = self._window_end[i]
            while next_post < end:
                b = acts[next_post]
                if b.type in (_RECV_F, _RECV_B):
                    self._post_recv(st, b)
                next_post += 1
            for r in st.recvs.values():
                r.progress()
            self._reap_sends(st, block=False)
            if st.forward_only and a.type in (_B, _I, _W, _SEND_B, _RECV_B):
                continue
            if a.type is _RECV_F or a.type is _RECV_B:
                # Waited for by the compute that reads the data, not here: an F&B
                # pair runs its forward half while its backward half's gradient
                # is still in flight.  The timeline entry spans the actual wait.
                self._post_recv(st, a)
                st.deferred_recvs[(a.type, a.stage, a.microbatch)] = a
                continue
            if a.type is _SEND_F and i in st.sent_early:
                continue  # posted (and recorded) by its F&B pair
            if rec.enabled:
                with rec.span(self._labels[i]):
                    self._execute(st, a)
            else:
                self._execute(st, a)

    def _execute(self, st: _StepState, a: Action) -> None:
        t = a.type
        if t is _F:
            self._forward(st, a.stage, a.microbatch)
        elif t is _B:
            self._backward(st, a.stage, a.microbatch, split=False)
        elif t is _I:
            self._backward(st, a.stage, a.microbatch, split=True)
        elif t is _W:
            self._weight(st, a.stage, a.microbatch)
        elif t is _PAIR:
            self._pair(st, a)
        elif t is _SEND_F:
            self._send(st, a, _DIR_F)
        elif t is _SEND_B:
            self._send(st, a, _DIR_B)
        elif t in (_RECV_F, _RECV_B):
            self._complete_recv(st, a)
        else:  # pragma: no cover - the IR has no other types
            raise ValueError(f"pipeline rank {self.rank}: cannot execute {a}")

    # ---- compute ----------------------------------------------------------
    def _await(self, st: _StepState, t: ActionType, s: int, mb: int) -> None:
        """Wait for the deferred receive ``(t, s, mb)`` if the action list has reached it."""
        a = st.deferred_recvs.pop((t, s, mb), None)
        if a is None:
            return
        rec = st.rec
        if rec is not None and rec.enabled:
            start = time.perf_counter()
            self._complete_recv(st, a)
            rec.add(str(a), start, time.perf_counter())
        else:
            self._complete_recv(st, a)

    def _stage_inputs(self, st: _StepState, s: int, mb: int) -> list[Any]:
        key = (s, mb)
        if st.deferred_recvs:
            self._await(st, _RECV_F, s, mb)
        if key in st.inputs:
            return st.inputs[key]
        if self.schedule.is_first_stage(s, mb) and mb in st.mb_inputs:
            ins = list(st.mb_inputs.pop(mb))
            st.inputs[key] = ins
            return ins
        raise RuntimeError(f"pipeline rank {self.rank}: {s}F{mb} has no inputs (schedule order broken?)")

    def _forward(self, st: _StepState, s: int, mb: int, module_out: Any = None, loss: Any = None) -> None:
        """F of stage ``s`` for ``mb`` (``module_out``/``loss``: already computed by an overlap hook)."""
        sched = self.schedule
        key = (s, mb)
        ins = self._stage_inputs(st, s, mb)
        is_loss = sched.is_loss_stage(s, mb)
        if module_out is None:
            module_out = self.stage_modules[s](*ins)
        outs = _as_tuple(module_out, s)
        if st.forward_only:
            del st.inputs[key]
        if is_loss:
            if st.criterion is not None:
                if loss is None:
                    where = f"pipeline rank {self.rank}, stage {s}, micro-batch {mb}"
                    loss = call_criterion(st.criterion, outs, st.mb_labels.get(mb, ()), where)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise ValueError(f"criterion must return a scalar tensor (stage {s}, micro-batch {mb})")
                st.losses[mb] = loss.detach()
                if not st.forward_only:
                    st.loss_tensors[key] = loss
                    st.roots[key] = [(get_gradient_edge(loss), -1)] if loss.requires_grad else []
            if st.return_outputs:
                st.outputs[mb] = tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in outs)
            return
        for i, o in enumerate(outs):
            if not isinstance(o, torch.Tensor):
                raise ValueError(f"stage {s} output {i} is a {type(o).__name__}; only tensors can cross a boundary")
        if not st.forward_only:
            st.roots[key] = [(get_gradient_edge(o), i) for i, o in enumerate(outs) if o.requires_grad]
        if self.overlap_hook and not st.forward_only:
            st.hook_outputs[key] = outs  # the hook's outputs1 for this stage's backward
        nxt = sched.next_stage(s, mb)
        assert nxt is not None
        if sched.stage_to_rank[nxt] == self.rank:
            # Same-rank handoff: cut the graph so each stage backward stays separate.
            st.inputs[(nxt, mb)] = [o.detach().requires_grad_(o.requires_grad) for o in outs]
            return
        for i, o in enumerate(outs):
            if o.requires_grad and o._base is not None:
                raise ValueError(
                    f"stage {s} output {i} (micro-batch {mb}) is a view of another tensor (e.g. of its input); "
                    "a stage must return fresh tensors (use .clone() or .contiguous())"
                )
        st.to_send_f[key] = outs

    def _grad_roots(self, st: _StepState, s: int, mb: int) -> list[tuple[GradientEdge, torch.Tensor | None]]:
        key = (s, mb)
        if st.deferred_recvs:
            self._await(st, _RECV_B, s, mb)
        roots = st.roots.pop(key, [])
        if self.schedule.is_loss_stage(s, mb):
            st.loss_tensors.pop(key, None)
            return [(e, None) for e, _ in roots]
        grads = st.out_grads.pop(key, None)
        if grads is None:
            raise RuntimeError(f"pipeline rank {self.rank}: backward of stage {s} micro-batch {mb} has no output grads")
        return [(e, grads[i]) for e, i in roots if i < len(grads) and grads[i] is not None]

    def _after_backward(self, st: _StepState, s: int, mb: int) -> None:
        """Hand the stage's input gradients to the previous stage (locally or via SEND_B)."""
        ins = st.inputs.pop((s, mb), [])
        grads = [x.grad if isinstance(x, torch.Tensor) and x.requires_grad and x.is_leaf else None for x in ins]
        prv = self.schedule.prev_stage(s, mb)
        if prv is None:
            return
        if self.schedule.stage_to_rank[prv] == self.rank:
            st.out_grads[(prv, mb)] = grads
        else:
            st.to_send_b[(s, mb)] = grads

    def _backward(self, st: _StepState, s: int, mb: int, split: bool) -> None:
        st.hook_outputs.pop((s, mb), None)
        roots = self._grad_roots(st, s, mb)
        store = self.weight_grad_store
        if not split:
            with store.enabled_for(False):
                backward_full(roots)
        elif self.zero_bubble == "store":
            with store.enabled_for(True):
                backward_full(roots)
            store.flush((s, mb))
        else:
            ins = st.inputs.get((s, mb), [])
            leaves = [x for x in ins if isinstance(x, torch.Tensor) and x.requires_grad and x.is_leaf]
            params = [p for p in self.stage_modules[s].parameters() if p.requires_grad]
            with store.enabled_for(True):
                st.deferred[(s, mb)] = backward_input(roots, leaves, params)
            store.flush((s, mb))
        self._after_backward(st, s, mb)

    def _weight(self, st: _StepState, s: int, mb: int) -> None:
        deferred = st.deferred.pop((s, mb), None)
        if deferred is not None:
            deferred.run()
        self.weight_grad_store.pop((s, mb))

    def _pair(self, st: _StepState, a: Action) -> None:
        f, b = a.sub_actions
        mf, mb_ = self.stage_modules[f.stage], self.stage_modules[b.stage]
        # The hook runs a full backward of ``b`` (for an I half, custom autograd
        # functions may still defer their weight work through the store).
        use_hook = not st.forward_only and self.overlap_hook and type(mf) is type(mb_)
        if not use_hook:
            self._forward(st, f.stage, f.microbatch)
            self._send_early(st, f.stage, f.microbatch)
            if not st.forward_only:
                self._backward(st, b.stage, b.microbatch, split=b.type is _I)
            return
        sched = self.schedule
        ins0 = self._stage_inputs(st, f.stage, f.microbatch)
        crit0 = st.criterion if sched.is_loss_stage(f.stage, f.microbatch) else None
        labels0 = list(st.mb_labels.get(f.microbatch, ())) if crit0 is not None else []
        kb = (b.stage, b.microbatch)
        if sched.is_loss_stage(b.stage, b.microbatch):
            loss1 = st.loss_tensors.pop(kb, None)
            outputs1: list[torch.Tensor] = []
            grads1: list[torch.Tensor] = []
            st.roots.pop(kb, None)
        else:
            loss1 = None
            if st.deferred_recvs:
                self._await(st, _RECV_B, b.stage, b.microbatch)
            outs = st.hook_outputs.pop(kb, ())
            g = st.out_grads.pop(kb, None)
            if g is None:
                raise RuntimeError(f"pipeline rank {self.rank}: {b} has no output grads")
            st.roots.pop(kb, None)
            pairs = [(o, gi) for o, gi in zip(outs, g, strict=False) if gi is not None]
            outputs1, grads1 = [o for o, _ in pairs], [gi for _, gi in pairs]
        store = self.weight_grad_store
        with store.enabled_for(b.type is _I):
            hook = type(mf).overlapped_forward_backward  # type: ignore[attr-defined]
            out0, loss0 = hook(mf, ins0, crit0, labels0, mb_, loss1, outputs1, grads1)
        if b.type is _I:
            store.flush(kb)
        self._forward(st, f.stage, f.microbatch, module_out=out0, loss=loss0)
        self._after_backward(st, b.stage, b.microbatch)

    # ---- communication ----------------------------------------------------
    def _send_early(self, st: _StepState, s: int, mb: int) -> None:
        """Post the SEND_F of a pair's forward half now, so the next rank has it before this pair's backward ends."""
        i = self._send_f_index.get((s, mb))
        if i is None or (s, mb) not in st.to_send_f:
            return
        a = self._actions[i]
        rec = st.rec
        start = time.perf_counter()
        self._send(st, a, _DIR_F)
        st.sent_early.add(i)
        if rec is not None and rec.enabled:
            rec.add(self._labels[i], start, time.perf_counter())

    def _peer_and_key(self, a: Action) -> tuple[int, tuple[int, int, int], int]:
        """(peer pipeline rank, tag key, direction) of a comm action."""
        sched, s, mb = self.schedule, a.stage, a.microbatch
        if a.type is _SEND_F:
            other = sched.next_stage(s, mb)
            consumer, direction = other, _DIR_F
        elif a.type is _RECV_F:
            other = sched.prev_stage(s, mb)
            consumer, direction = s, _DIR_F
        elif a.type is _SEND_B:
            other = sched.prev_stage(s, mb)
            consumer, direction = s, _DIR_B
        else:
            other = sched.next_stage(s, mb)
            consumer, direction = other, _DIR_B
        if other is None or consumer is None:
            raise ValueError(f"pipeline rank {self.rank}: {a} has no peer stage for micro-batch {mb}")
        return sched.stage_to_rank[other], (direction, consumer, mb), direction

    def _what(self, a: Action, peer: int) -> str:
        arrow = "to" if a.type in (_SEND_F, _SEND_B) else "from"
        return f"pipeline rank {self.rank}: {a} (micro-batch {a.microbatch}) {arrow} peer pipeline rank {peer}"

    def _post_recv(self, st: _StepState, a: Action) -> None:
        k = (a.type, a.stage, a.microbatch)
        if k in st.recvs or (st.forward_only and a.type is _RECV_B):
            return
        peer, key, _ = self._peer_and_key(a)
        # Transport errors already name this rank, the peer, the action and the micro-batch (``what``).
        st.recvs[k] = BoundaryRecv(
            self._transport, self.to_group_rank[peer], self.tags, key, self._what(a, peer), self.device, self._layouts
        )

    def _complete_recv(self, st: _StepState, a: Action) -> None:
        self._post_recv(st, a)
        recv = st.recvs.pop((a.type, a.stage, a.microbatch))
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        tensors = recv.wait(self.timeout_s, stream)
        if a.type is _RECV_F:
            if st.forward_only:
                for t in tensors:
                    if t is not None:
                        t.requires_grad_(False)
            st.inputs[(a.stage, a.microbatch)] = list(tensors)
        else:
            st.out_grads[(a.stage, a.microbatch)] = tensors

    def _send(self, st: _StepState, a: Action, direction: int) -> None:
        key = (a.stage, a.microbatch)
        if direction == _DIR_F:
            tensors: Sequence[torch.Tensor | None] = st.to_send_f.pop(key)
            flags = [t is not None and t.requires_grad for t in tensors]
        else:
            tensors = st.to_send_b.pop(key)
            flags = [False] * len(tensors)
        peer, tkey, _ = self._peer_and_key(a)
        send = BoundarySend(
            self._transport,
            tensors,
            flags,
            self.to_group_rank[peer],
            self.tags,
            tkey,
            self._what(a, peer),
            self._layouts,
        )
        keep = st.hook_outputs.get(key, ()) if direction == _DIR_F else ()
        st.sends.append((send, tuple(keep)))

    def _reap_sends(self, st: _StepState, block: bool) -> None:
        pending = []
        stop = False
        for send, hooked in st.sends:
            # Sends complete roughly in posting order: stop polling at the first
            # one still in flight (it is polled again at the next action).
            stop = stop or (not block and not send.is_completed())
            if not stop:
                send.wait(self.timeout_s)
                for t in hooked:
                    # The reference's memory trick: the hook path keeps output tensors
                    # (for outputs1), so drop their storage once sent.
                    if t.requires_grad and t._base is None:
                        t.data = torch.empty(0, dtype=t.dtype, device=t.device)
            else:
                pending.append((send, hooked))
        st.sends = pending

    def _finish_sends(self, st: _StepState) -> None:
        self._reap_sends(st, block=True)
        for a in list(st.deferred_recvs.values()):
            # A receive whose data no compute read (should not happen in a valid schedule): still drain it.
            self._await(st, a.type, a.stage, a.microbatch)
        if st.recvs:
            leftovers = [f"{s}{t}{m}" for t, s, m in st.recvs]
            raise RuntimeError(f"pipeline rank {self.rank}: receives posted but never consumed: {leftovers}")

    # ---- DualPipe: the two copies of a model stage -------------------------
    def _sync_mirrors(self) -> None:
        """Sum the gradients of the two copies of each duplicated model stage (both copies end equal)."""
        sched = self.schedule
        sends: list[BoundarySend] = []
        recvs: list[tuple[int, BoundaryRecv]] = []
        local_done: set[int] = set()
        for s in self.stages:
            t = self.mirror_of.get(s)
            if t is None:
                continue
            peer = sched.stage_to_rank[t]
            params = list(self.stage_modules[s].parameters())
            if peer == self.rank:
                if s in local_done:
                    continue
                local_done.update((s, t))
                other = list(self.stage_modules[t].parameters())
                _check_same_shapes(params, other, s, t)
                for p, q in zip(params, other, strict=False):
                    if p.grad is None and q.grad is None:
                        continue
                    total = _or_zeros(p) + _or_zeros(q)
                    p.grad, q.grad = total, total.clone()
                continue
            packed = _pack_grads(params)
            what = f"pipeline rank {self.rank}: mirror-gradient exchange of stage {s} with stage {t}"
            sends.append(
                BoundarySend(
                    self._transport,
                    packed,
                    [False] * len(packed),
                    self.to_group_rank[peer],
                    self.tags,
                    (_DIR_MIRROR, s, 0),
                    f"{what} (to peer pipeline rank {peer})",
                    self._layouts,
                )
            )
            recv = BoundaryRecv(
                self._transport,
                self.to_group_rank[peer],
                self.tags,
                (_DIR_MIRROR, t, 0),
                f"{what} (from peer pipeline rank {peer})",
                self.device,
                self._layouts,
            )
            recvs.append((s, recv))
        for s, recv in recvs:
            theirs = _unpack_grads(list(self.stage_modules[s].parameters()), recv.wait(self.timeout_s), s)
            with torch.no_grad():
                for param, grad in theirs:
                    # own + theirs on one side, theirs + own on the other: IEEE addition
                    # commutes, so both copies end bit-identical.
                    param.grad = grad if param.grad is None else param.grad + grad
        for send in sends:
            send.wait(self.timeout_s)


def _presplit(
    given: Sequence[Sequence[Any]] | None, n: int, name: str, full: tuple[Any, ...]
) -> list[tuple[Any, ...]] | None:
    """Check pre-split micro-batches (``given``): ``n`` tuples, and not together with the full batch."""
    if given is None:
        return None
    if full:
        raise ValueError(f"pass either the full batch or {name}=, not both")
    out = [tuple(mb) if isinstance(mb, (tuple, list)) else (mb,) for mb in given]
    if len(out) != n:
        raise ValueError(f"{name} must hold one entry per micro-batch: {n} expected, got {len(out)}")
    return out


def _pack_grads(params: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """``[has-grad mask (uint8), one flat buffer per dtype (zeros where no grad)]``: a few tensors per stage."""
    mask = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8)
    out: list[torch.Tensor | None] = [mask]
    for dtype in sorted({p.dtype for p in params}, key=str):
        out.append(torch.cat([_or_zeros(p).reshape(-1) for p in params if p.dtype == dtype]))
    return out


def _unpack_grads(
    params: Sequence[torch.Tensor], packed: Sequence[torch.Tensor | None], stage: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Inverse of :func:`_pack_grads` against this copy's parameters: ``(param, its mirror's grad)`` pairs."""
    dtypes = sorted({p.dtype for p in params}, key=str)
    mask = packed[0]
    sizes = {d: sum(p.numel() for p in params if p.dtype == d) for d in dtypes}
    flats = dict(zip(dtypes, packed[1:], strict=False))
    if (
        mask is None
        or mask.numel() != len(params)
        or len(packed) != len(dtypes) + 1
        or any(f is None or f.dtype != d or f.numel() != sizes[d] for d, f in flats.items())
    ):
        raise ValueError(
            f"stage {stage}: its mirror copy has different parameters; the two copies of a model stage "
            "must be the same module"
        )
    offsets = dict.fromkeys(dtypes, 0)
    has = mask.tolist()
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    for p, h in zip(params, has, strict=True):
        flat = flats[p.dtype]
        assert flat is not None
        g = flat[offsets[p.dtype] : offsets[p.dtype] + p.numel()].view_as(p)
        offsets[p.dtype] += p.numel()
        if h or p.grad is not None:
            out.append((p, g if h else torch.zeros_like(p)))
    return out


def _window_ends(actions: Sequence[Action], lookahead: int) -> list[int]:
    """end[i]: receives at indices < end[i] are posted before action i runs.

    A compute's receives sit right before it (lowering), so posting everything
    before the ``lookahead``-th compute after i covers the receives of the next
    ``lookahead`` computes.  Never less than i + 1: an action's own receive is
    always posted.
    """
    computes = [k for k, a in enumerate(actions) if a.is_compute]
    ends: list[int] = []
    for i in range(len(actions)):
        j = bisect.bisect_right(computes, i) + lookahead - 1  # index of the lookahead-th compute after i
        ends.append(max(i + 1, computes[j] if j < len(computes) else len(actions)))
    return ends


def _or_zeros(p: torch.Tensor) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)


def _check_same_shapes(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], s: int, t: int) -> None:
    if [tuple(p.shape) for p in a] != [tuple(q.shape) for q in b]:
        raise ValueError(f"stages {s} and {t} copy the same model stage but have different parameter shapes")


def _check_mapping(rank_mapping: Sequence[int] | None, size: int) -> list[int]:
    if rank_mapping is None:
        return list(range(size))
    mapping = list(rank_mapping)
    if sorted(mapping) != list(range(size)):
        raise ValueError(f"rank_mapping must be a permutation of 0..{size - 1}, got {mapping}")
    return mapping


def _check_modules(
    modules: Mapping[int, nn.Module] | Sequence[nn.Module], stages: tuple[int, ...], rank: int, name: str
) -> dict[int, nn.Module]:
    # One module: the stage module of a one-stage rank.  An nn.Sequential is the
    # stage module itself on a one-stage rank and a sequence of stage modules
    # otherwise (the reference passes nn.Sequential(module0, module1)).
    if isinstance(modules, nn.Module) and not isinstance(modules, nn.ModuleList):
        if not isinstance(modules, nn.Sequential) or len(stages) == 1:
            modules = [modules]
    if isinstance(modules, Mapping):
        got = dict(modules)
        if sorted(got) != sorted(stages):
            raise ValueError(
                f"pipeline rank {rank} holds stages {list(stages)} of schedule {name!r}; modules given for "
                f"stages {sorted(got)}"
            )
    else:
        seq = list(modules)
        if len(seq) != len(stages):
            raise ValueError(
                f"pipeline rank {rank} holds {len(stages)} stage(s) {list(stages)} of schedule {name!r}; "
                f"got {len(seq)} module(s)"
            )
        got = dict(zip(stages, seq, strict=False))
    for s, m in got.items():
        if not isinstance(m, nn.Module):
            raise ValueError(f"stage {s}: expected an nn.Module, got {type(m).__name__}")
    return got


def _module_device(modules: Mapping[int, nn.Module]) -> torch.device:
    for m in modules.values():
        for p in m.parameters():
            return p.device
    return torch.device("cpu")


def _mirrors(schedule: Schedule) -> dict[int, int]:
    """stage -> the other stage computing the same model stage (DualPipe's copies); empty when none."""
    by_model: dict[int, list[int]] = {}
    for s, m in enumerate(schedule.model_stage):
        by_model.setdefault(m, []).append(s)
    out: dict[int, int] = {}
    for m, ss in by_model.items():
        if len(ss) > 2:
            raise ValueError(f"model stage {m} has {len(ss)} copies; at most 2 are supported")
        if len(ss) == 2:
            out[ss[0]], out[ss[1]] = ss[1], ss[0]
    return out
