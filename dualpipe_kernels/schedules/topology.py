"""Where data flows in one schedule: the data kinds, the path tables and the key encoding.

:class:`Topology` gives O(1) path lookups (which stage comes before / after a
stage on a micro-batch's path) and the one integer encoding of data used by
the dependency program (:mod:`.deps`): ``key = (kind * S + stage) * N + mb``.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

from .ir import T_RECV_B, T_RECV_F, T_SEND_B, T_SEND_F, Action, ActionType, Schedule

__all__ = ["DepKind", "NUM_KINDS", "Dep", "NO_STAGE", "TRANSFER", "COMM_KIND", "Topology"]


class DepKind(enum.IntEnum):
    ACT = 0  # activation of (stage, mb), produced by F
    GRAD = 1  # input gradient of (stage, mb), produced by B or I
    WPEND = 2  # weight-gradient work of (stage, mb) an I defers to its W
    WDONE = 3  # weight gradient of (stage, mb) accumulated by W


NUM_KINDS = len(DepKind)


class Dep(NamedTuple):
    """One piece of data: ``kind`` of ``(stage, microbatch)``, produced on ``stage``'s rank."""

    kind: DepKind
    stage: int
    microbatch: int


NO_STAGE = -1
"""A table entry for no stage: a path end, or a stage not on the path."""


TRANSFER: dict[DepKind, tuple[ActionType, ActionType]] = {
    DepKind.ACT: (T_SEND_F, T_RECV_F),
    DepKind.GRAD: (T_SEND_B, T_RECV_B),
}
"""Kind of data -> the (SEND, RECV) comm types that move it between ranks."""

COMM_KIND = {send: (kind, True) for kind, (send, _) in TRANSFER.items()} | {
    recv: (kind, False) for kind, (_, recv) in TRANSFER.items()
}
"""Comm type -> (the kind of data it moves, whether it is the SEND)."""


class Topology:
    """O(1) path lookups for one schedule (tables of size paths x stages), and the key encoding.

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
            nxt = [NO_STAGE] * S
            prv = [NO_STAGE] * S
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
        return None if n == NO_STAGE else n

    def prev_stage(self, stage: int, mb: int) -> int | None:
        p = self.prev[self.mb_path[mb]][stage]
        return None if p == NO_STAGE else p

    def is_loss_stage(self, stage: int, mb: int) -> bool:
        return self.last[self.mb_path[mb]] == stage

    def is_first_stage(self, stage: int, mb: int) -> bool:
        return self.first[self.mb_path[mb]] == stage

    def stage_on_path(self, stage: int, mb: int) -> bool:
        return 0 <= stage < self.num_stages and self.on_path[self.mb_path[mb]][stage]

    # ---- the one key encoding: (kind * S + stage) * N + mb ------------------
    @property
    def num_keys(self) -> int:
        return NUM_KINDS * self.num_stages * self.num_microbatches

    def chunk(self, stage: int, mb: int) -> int:
        """Index of ``(stage, mb)`` in ``0 .. S*N-1``: a key is ``kind * S * N + chunk``."""
        return stage * self.num_microbatches + mb

    def key(self, kind: DepKind | int, stage: int, mb: int) -> int:
        return int(kind) * self.num_stages * self.num_microbatches + self.chunk(stage, mb)

    def unkey(self, key: int) -> Dep:
        N, S = self.num_microbatches, self.num_stages
        kind, rest = divmod(key, S * N)
        return Dep(DepKind(kind), rest // N, rest % N)

    def key_rank(self, key: int) -> int:
        """The rank that produces the data ``key``."""
        return self.stage_to_rank[(key % (self.num_stages * self.num_microbatches)) // self.num_microbatches]

    def describe(self, key: int) -> str:
        d = self.unkey(key)
        what = {DepKind.ACT: "activation", DepKind.GRAD: "input gradient"}.get(d.kind, d.kind.name)
        return f"the {what} of stage {d.stage}, micro-batch {d.microbatch}"

    def flow(self, kind: DepKind, path: int, stage: int, towards_consumer: bool) -> int:
        """The stage a transfer of ``kind`` made on (or read by) ``stage`` goes to (comes from); -1: none."""
        return self.flow_table(kind, towards_consumer)[path][stage]

    def consumer(self, kind: DepKind, stage: int, mb: int) -> int:
        """The stage that reads ``kind`` of ``(stage, mb)`` across the path (-1: none, the path ends)."""
        return self.flow_table(kind, True)[self.mb_path[mb]][stage]

    def comm_other_stage(self, action: Action) -> int:
        """The stage at the other end of comm ``action`` (-1 at a path end); a SEND's stage makes, a RECV's reads."""
        kind, is_send = COMM_KIND[action.type]
        return self.flow(kind, self.mb_path[action.microbatch], action.stage, towards_consumer=is_send)

    def flow_table(self, kind: DepKind | int, towards_consumer: bool) -> list[list[int]]:
        """``next`` or ``prev``: activations flow along the path, gradients against it."""
        forward = (kind == DepKind.ACT) == towards_consumer
        return self.next if forward else self.prev
