"""The action loop: runs this rank's lowered action list in order, with a window of posted receives.

The list is exactly the lowered schedule the simulator times (schedules.lowering).
Each action goes to its kind's handler in :data:`HANDLERS`; a new action kind
adds one entry there (see docs/adding_an_action.md).  The loop's plan, worked out
once per list (:class:`ActionLoop`), gives every action an op; the library's own
kinds (F, B, I, W, F&B, SEND) call the compute or the boundary directly, which is
what their HANDLERS entries do, while HANDLERS holds those entries (a profiled or
timed step, or one whose HANDLERS entry for such a kind was replaced, goes through
the handlers).

Receives are posted ``recv_lookahead`` compute actions ahead of need (metadata
first, data the moment the metadata is in).  With ``early_small`` (a transport
that gains from it says so: gloo) every receive whose message repeats the last
step's layout inline (one transfer of at most the pipeline's inline limit of data:
``INLINE_MAX_BYTES`` on such a transport, runtime/boundary/inline.py and repeat.py) is
posted when the step starts instead; the window then covers the rest.  A RECV action the loop reaches is
not waited for there but by the compute that reads its data (``fetch``), so an
F&B pair runs its forward half while its backward half's gradient is still in
flight; its timeline entry spans the actual wait.

An F&B pair that runs its halves one after the other (no overlap hook) posts
its forward half's activation send as soon as that half is done, before its
backward half runs, when the lowered list has that SEND_F right after the pair
(before the next compute): the peer's next forward can start while this rank
runs the backward half.  The loop then skips the SEND_F when it reaches it.
The same tensors go to the same peer under the same key; only the posting
moves earlier (the simulator still times the pair's sends at its end).

Under an active torch profiler every executed action runs inside
``torch.profiler.record_function(<action>)`` (``0F3``, ``(0F7;7B3)OVERLAP_F_B``,
``1SEND_F2``; a receive's range spans its wait).  Whether a profiler is on is
read once per step, so a step without one pays nothing per action.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch.profiler import record_function

from dualpipe_kernels.runtime.boundary.exchange import Boundary, BoundaryState
from dualpipe_kernels.runtime.compute import ComputeState, StageCompute
from dualpipe_kernels.runtime.timeline import TimelineRecorder
from dualpipe_kernels.schedules.ir import (
    T_B,
    T_F,
    T_I,
    T_PAIR,
    T_RECV_B,
    T_RECV_F,
    T_SEND_B,
    T_SEND_F,
    T_W,
    Action,
    ActionType,
)

__all__ = ["ActionLoop", "StepRun", "HANDLERS", "window_ends"]


def window_ends(actions: Sequence[Action], lookahead: int) -> list[int]:
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


@dataclass
class StepRun:
    """One step on this rank: the compute and boundary states and the timeline recorder.

    ``done_hooks[i]()`` runs right after action ``i`` (e.g. a stage's data-parallel reduction).
    """

    loop: ActionLoop
    compute: StageCompute
    boundary: Boundary
    cst: ComputeState
    bst: BoundaryState
    rec: TimelineRecorder
    done_hooks: Mapping[int, Callable[[], Any]] = field(default_factory=dict)
    profiling: bool = False  # a torch profiler is recording this step: record_function per action
    # SEND_F actions an F&B pair already posted after its forward half (skipped when the loop reaches them)
    sent_early: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        cst = self.cst
        cst.fetch = self.fetch
        # the compute tests a key in these before calling fetch (no call for data that is already local)
        cst.reached_f, cst.reached_b = self.bst.reached_f, self.bst.reached_b

    def fetch(self, t: ActionType, s: int, mb: int) -> None:
        """Complete the receive ``(t, s, mb)`` if the action list has reached it, and deliver its data."""
        i = (self.bst.reached_f if t is T_RECV_F else self.bst.reached_b).pop((s, mb), None)
        if i is not None:
            self.cst.receive(i)

    def receive_traced(self, i: int) -> None:
        """:meth:`receive` inside its RECV span (a wait nested in the compute's)."""
        self.loop._traced(self, i, self.receive, i)

    def receive(self, i: int) -> None:
        a = self.loop.actions[i]
        tensors = self.boundary.complete_recv(self.bst, i)
        key = self.loop.keys[i]
        if a.type is T_RECV_F:
            if self.cst.forward_only:
                for x in tensors:
                    if x is not None:
                        x.requires_grad_(False)
            self.cst.inputs[key] = list(tensors)
        else:
            self.cst.out_grads[key] = tensors

    def send(self, i: int, a: Action) -> None:
        key = self.loop.keys[i]
        cst = self.cst
        if a.type is T_SEND_F:
            tensors = cst.outbox_f.pop(key)
            flags = []  # a loop, not a comprehension: once per send
            for x in tensors:
                flags.append(x is not None and x.requires_grad)
            keep = tuple(cst.hook_outputs.get(key, ())) if cst.hook_outputs else ()
            self.boundary.send(self.bst, i, tensors, flags, keep)
        else:
            grads = cst.outbox_b.pop(key)
            self.boundary.send(self.bst, i, grads, [False] * len(grads))

    def pair(self, i: int, a: Action) -> None:
        """F&B pair ``i``; its forward half's SEND_F, if the list has it right after, goes out between the halves."""
        j = self.loop.early_send.get(i)
        if j is None:
            self.compute.pair(self.cst, a)
        else:
            self.compute.pair(self.cst, a, partial(self._send_early, j))

    def _send_early(self, j: int) -> None:
        a = self.loop.actions[j]
        if self.profiling or self.rec.enabled:
            self.loop._traced(self, j, self.send, j, a)  # its own profiler range / timeline span, as in the loop
        else:
            self.send(j, a)
        self.sent_early.add(j)

    def finish(self) -> None:
        """End of the step's list: wait for every send, drain reached receives, check nothing is left."""
        self.boundary.reap(self.bst, block=True)
        for t, reached in ((T_RECV_F, self.bst.reached_f), (T_RECV_B, self.bst.reached_b)):
            for s, mb in list(reached):
                # A receive whose data no compute read (should not happen in a valid schedule): still drain it.
                self.fetch(t, s, mb)
        self.boundary.check_drained(self.bst)


Handler = Callable[[StepRun, int, Action], None]

HANDLERS: dict[ActionType, Handler] = {
    T_F: lambda run, i, a: run.compute.forward(run.cst, a.stage, a.microbatch),
    T_B: lambda run, i, a: run.compute.backward(run.cst, a.stage, a.microbatch, split=False),
    T_I: lambda run, i, a: run.compute.backward(run.cst, a.stage, a.microbatch, split=True),
    T_W: lambda run, i, a: run.compute.weight(run.cst, a.stage, a.microbatch),
    T_PAIR: StepRun.pair,
    T_SEND_F: StepRun.send,
    T_SEND_B: StepRun.send,
    T_RECV_F: lambda run, i, a: run.receive(i),
    T_RECV_B: lambda run, i, a: run.receive(i),
}
"""Action kind -> what this rank does for it.  Constant in the library; a test may add an entry (monkeypatch)."""

_LIBRARY: dict[ActionType, Handler] = dict(HANDLERS)  # the library's own entries (the plan's direct ops)

_RECVS = frozenset({T_RECV_F, T_RECV_B})
# Action kinds as small ints for the loop (an enum's hash is a Python call); gradient work, skipped under
# no_grad, is >= _K_GRAD_WORK.
_K_OTHER, _K_RECV_F, _K_GRAD_WORK, _K_RECV_B = 0, 1, 2, 3
# What the loop does for an action (its plan's op): the library's own kinds run without a handler call when
# HANDLERS still holds the library's entries for them; _OP_HANDLER: through HANDLERS (a kind a test added).
_OP_HANDLER, _OP_RECV, _OP_F, _OP_B, _OP_I, _OP_W, _OP_NOP, _OP_PAIR, _OP_SEND = range(9)
_OPS = {T_F: _OP_F, T_B: _OP_B, T_I: _OP_I, T_W: _OP_W, T_PAIR: _OP_PAIR, T_SEND_F: _OP_SEND, T_SEND_B: _OP_SEND}


def _kind(t: ActionType) -> int:
    if t is T_RECV_F:
        return _K_RECV_F
    if t is T_RECV_B:
        return _K_RECV_B
    return _K_GRAD_WORK if t in (T_B, T_I, T_W, T_SEND_B) else _K_OTHER


def _fused_weight(run: StepRun, i: int, a: Action) -> None:
    """A W whose I ran as a full B (see :func:`fused_input_weight`): nothing left to do."""


def fused_input_weight(actions: Sequence[Action]) -> tuple[int, ...]:
    """Indices ``i`` of the I actions whose own W (same stage and micro-batch) is the next action, ``i + 1``."""
    return tuple(
        i
        for i in range(len(actions) - 1)
        if actions[i].type is T_I
        and actions[i + 1].type is T_W
        and actions[i + 1].stage == actions[i].stage
        and actions[i + 1].microbatch == actions[i].microbatch
    )


def early_sends(actions: Sequence[Action]) -> dict[int, int]:
    """``{pair index: SEND_F index}``: each F&B pair whose forward half's SEND_F comes after it, before the
    next compute action (where lowering puts it), and which may therefore go out between the pair's halves."""
    out: dict[int, int] = {}
    for i, a in enumerate(actions):
        if a.type is not T_PAIR:
            continue
        f = a.sub_actions[0]
        for j in range(i + 1, len(actions)):
            b = actions[j]
            if b.is_compute:
                break
            if b.type is T_SEND_F and b.stage == f.stage and b.microbatch == f.microbatch:
                out[i] = j
                break
    return out


class ActionLoop:
    """Runs one rank's lowered list (``actions``) with receives posted ``recv_lookahead`` computes ahead.

    Everything that depends only on the list is worked out once here, a plan of the step
    (so the per-action work of a step stays small): the receives to post before each action, each
    action's kind and op as small ints, its ``(stage, micro-batch)``, the timeline labels.
    """

    def __init__(self, actions: Sequence[Action], recv_lookahead: int, early_small: bool = False) -> None:
        self.actions = list(actions)
        self.early_small = early_small
        # the RECV actions a step consumes: all of them, and a forward-only step's (no gradients)
        self.recvs = tuple(i for i, a in enumerate(self.actions) if a.type in _RECVS)
        self.recvs_forward = tuple(i for i in self.recvs if self.actions[i].type is T_RECV_F)
        self.labels = [str(a) for a in self.actions]  # timeline labels, built once
        self.keys = [(a.stage, a.microbatch) for a in self.actions]
        # posts[i]: the RECV actions whose receives are posted right before action i runs
        self.posts: list[tuple[int, ...]] = []
        done = 0
        for end in window_ends(self.actions, recv_lookahead):
            self.posts.append(tuple(j for j in range(done, end) if self.actions[j].type in _RECVS))
            done = max(done, end)
        self.kinds = [_kind(a.type) for a in self.actions]
        # Handlers are looked up per step by type (a test may add a kind): once per distinct type.
        self.types = list(dict.fromkeys(a.type for a in self.actions))
        self.type_index = [self.types.index(a.type) for a in self.actions]
        self.ops = [_OP_RECV if a.type in _RECVS else _OPS.get(a.type, _OP_HANDLER) for a in self.actions]
        # An I directly followed by its own W runs as one B (the same gradients, one backward pass); the W's
        # slot runs nothing, but stays in the list (its timeline span, the DP hooks keyed by its index).
        self.fused = fused_input_weight(self.actions)
        if self.fused:
            if T_B not in self.types:
                self.types.append(T_B)
            for i in self.fused:
                self.type_index[i] = self.types.index(T_B)
                self.type_index[i + 1] = len(self.types)  # the no-op slot after the types' handlers
                self.ops[i], self.ops[i + 1] = _OP_B, _OP_NOP
        self.early_send = early_sends(self.actions)

    def run(self, run: StepRun) -> None:
        acts, bst, boundary, rec, kinds, posts = self.actions, run.bst, run.boundary, run.rec, self.kinds, self.posts
        forward_only = bst.forward_only
        # Read once per step: entering record_function costs microseconds even with no profiler on.
        run.profiling = profiling = torch.autograd.profiler._is_profiler_enabled
        traced = profiling or rec.enabled
        compute, cst = run.compute, run.cst
        cst.receive = run.receive_traced if traced else run.receive
        memory = compute.memory
        assert memory is not None and cst.mem is not None  # both set by the pipeline before a step
        # Actions before which the memory plan starts reloads (empty unless a stage offloads): a set test per action.
        offloads = any(p.kind == "offload" for p in memory.policies.values())  # only they reload or settle
        reloads = memory.plan.reload_at if cst.mem.training and offloads else {}
        by_type: list[Handler | None] = [HANDLERS.get(t) for t in self.types]
        by_type.append(_fused_weight)
        # The plan's direct ops stand for the library's handlers; a test that replaced one gets it called.
        direct = not traced and all(HANDLERS.get(t) is h for t, h in _LIBRARY.items())
        ops = self.ops if direct else [_OP_RECV if op == _OP_RECV else _OP_HANDLER for op in self.ops]
        type_index, keys, early_send = self.type_index, self.keys, self.early_send
        hooks = run.done_hooks
        sent_early = run.sent_early
        posted, reached_f, reached_b = bst.recvs, bst.reached_f, bst.reached_b
        if self.early_small:
            boundary.post_repeats(bst, self.recvs_forward if forward_only else self.recvs)
        for i, kind in enumerate(kinds):
            # Post the receives of the next `recv_lookahead` compute actions after
            # this one (double buffering with the default 2: while compute i runs,
            # the data of computes i+1 and i+2 is already on its way).
            for j in posts[i]:
                if j not in posted and not (forward_only and kinds[j] == _K_RECV_B):
                    boundary.post_recv(bst, j)
            if bst.watch:
                boundary.progress(bst)
            if bst.sends:
                boundary.reap(bst, block=False)
            if forward_only and kind >= _K_GRAD_WORK:
                continue
            if sent_early and i in sent_early:  # posted by its F&B pair between the halves
                sent_early.discard(i)
                continue
            op = ops[i]
            if op == _OP_RECV:
                if i not in posted:
                    boundary.post_recv(bst, i)
                (reached_f if kind == _K_RECV_F else reached_b)[keys[i]] = i
                continue
            if i in reloads:
                memory.at_action(cst.mem, i)  # reloads the plan starts here
            if op == _OP_F:
                compute.forward(cst, *keys[i])
            elif op == _OP_SEND:
                run.send(i, acts[i])
            elif op == _OP_B:
                compute.backward(cst, *keys[i], False)
            elif op == _OP_PAIR:
                if i in early_send:
                    run.pair(i, acts[i])
                else:
                    compute.pair(cst, acts[i])
            elif op == _OP_I:
                compute.backward(cst, *keys[i], True)
            elif op == _OP_W:
                compute.weight(cst, *keys[i])
            elif op == _OP_HANDLER:
                handler = by_type[type_index[i]]
                if handler is None:
                    raise ValueError(
                        f"pipeline rank {boundary.rank}: no runtime handler for action kind {acts[i].type} ({acts[i]})"
                    )
                if traced:
                    self._traced(run, i, handler, run, i, acts[i])
                else:
                    handler(run, i, acts[i])
            if hooks and i in hooks:
                hooks[i]()
        run.finish()

    def _traced(self, run: StepRun, i: int, fn: Callable[..., None], *args: Any) -> None:
        """``fn(*args)`` inside action ``i``'s profiler range and/or timeline span.

        The span is two clock reads around the call, not a context manager: an ExitStack holding a
        generator-based span cost about 25 Python calls per action, 3% of a 1 ms-chunk step."""
        label = self.labels[i]
        rec = run.rec
        start = time.perf_counter() if rec.enabled else 0.0
        try:
            if run.profiling:
                with record_function(label):
                    fn(*args)
            else:
                fn(*args)
        finally:
            if rec.enabled:
                rec.add(label, start, time.perf_counter())
