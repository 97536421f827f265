"""What a simulation returns: per-action events and the step's figures (see :mod:`.simulator`)."""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from .costs import Num
from .ir import T_PAIR, Action, Schedule

__all__ = ["SimEvent", "SimResult", "Timeline", "action_kind", "make_event", "chunk_maps"]

COMPUTE_KINDS = ("F", "B", "I", "W", "F&B")
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


def chunk_maps(schedule: Schedule) -> list[dict[int, int]]:
    """Per rank: stage -> its index among the rank's stages (one pass over the placement: O(stages))."""
    maps: list[dict[int, int]] = [{} for _ in range(schedule.num_ranks)]
    for s, r in enumerate(schedule.stage_to_rank):
        maps[r][s] = len(maps[r])
    return maps


def action_kind(action: Action) -> str:
    """Kind label of an action: F, B, I, W, F&B, SEND_F, RECV_F, SEND_B or RECV_B."""
    return "F&B" if action.type is T_PAIR else action.type.value


@dataclass(frozen=True, slots=True)
class SimEvent:
    """One action's interval on a rank (simulated or measured).

    ``track`` is ``"compute"`` or ``"comm"``.  For a SEND the interval is the
    transfer (link start to arrival); for a RECV it is the wait (posted to
    data available).  For an F&B pair ``stage``/``microbatch`` are the F half's
    and ``stage2``/``microbatch2`` the backward half's.  ``chunk`` is the index
    of ``stage`` among the rank's stages (0 for single-chunk schedules); plots
    shade by it.
    """

    rank: int
    action: str
    kind: str
    start: Num
    end: Num
    stage: int
    microbatch: int
    track: str = "compute"
    peer: int | None = None
    stage2: int | None = None
    microbatch2: int | None = None
    chunk: int = 0
    backward_kind: str | None = None  # "B" or "I" for an F&B pair
    chunk2: int = 0  # chunk index of the F&B pair's backward stage

    @property
    def duration(self) -> Num:
        return self.end - self.start


def make_event(rank: int, action: Action, start: Num, end: Num, chunk_of: dict[int, int] | None = None) -> SimEvent:
    """Build the event of one action (shared by the simulator and measured timelines).

    ``chunk_of`` maps the rank's stages to their chunk index (for shading).
    """
    chunks = chunk_of or {}
    if action.type is T_PAIR:
        f, b = action.sub_actions
        return SimEvent(
            rank=rank,
            action=str(action),
            start=start,
            end=end,
            kind="F&B",
            stage=f.stage,
            microbatch=f.microbatch,
            stage2=b.stage,
            microbatch2=b.microbatch,
            chunk=chunks.get(f.stage, 0),
            chunk2=chunks.get(b.stage, 0),
            backward_kind=b.type.value,
        )
    return SimEvent(
        rank=rank,
        action=str(action),
        start=start,
        end=end,
        kind=action.type.value,
        stage=action.stage,
        microbatch=action.microbatch,
        track="comm" if action.is_comm else "compute",
        peer=action.peer,
        chunk=chunks.get(action.stage, 0),
    )


@dataclass
class Timeline:
    """Per-action times of a lowered schedule; ``gid = offsets[rank] + step``."""

    schedule: Schedule
    start: list[Num]
    end: list[Num]
    offsets: list[int]
    critical: list[int]

    def event(self, gid: int, chunk_maps: list[dict[int, int]]) -> SimEvent:
        r = bisect.bisect_right(self.offsets, gid) - 1
        a = self.schedule.actions[r][gid - self.offsets[r]]
        return make_event(r, a, self.start[gid], self.end[gid], chunk_maps[r])

    def critical_labels(self) -> list[str]:
        """The critical path as labels: a compute's action, ``rank:action`` for a comm action (no events built)."""
        out = []
        offsets, acts = self.offsets, self.schedule.actions
        for gid in self.critical:
            r = bisect.bisect_right(offsets, gid) - 1
            a = acts[r][gid - offsets[r]]
            out.append(str(a) if a.is_compute else f"{r}:{a}")
        return out


