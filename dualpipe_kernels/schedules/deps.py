"""Data dependencies between compute actions: the one rule set shared by the
validator, the lowering pass, the simulator and the runtime.

Two kinds of data flow along a micro-batch's path of stages:

* ``ACT``: the activation a stage's F produces for ``(stage, mb)``;
* ``GRAD``: the input gradient a stage's B (or I) produces for ``(stage, mb)``.

Rules (``prev``/``next`` along the micro-batch's path):

* ``F(s, m)`` needs ``ACT(prev(s, m), m)`` (nothing on the path's first stage);
* ``B(s, m)`` / ``I(s, m)`` need ``ACT(s, m)`` and, unless ``s`` is the loss
  stage of ``m``, ``GRAD(next(s, m), m)``;
* ``W(s, m)`` needs ``GRAD(s, m)`` (its own I; the validator checks it is an I).

An ``OVERLAP_F_B`` pair needs the union of its halves' needs.  A dependency is
*cross-rank* when its producing stage lives on another rank: that is where the
lowering pass puts a SEND/RECV pair (and where the simulator adds a transfer).

:class:`Topology` precomputes next/prev tables so every lookup is O(1); the
methods on :class:`~dualpipe_kernels.schedules.ir.Schedule` scan the path and
are fine for one-off use but not for 10^6 actions.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

from .ir import Action, ActionType, Schedule

__all__ = ["DepKind", "Dep", "Topology", "dependency_keys", "produced_keys", "dependencies"]


class DepKind(enum.IntEnum):
    ACT = 0  # activation of (stage, mb), produced by F
    GRAD = 1  # input gradient of (stage, mb), produced by B or I


class Dep(NamedTuple):
    """One piece of data: ``kind`` of ``(stage, microbatch)``, produced on ``stage``'s rank."""

    kind: DepKind
    stage: int
    microbatch: int


_NONE = -1


class Topology:
    """O(1) path lookups for one schedule (tables of size paths x stages).

    ``next[p][s]`` / ``prev[p][s]`` are the stage after / before ``s`` on path
    ``p`` (``-1`` at the ends, and for a stage not on the path: ``on_path``
    tells them apart).
    """

    __slots__ = (
        "num_stages",
        "num_microbatches",
        "stage_to_rank",
        "mb_path",
        "next",
        "prev",
        "on_path",
        "first",
        "last",
    )

    def __init__(self, schedule: Schedule) -> None:
        S = schedule.num_stages
        self.num_stages = S
        self.num_microbatches = schedule.num_microbatches
        self.stage_to_rank = schedule.stage_to_rank
        self.mb_path = schedule.microbatch_path
        self.next: list[list[int]] = []
        self.prev: list[list[int]] = []
        self.on_path: list[list[bool]] = []
        self.first: list[int] = []
        self.last: list[int] = []
        for p, path in enumerate(schedule.paths):
            if not path:
                raise ValueError(f"path {p} is empty")
            if len(set(path)) != len(path):
                raise ValueError(f"path {p} visits a stage twice: {path}")
            nxt = [_NONE] * S
            prv = [_NONE] * S
            on = [False] * S
            for i, s in enumerate(path):
                if not 0 <= s < S:
                    raise ValueError(f"path {p} names stage {s}, but there are {S} stages")
                on[s] = True
                if i + 1 < len(path):
                    nxt[s] = path[i + 1]
                if i > 0:
                    prv[s] = path[i - 1]
            self.next.append(nxt)
            self.prev.append(prv)
            self.on_path.append(on)
            self.first.append(path[0])
            self.last.append(path[-1])

    def next_stage(self, stage: int, mb: int) -> int | None:
        n = self.next[self.mb_path[mb]][stage]
        return None if n == _NONE else n

    def prev_stage(self, stage: int, mb: int) -> int | None:
        p = self.prev[self.mb_path[mb]][stage]
        return None if p == _NONE else p

    def is_loss_stage(self, stage: int, mb: int) -> bool:
        return self.last[self.mb_path[mb]] == stage

    def is_first_stage(self, stage: int, mb: int) -> bool:
        return self.first[self.mb_path[mb]] == stage

    def stage_on_path(self, stage: int, mb: int) -> bool:
        return 0 <= stage < self.num_stages and self.on_path[self.mb_path[mb]][stage]

    # ---- integer keys: kind * S * N + stage * N + mb (hot loops) -----------
    def key(self, kind: DepKind, stage: int, mb: int) -> int:
        return (int(kind) * self.num_stages + stage) * self.num_microbatches + mb

    def unkey(self, key: int) -> Dep:
        N, S = self.num_microbatches, self.num_stages
        kind, rest = divmod(key, S * N)
        return Dep(DepKind(kind), rest // N, rest % N)


def dependency_keys(topo: Topology, action: Action) -> list[Dep]:
    """The data ``action`` needs before it can start (see the module docstring).

    For an OVERLAP_F_B pair: the needs of both halves.  Comm actions need nothing
    here (their ordering is the lowering pass's business).
    """
    t = action.type
    s, m = action.stage, action.microbatch
    if t is ActionType.F:
        p = topo.prev[topo.mb_path[m]][s]
        return [] if p == _NONE else [Dep(DepKind.ACT, p, m)]
    if t is ActionType.B or t is ActionType.I:
        n = topo.next[topo.mb_path[m]][s]
        out = [Dep(DepKind.ACT, s, m)]
        if n != _NONE:
            out.append(Dep(DepKind.GRAD, n, m))
        return out
    if t is ActionType.W:
        return [Dep(DepKind.GRAD, s, m)]
    if t is ActionType.OVERLAP_F_B:
        return dependency_keys(topo, action.sub_actions[0]) + dependency_keys(topo, action.sub_actions[1])
    return []


def produced_keys(action: Action) -> list[Dep]:
    """The data ``action`` makes available when it finishes (W produces nothing others read)."""
    t = action.type
    if t is ActionType.F:
        return [Dep(DepKind.ACT, action.stage, action.microbatch)]
    if t is ActionType.B or t is ActionType.I:
        return [Dep(DepKind.GRAD, action.stage, action.microbatch)]
    if t is ActionType.OVERLAP_F_B:
        return produced_keys(action.sub_actions[0]) + produced_keys(action.sub_actions[1])
    return []


def dependencies(schedule: Schedule, action: Action) -> list[Action]:
    """The compute actions ``action`` depends on, as actions (``F``, ``B``/``I``).

    Whether a gradient comes from a B or an I is read from the owning rank's
    list, so one call costs O(that list): use :func:`dependency_keys` with a
    :class:`Topology` in loops.
    """
    topo = Topology(schedule)
    out: list[Action] = []
    for dep in dependency_keys(topo, action):
        if dep.kind is DepKind.ACT:
            out.append(Action(ActionType.F, dep.stage, dep.microbatch))
            continue
        kind = ActionType.B
        for a in schedule.actions[schedule.stage_to_rank[dep.stage]]:
            for c in a.computes():
                if c.type in (ActionType.B, ActionType.I) and c.stage == dep.stage and c.microbatch == dep.microbatch:
                    kind = c.type
        out.append(Action(kind, dep.stage, dep.microbatch))
    return out
