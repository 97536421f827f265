"""The capture plan of per-chunk CUDA graphs: which graphs one rank needs, read from its schedule.

A stage's forward graph writes its saved activations into memory the graph owns, so a second
micro-batch may replay the same graph only after the first one's backward (and W, when the schedule
splits it) has read them.  The plan walks the rank's action list once and gives every (stage,
micro-batch) a *slot*: the lowest slot of its (stage, input signature) that is free at its F; a slot
is busy from the F to the micro-batch's last gradient action (B, or W after an I).  Each slot is one
forward graph and one backward graph, with one set of static input and incoming-gradient buffers,
sharing one memory pool (the backward replays between its forward's replays; two slots never share
a pool, since their saved activations are alive at the same time).

Only training steps replay graphs (a forward-only step runs eager), so the plan counts training
actions: per stage, its F replays and its B-or-I replays per step.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from dualpipe_kernels.schedules.ir import T_B, T_F, T_I, T_W, Schedule

__all__ = ["GraphKey", "CapturePlan", "capture_plan", "Signature"]

#: what a forward's graph is specialised to (shapes, dtypes, requires_grad of its inputs...): any hashable
Signature = Hashable

FORWARD, BACKWARD = "F", "B"


@dataclass(frozen=True)
class GraphKey:
    """One graph: ``stage``'s forward (``"F"``) or backward (``"B"``, replayed at a B or an I) for inputs of
    ``signature`` (None: the only one), in ``slot``."""

    stage: int
    kind: str
    signature: Signature
    slot: int

    def __str__(self) -> str:
        sig = "" if self.signature is None else f" {self.signature}"
        return f"{self.stage}{self.kind}[slot {self.slot}]{sig}"


@dataclass(frozen=True)
class CapturePlan:
    """The graphs of one rank (see the module docstring).

    ``keys``: every graph, in capture order (each slot's F then its B, slots in the order the schedule
    first uses them).  ``slot_of[(stage, mb)]``: the slot a micro-batch's forward and backward replay in.
    ``forward_order[stage]``: the micro-batches of the stage's F actions, in the list's order (the k-th
    forward call of a training step is the k-th of these).  ``replays[(stage, kind)]``: replays of that
    kind per training step.  ``pool_of[key]``: the memory pool id of a graph (a slot's two graphs share
    one).  ``warmup_iters``: eager runs per (stage, signature) on a side stream before its first capture.
    """

    rank: int
    keys: tuple[GraphKey, ...]
    slot_of: Mapping[tuple[int, int], int]
    signature_of: Mapping[tuple[int, int], Signature]
    forward_order: Mapping[int, tuple[int, ...]]
    replays: Mapping[tuple[int, str], int]
    pool_of: Mapping[GraphKey, int]
    warmup_iters: int

    def graphs_of(self, stage: int) -> int:
        """How many graphs ``stage`` needs (two per slot)."""
        return sum(1 for k in self.keys if k.stage == stage)

    def slots_of(self, stage: int, signature: Signature) -> int:
        """How many slots (saved-activation sets alive at once) ``stage`` needs for ``signature``."""
        return sum(1 for k in self.keys if k.stage == stage and k.signature == signature and k.kind == FORWARD)

    def describe(self, stage: int) -> str:
        """``stage``'s graphs, slots and replays per step, in words."""
        n = self.graphs_of(stage)
        return (
            f"{n} graphs ({n // 2} slots), {self.replays.get((stage, FORWARD), 0)} forward and "
            f"{self.replays.get((stage, BACKWARD), 0)} backward replays per step"
        )


def capture_plan(
    schedule: Schedule,
    rank: int,
    signatures: Mapping[tuple[int, int], Signature] | None = None,
    warmup_iters: int = 3,
    stages: frozenset[int] | None = None,
) -> CapturePlan:
    """The capture plan of pipeline rank ``rank`` of ``schedule`` (compute-only or lowered).

    ``signatures[(stage, mb)]``: the input signature each micro-batch's forward was seen with (one graph
    per signature; missing: None, one shape for all).  ``stages``: the stages to plan (default: all the
    rank's stages).
    """
    if not 0 <= rank < schedule.num_ranks:
        raise ValueError(f"rank {rank} is not a rank of schedule {schedule.name!r} (0..{schedule.num_ranks - 1})")
    sigs = signatures or {}
    computes = [c for a in schedule.actions[rank] for c in a.computes()]
    wanted = stages if stages is not None else frozenset(schedule.stages_of_rank(rank))
    has_w = {(c.stage, c.microbatch) for c in computes if c.type is T_W}
    free: dict[tuple[int, Signature], list[int]] = {}
    made: dict[tuple[int, Signature], int] = {}
    slot_of: dict[tuple[int, int], int] = {}
    order: dict[int, list[int]] = {s: [] for s in sorted(wanted)}
    replays: dict[tuple[int, str], int] = {}
    keys: list[GraphKey] = []
    for c in computes:
        s, mb = c.stage, c.microbatch
        if s not in wanted:
            continue
        group = (s, sigs.get((s, mb)))
        if c.type is T_F:
            order[s].append(mb)
            replays[(s, FORWARD)] = replays.get((s, FORWARD), 0) + 1
            pool = free.setdefault(group, [])
            if pool:
                slot = pool.pop(0)
            else:
                slot = made.get(group, 0)
                made[group] = slot + 1
                keys += [GraphKey(s, FORWARD, group[1], slot), GraphKey(s, BACKWARD, group[1], slot)]
            slot_of[(s, mb)] = slot
        elif c.type in (T_B, T_I):
            replays[(s, BACKWARD)] = replays.get((s, BACKWARD), 0) + 1
        done = c.type is T_W or (c.type is T_B) or (c.type is T_I and (s, mb) not in has_w)
        if done and (s, mb) in slot_of:
            free.setdefault(group, []).append(slot_of[(s, mb)])
            free[group].sort()
    pool_ids: dict[tuple[int, Signature, int], int] = {}
    pool_of = {k: pool_ids.setdefault((k.stage, k.signature, k.slot), len(pool_ids)) for k in keys}
    return CapturePlan(
        rank=rank,
        keys=tuple(keys),
        slot_of=MappingProxyType(slot_of),
        signature_of=MappingProxyType({k: sigs.get(k) for k in slot_of}),
        forward_order=MappingProxyType({s: tuple(v) for s, v in order.items()}),
        replays=MappingProxyType(replays),
        pool_of=MappingProxyType(pool_of),
        warmup_iters=warmup_iters,
    )
