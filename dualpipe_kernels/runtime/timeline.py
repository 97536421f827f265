"""Measured timeline of one pipeline step.

Each executed action becomes ``(pipeline rank, action string, start_s, end_s)``
with times in seconds (``time.perf_counter``) relative to the start of the
step: compute actions span their compute, ``RECV_*`` actions span the wait for
the data, ``SEND_*`` actions span posting the send.  This is the shape that
``dualpipe_kernels.schedules.trace`` turns into a chrome trace and that can be
laid over the simulator's timeline.  A recorder lives for one step only.

Readers of a measured timeline (benchmarks, the demo) use the helpers below:
:func:`schedule_entries` (the schedule actions, parsed), :func:`busy_time`
(compute time, receive waits left out) and :func:`measured_stage_costs` (a
step's per-stage F, B, W and F&B medians as the simulator's ``CostModel``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "TimelineEntry",
    "TimelineRecorder",
    "ParsedEntry",
    "schedule_entries",
    "busy_time",
    "MeasuredStageCosts",
    "measured_stage_costs",
    "costs_from_samples",
]

TimelineEntry = tuple[int, str, float, float]


class TimelineRecorder:
    """Collects entries for one step; a disabled recorder costs one attribute test per action."""

    def __init__(self, rank: int, enabled: bool) -> None:
        self.rank = rank
        self.enabled = enabled
        self.t0 = time.perf_counter()
        self.entries: list[TimelineEntry] = []

    def add(self, label: str, start_abs: float, end_abs: float) -> None:
        """Record a span measured with absolute ``perf_counter`` values."""
        if self.enabled:
            self.entries.append((self.rank, label, start_abs - self.t0, end_abs - self.t0))


#: ``(rank, Action, start_s, end_s)``: a timeline entry whose action string was parsed.
ParsedEntry = tuple[int, Any, float, float]


def schedule_entries(timeline: Iterable[tuple[int, Any, float, float]]) -> list[ParsedEntry]:
    """The entries of a measured timeline that are schedule actions, parsed: ``(rank, Action, start_s, end_s)``.

    The runtime also records its own bookkeeping spans (e.g. ``SYNC_MIRROR_GRADS``); they are left out.
    Entries may carry an ``Action`` or its string form.
    """
    from dualpipe_kernels.schedules.ir import parse_action

    out: list[ParsedEntry] = []
    for r, a, t0, t1 in timeline:
        if isinstance(a, str):
            try:
                a = parse_action(a)
            except ValueError:
                continue
        out.append((int(r), a, float(t0), float(t1)))
    return out


def busy_time(timeline: Iterable[tuple[int, Any, float, float]]) -> float:
    """Seconds spent computing: compute actions (F, B, I, W, F&B) minus the receive waits inside them.

    A compute action waits for its input (or output gradient) when it starts or,
    for an F&B pair, between its halves; the runtime records that wait as a
    RECV entry nested in the compute entry.  It is idle time, not compute.
    """
    entries = schedule_entries(timeline)
    total = 0.0
    by_rank: dict[int, list[tuple[float, float]]] = {}
    for r, a, t0, t1 in entries:
        if a.is_compute:
            total += t1 - t0
            by_rank.setdefault(r, []).append((t0, t1))
    for r, a, t0, t1 in entries:
        if a.is_compute or not a.type.name.startswith("RECV"):
            continue
        for c0, c1 in by_rank.get(r, ()):
            total -= max(0.0, min(t1, c1) - max(t0, c0))
    return total


@dataclass(frozen=True)
class MeasuredStageCosts:
    """Per-stage median durations (seconds) of one measured step: index = IR stage."""

    f: list[float]
    b: list[float]
    w: list[float]
    fb: list[float]

    def cost_model(self) -> Any:
        """The simulator's ``CostModel`` with these costs (F&B given: the measured pair cost)."""
        from dualpipe_kernels.schedules.costs import CostModel

        return CostModel(f=list(self.f), b=list(self.b), w=list(self.w), fb=list(self.fb))

    def as_dict(self) -> dict[str, list[float]]:
        return {"f": list(self.f), "b": list(self.b), "w": list(self.w), "fb": list(self.fb)}


def measured_stage_costs(timeline: Iterable[tuple[int, Any, float, float]], num_stages: int) -> MeasuredStageCosts:
    """Per-stage median F, B, W and F&B durations of a measured step, gaps filled so the simulator accepts them.

    B of a stage is the median full backward, or I + W when the schedule only
    splits it; W defaults to B / 2 where no W ran (it is then unused); F&B
    defaults to F + B and is clamped to [max(F, B), F + B] as the cost model
    requires.  A stage with no measured F gets a tiny positive F (1e-7 s).
    """
    from dualpipe_kernels.schedules.ir import ActionType

    by: dict[tuple[str, int], list[float]] = {}
    for _r, act, t0, t1 in schedule_entries(timeline):
        if act.is_compute:
            kind = "FB" if act.type is ActionType.OVERLAP_F_B else act.type.value
            by.setdefault((kind, act.stage), []).append(t1 - t0)
    return MeasuredStageCosts(*costs_from_samples(by, num_stages))


def costs_from_samples(
    samples: dict[tuple[str, int], list[float]], num_stages: int
) -> tuple[list[float], list[float], list[float], list[float]]:
    """Per-stage ``(f, b, w, fb)``: medians of the ``(kind, stage)`` duration samples, gaps filled as
    :func:`measured_stage_costs` documents (kinds "F", "B", "I", "W", "FB")."""

    def med(kind: str, s: int) -> float | None:
        xs = samples.get((kind, s))
        return float(statistics.median(xs)) if xs else None

    tiny = 1e-7
    f, b, w, fb = [], [], [], []
    for s in range(num_stages):
        fs = max(med("F", s) or tiny, tiny)
        ws, is_ = med("W", s), med("I", s)
        bs = max(med("B", s) or ((is_ or 0.0) + (ws or 0.0)), 2 * tiny)
        if ws is None or not 0 < ws < bs:
            ws = bs / 2
        fbs = med("FB", s) or fs + bs
        f.append(fs)
        b.append(bs)
        w.append(ws)
        fb.append(min(max(fbs, max(fs, bs)), fs + bs))
    return f, b, w, fb