@dataclass
class SimResult:
    """Outcome of :func:`simulate`.  See the module docstring for definitions."""

    schedule: str
    ranks: int
    stages: int
    microbatches: int
    makespan: Num
    busy_per_rank: list[Num]
    idle_per_rank: list[Num]
    bubble: Num
    bubble_per_rank: list[Num]
    bubble_ratio: float
    idle_ratio: float
    peak_activations: int
    peak_activations_per_rank: list[int]
    params_per_rank: int
    params_by_rank: list[int]
    p2p_bytes: Num
    num_transfers: int
    comm_blocked_per_rank: list[Num]
    blocking_comm: bool
    _timeline: Timeline | None = field(default=None, repr=False)
    _replay: Callable[[], SimResult] | None = field(default=None, repr=False)

    def lowered_result(self) -> SimResult:
        """This result as the lowered engine computes it, with every event (self when it already has them).

        The numbers are identical (tests check it); only the event timeline is added.
        """
        if self._timeline is not None:
            return self
        if self._replay is None:
            raise RuntimeError("a SimResult without a timeline must carry its replay")
        return self._replay()

    @property
    def _events_source(self) -> Timeline:
        if self._timeline is None:
            self._timeline = self.lowered_result()._timeline
        if self._timeline is None:
            raise RuntimeError("the lowered engine returned no timeline")
        return self._timeline

    def _chunk_maps(self) -> list[dict[int, int]]:
        return chunk_maps(self._events_source.schedule)

    @cached_property
    def events(self) -> list[SimEvent]:
        """Every action's interval, rank by rank in lowered-list order (built on first use)."""
        tl, maps = self._events_source, self._chunk_maps()
        return [tl.event(g, maps) for g in range(len(tl.start))]

    @cached_property
    def critical_path(self) -> list[SimEvent]:
        """Events from time 0 to the makespan, each ready when the previous ends (module docstring)."""
        tl, maps = self._events_source, self._chunk_maps()
        return [tl.event(g, maps) for g in tl.critical]

    @property
    def lowered_schedule(self) -> Schedule:
        """The lowered schedule whose events these are."""
        return self._events_source.schedule

    def to_dict(self, events: bool = False, critical_path: bool = True) -> dict[str, Any]:
        """JSON-ready dict (exact ints stay ints); ``events=True`` adds every event."""

        def num(x: Num) -> float | int:
            return x if isinstance(x, int) else float(x)

        d: dict[str, Any] = {
            "schedule": self.schedule,
            "ranks": self.ranks,
            "stages": self.stages,
            "microbatches": self.microbatches,
            "makespan": num(self.makespan),
            "bubble": num(self.bubble),
            "bubble_per_rank": [num(x) for x in self.bubble_per_rank],
            "bubble_ratio": float(self.bubble_ratio),
            "idle_ratio": float(self.idle_ratio),
            "busy_per_rank": [num(x) for x in self.busy_per_rank],
            "idle_per_rank": [num(x) for x in self.idle_per_rank],
            "peak_activations": self.peak_activations,
            "peak_activations_per_rank": list(self.peak_activations_per_rank),
            "params_per_rank": self.params_per_rank,
            "params_by_rank": list(self.params_by_rank),
            "p2p_bytes": num(self.p2p_bytes),
            "num_transfers": self.num_transfers,
            "comm_blocked_per_rank": [num(x) for x in self.comm_blocked_per_rank],
            "blocking_comm": self.blocking_comm,
        }
        if critical_path:
            d["critical_path"] = self._events_source.critical_labels()
        if events:
            d["events"] = [
                {"rank": e.rank, "action": e.action, "kind": e.kind, "start": num(e.start), "end": num(e.end)}
                for e in self.events
            ]
        return d
