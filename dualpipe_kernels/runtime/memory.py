"""Saved activations under a memory policy (see :mod:`.memory_plan`): hooks, arena, reloads, accounting.

:class:`ActivationMemory` belongs to one pipeline (its policies, reload plan,
host arena and side stream); :class:`StepMemory` is one step's records, dropped
with the step.  The stage compute opens :meth:`ActivationMemory.saving` around a
stage's forward (``torch.autograd.graph.saved_tensors_hooks``), calls
:meth:`~ActivationMemory.before_backward` at the start of that micro-batch's
backward and :meth:`~ActivationMemory.release` when autograd no longer needs the
tensors (after B, or after the W of an I/W split); under recompute it also
calls :meth:`~ActivationMemory.after_input` after the I of a graph split and
:meth:`~ActivationMemory.before_weight` before its W; the action loop calls
:meth:`~ActivationMemory.at_action` before each action, which starts the reloads
the plan puts there.

Accounting: every saved tensor's *storage* is counted once per (stage, mb) while
it is device-resident.  Parameters never count (they are not activations), nor
does a stage input or label whose storage something else also holds (a slice of
the caller's batch is resident before and after the step under any policy); a
stage input this runtime alone holds (a received one) counts its own bytes.
The step's peak of the sum over this rank is :attr:`StepMemory.peak`.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.autograd.graph import saved_tensors_hooks

from dualpipe_kernels.runtime.memory_plan import MemoryPolicy, ReloadPlan
from dualpipe_kernels.runtime.memory_records import (
    Compressed,
    Dropped,
    OffloadedView,
    Record,
    SavedInput,
    StepMemory,
    sole_holder,
    tensor_bytes,
    unpack_saved,
)
from dualpipe_kernels.runtime.memory_store import CopyLanes, HostArena, OffloadGroup, storage_bytes, storage_ptr

__all__ = ["ActivationMemory", "StepMemory", "HISTORY"]

#: training steps whose peak (and host bytes) :class:`ActivationMemory` remembers (older ones drop off)
HISTORY = 256


class ActivationMemory:
    """The memory policies of one pipeline rank (``policies``: stage -> policy) over its lowered ``actions``.

    Counters: ``peaks`` (peak resident saved bytes of the last :data:`HISTORY`
    training steps, in order; keep stages count only with ``track = True``),
    ``host_bytes`` (bytes copied to the host arena, same steps), ``forward_bytes``
    (per stage, what one micro-batch held after its forward), ``arena.allocations``
    (host arena allocations, 1 once sized), ``offload_packs`` / ``reload_unpacks``
    (pack launches of offloading forwards, unpack launches of reloads, ever).

    Offload: the storages a forward saves go to the arena in one pack launch when
    the forward ends (on the offload lane); they leave the accounting (and the
    device) when that launch's event has fired, checked before each later compute
    action; their reload is one unpack launch on the reload lane (see
    :mod:`.memory_store`).

    Under recompute, compress and offload a custom autograd Function gets an
    alias of a saved parameter back, not the parameter itself (torch does this
    under any saved-tensor hook): its ``.grad`` is not the parameter's.
    """

    def __init__(
        self,
        rank: int,
        policies: Mapping[int, MemoryPolicy],
        actions: Sequence[Any],
        modules: Mapping[int, nn.Module],
        device: torch.device,
    ) -> None:
        self.rank = rank
        self.policies = dict(policies)
        self.modules = modules
        self.device = device
        offloads = any(p.kind == "offload" for p in self.policies.values())
        self.plan = ReloadPlan(actions, {s: p.lookahead for s, p in self.policies.items()}, settle=offloads)
        self.arena = HostArena(pin=device.type == "cuda")
        self.lanes = CopyLanes(device)
        self.peaks: deque[int] = deque(maxlen=HISTORY)
        self.host_bytes: deque[int] = deque(maxlen=HISTORY)
        self.offload_packs = 0
        self.reload_unpacks = 0
        self._layouts: Any = None  # kernels.LayoutCache, made on first offload
        self._pending: list[Record] = []  # records whose offload pack has not settled yet
        self._draining: list[OffloadGroup] = []  # released groups whose pack still reads their sources
        # Keep stages run without hooks unless accounting is asked for: under any saved-tensor hook
        # autograd hands a custom Function back an alias of a saved parameter, not the parameter, so
        # code that accumulates into ``saved_weight.grad`` (the reference's zero-bubble linears) would
        # write to the alias.  Benchmarks set ``track = True`` to measure keep's peak.
        self.track = False
        # Per stage: the largest resident bytes one micro-batch's record held at the end of its
        # forward in the last training step (what a policy keeps per chunk; benchmarks feed it to the model).
        self.forward_bytes: dict[int, int] = {}
        # Per stage: the same at the last moment of the forward, before a compressed stage input is packed
        # and its whole copy freed (what the record holds while the forward still reads its input).
        self.forward_peak_bytes: dict[int, int] = {}

    # ---- step ---------------------------------------------------------------
    def begin_step(self, training: bool) -> StepMemory:
        """A fresh step: reset the arena (sized from the previous steps) and note the parameters' storages."""
        self.lanes.drain()  # no copy of the last step still reads or writes the arena
        self._pending.clear()
        self._draining.clear()
        self.arena.reset()
        if training:
            self.forward_bytes = {}
            self.forward_peak_bytes = {}
        # The parameters' storages matter only to the saved-tensor hooks (never moved); keep stages run
        # without hooks unless tracked, so a keep-only rank skips the walk over its parameters.
        hooked = self.track or any(p.kind != "keep" for p in self.policies.values())
        params = set()
        if training and hooked:
            params = {storage_ptr(p) for m in self.modules.values() for p in m.parameters()}
        return StepMemory(training=training, params=params)

    def end_step(self, sm: StepMemory) -> None:
        if sm.training:
            self.peaks.append(sm.peak)
            self.host_bytes.append(sm.host_bytes)
        sm.records.clear()

    def close(self) -> None:
        """Wait for the copy lanes and end their threads (idempotent; a later step starts them again)."""
        self.lanes.close()
        self._pending.clear()
        self._draining.clear()

    @property
    def last_peak_bytes(self) -> int:
        """Peak device-resident saved bytes of the last training step (0 before the first)."""
        return self.peaks[-1] if self.peaks else 0

    # ---- forward --------------------------------------------------------------
    @contextlib.contextmanager
    def saving(
        self, sm: StepMemory, s: int, mb: int, pinned: Sequence[Any], replay: Callable[[], None] | None
    ) -> Iterator[None]:
        """Apply stage ``s``'s policy to what autograd saves inside the block (the forward of ``mb``).

        ``pinned``: tensors held anyway (stage inputs, labels) that never move.
        ``replay``: re-runs the block's computation (recompute).
        """
        key = (s, mb)
        pol = self.policies.get(s, MemoryPolicy())
        if not sm.training or not torch.is_grad_enabled() or (pol.kind == "keep" and not self.track):
            yield
            return
        rec = sm.records.get(key)
        if rec is None:
            pins = set(sm.params) | {storage_ptr(t) for t in pinned if isinstance(t, torch.Tensor)}
            rec = Record(key, pol, pins, offload=pol.kind == "offload" and key not in self.plan.resident)
            sm.records[key] = rec
            if pol.kind == "recompute":
                rec.replay = replay
                cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
                rec.rng = (torch.get_rng_state(), cuda)
        rec.open = True
        pack = self._packer(sm, rec)
        try:
            with saved_tensors_hooks(pack, unpack_saved):
                yield
        finally:
            self._close(sm, rec)

    def _packer(self, sm: StepMemory, rec: Record) -> Callable[[torch.Tensor], Any]:
        kind = rec.policy.kind

        # Tensors that stay go back as they came when they are leaves (a custom function may use a
        # saved parameter's ``.grad``), detached otherwise: a saved *output* returned as itself makes a
        # reference cycle through its own grad_fn that Python's gc cannot see (a leak per step).
        def same(t: torch.Tensor) -> torch.Tensor:
            return t if t.grad_fn is None else t.detach()

        def pack(t: torch.Tensor) -> Any:
            index, rec.saves = rec.saves, rec.saves + 1
            ptr = storage_ptr(t)
            if ptr in sm.params:
                return same(t)
            if ptr in rec.pinned:
                if not sole_holder(t):
                    # The caller's batch (or another record's saved tensor): held there whatever this
                    # record does, so not this record's bytes.
                    return same(t)
                if (
                    kind == "compress"
                    and t.grad_fn is None
                    and t.is_floating_point()
                    and tensor_bytes(t) >= rec.policy.min_bytes
                ):
                    return self._compress_input(sm, rec, t)
                self._count(sm, rec, ptr, tensor_bytes(t))
                return same(t)
            if kind == "recompute":
                rec.dropped.append(index)
                return Dropped(rec, index)
            if kind == "compress" and t.is_floating_point() and tensor_bytes(t) >= rec.policy.min_bytes:
                return self._compress(sm, rec, t)
            if rec.offload and storage_bytes(t) >= rec.policy.min_bytes:
                return self._offload(sm, rec, t)
            self._count(sm, rec, ptr, storage_bytes(t))
            return same(t)

        return pack

    def _count(self, sm: StepMemory, rec: Record, ident: Any, n: int) -> None:
        if ident not in rec.counted:
            rec.counted.add(ident)
            sm.add(rec, n)

    def _compress(self, sm: StepMemory, rec: Record, t: torch.Tensor) -> Any:
        from dualpipe_kernels.kernels import pack

        ident = (storage_ptr(t), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        got = rec.seen.get(ident)
        if got is None:
            buf, layout = pack([t.detach()], dtype=rec.policy.dtype)
            got = rec.seen[ident] = (buf, layout, t)
            sm.add(rec, buf.numel())
        return Compressed(got[0], got[1], t.requires_grad)

    def _compress_input(self, sm: StepMemory, rec: Record, t: torch.Tensor) -> SavedInput:
        """A stage input this runtime alone holds, under compress: whole during the forward (which reads
        it), packed at its end (:meth:`_close`)."""
        ident = ("input", storage_ptr(t), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        got = rec.seen.get(ident)
        if got is None:
            got = rec.seen[ident] = SavedInput(t, rec.policy.dtype)
            rec.inputs.append(got)
            self._count(sm, rec, storage_ptr(t), tensor_bytes(t))
        return got

    def _offload(self, sm: StepMemory, rec: Record, t: torch.Tensor) -> OffloadedView:
        if not rec.groups or rec.groups[-1].host is not None:
            rec.groups.append(OffloadGroup(self.lanes, rec.policy.dtype, rec.policy.offload_path))
        group = rec.groups[-1]
        before = group.nbytes
        # The group holds the storage until its pack has run (dedupe by address needs it alive).
        index = group.add(t)
        if group.nbytes != before:
            sm.add(rec, group.nbytes - before)
        return OffloadedView(rec, group, index, t.dtype, tuple(t.shape), tuple(t.stride()), int(t.storage_offset()))

    def _close(self, sm: StepMemory, rec: Record) -> None:
        """End of the forward: its offloaded storages go to the arena in one pack launch (they leave when
        it has run, see :meth:`_settle`); a compressed stage input keeps one copy (see :class:`SavedInput`)."""
        rec.open = False
        s = rec.key[0]
        # what the forward held at its end: offloaded sources and a compressed stage input still whole
        self.forward_peak_bytes[s] = max(self.forward_peak_bytes.get(s, 0), rec.nbytes)
        leaving = 0
        if rec.groups and rec.groups[-1].host is None and rec.groups[-1].holds_sources:
            from dualpipe_kernels import kernels

            if self._layouts is None:
                self._layouts = kernels.LayoutCache()
            group = rec.groups[-1]
            sm.host_bytes += group.launch(self.arena, self._layouts)
            self.offload_packs += 1
            self._pending.append(rec)
            leaving = group.nbytes
        rec.seen.clear()
        for held in rec.inputs:
            sm.add(rec, held.settle())
        rec.inputs.clear()
        self.forward_bytes[s] = max(self.forward_bytes.get(s, 0), rec.nbytes - leaving)

    def _settle(self, sm: StepMemory) -> None:
        """Drop the sources of every offload pack that has run (a GPU polls its event, a CPU waits)."""
        if self._pending:
            still = []
            for rec in self._pending:
                settled = [g.settle() for g in rec.groups]
                for g, done in zip(rec.groups, settled, strict=True):
                    if done:
                        sm.add(rec, -g.nbytes)
                if any(g.holds_sources for g in rec.groups):
                    still.append(rec)
            self._pending = still
        if self._draining:
            self._draining = [g for g in self._draining if not g.settle() and g.holds_sources]

    # ---- reload, recompute, release ---------------------------------------------
    def at_action(self, sm: StepMemory, i: int) -> None:
        """Before compute action ``i``: settle the offload packs that have run, then start the reloads the
        plan puts there."""
        if not sm.training:
            return
        self._settle(sm)
        for key in self.plan.reload_at.get(i, ()):
            rec = sm.records.get(key)
            if rec is not None:
                self._reload(sm, rec)

    def _reload(self, sm: StepMemory, rec: Record) -> None:
        """One unpack launch per offload group of ``rec`` (a group whose pack has not run yet keeps its
        sources, which the backward then reads)."""
        for group in rec.groups:
            if group.reload():
                sm.add(rec, group.nbytes)
                self.reload_unpacks += 1

    def before_backward(self, sm: StepMemory, s: int, mb: int) -> None:
        """Right before the backward of (s, mb): its offloaded tensors are (being) reloaded, or it is recomputed."""
        rec = sm.records.get((s, mb))
        if rec is None:
            return
        if rec.groups:
            self._settle(sm)
            self._reload(sm, rec)  # no-op when the plan already started it
        if rec.replay is not None and rec.recomputed is None:
            self._recompute(sm, rec)

    def _recompute(self, sm: StepMemory, rec: Record) -> None:
        captured: list[torch.Tensor] = []

        def pack(t: torch.Tensor) -> None:
            captured.append(t.detach())

        def unpack(_: Any) -> torch.Tensor:
            raise RuntimeError("recompute: the replayed forward's graph is not for backward")

        cpu_state, cuda_state = rec.rng  # type: ignore[misc]
        devices = [self.device] if cuda_state is not None else []
        with torch.random.fork_rng(devices=devices), torch.enable_grad(), saved_tensors_hooks(pack, unpack):
            torch.set_rng_state(cpu_state)
            if cuda_state is not None:
                torch.cuda.set_rng_state(cuda_state, self.device)
            rec.replay()  # type: ignore[misc]
        s, mb = rec.key
        if len(captured) != rec.saves:
            raise RuntimeError(
                f"pipeline rank {self.rank}: recompute of stage {s} micro-batch {mb} saved {len(captured)} tensors, "
                f"its forward saved {rec.saves}; a recomputed stage must save the same tensors every time"
            )
        rec.recomputed = captured
        for i in rec.dropped:
            t = captured[i]
            ptr = storage_ptr(t)
            if ptr not in rec.counted:
                rec.recounted[ptr] = storage_bytes(t)
                self._count(sm, rec, ptr, storage_bytes(t))

    def after_input(self, sm: StepMemory, s: int, mb: int) -> None:
        """The I of a graph-split backward of (s, mb) is done: a recomputed forward's tensors go now.

        The graph split's W re-walks the stage's graph from its cut nodes to the
        parameters and reads the saved tensors of every node on the way (for a
        chain of parametrised ops, nearly all of them), so holding the
        recomputation from I to W would hold keep's bytes for every key between
        its I and its W.  :meth:`before_weight` recomputes again instead (one
        more F, same RNG state, so the same tensors bit for bit).
        """
        rec = sm.records.get((s, mb))
        if rec is None or rec.recomputed is None:
            return
        rec.recomputed = None
        for ptr, n in rec.recounted.items():
            rec.counted.discard(ptr)
            sm.add(rec, -n)
        rec.recounted.clear()

    def before_weight(self, sm: StepMemory, s: int, mb: int) -> None:
        """Right before a W that reads the saved tensors of (s, mb): recompute what :meth:`after_input` dropped."""
        rec = sm.records.get((s, mb))
        if rec is not None and rec.replay is not None and rec.recomputed is None:
            self._recompute(sm, rec)

    def release(self, sm: StepMemory, s: int, mb: int) -> None:
        """Autograd is done with (s, mb): its records (and accounting) go."""
        rec = sm.records.pop((s, mb), None)
        if rec is not None:
            sm.add(rec, -rec.nbytes)
            rec.recomputed = None
            rec.recounted.clear()
            for group in rec.groups:
                if group.holds_sources:  # its pack may still read them: held until its event fires
                    self._draining.append(group)
                group.release()
            self._pending = [r for r in self._pending if r is not rec]
            rec.groups.clear()
