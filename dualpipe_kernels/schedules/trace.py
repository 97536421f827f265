"""Chrome-trace JSON (opens in Perfetto / chrome://tracing) for simulated or measured timelines.

One process (``pid``) per rank, two threads per process: ``tid 0`` compute and
``tid 1`` comm.  Every action is a complete event (``"ph": "X"``) named in the
torch.distributed.pipelining notation (``0F3``, ``(0F7;7B3)OVERLAP_F_B``,
``3SEND_F1``) with its kind, stage and micro-batch in ``args``.

Inputs are :class:`~dualpipe_kernels.schedules.simulator.SimEvent` lists (from
``SimResult.events``) or measured tuples ``(rank, action, start_s, end_s)``
where ``action`` is an :class:`~dualpipe_kernels.schedules.ir.Action` or its
string; both become the same events, so a measured trace and a simulated one
compare side by side (:func:`chrome_trace_compare` puts them in one file).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

from .costs import Num
from .ir import Action, parse_action
from .simulator import SimEvent, make_event

__all__ = ["TimelineEntry", "to_events", "chrome_trace", "chrome_trace_compare", "write_chrome_trace"]

#: A measured timeline entry: (rank, action or its string, start, end), times in seconds.
TimelineEntry = tuple[int, Action | str, Num, Num]
Timeline = Iterable[SimEvent | TimelineEntry]

_TID = {"compute": 0, "comm": 1}


def to_events(timeline: Timeline, stages_of_rank: Sequence[Sequence[int]] | None = None) -> list[SimEvent]:
    """Normalise a timeline to SimEvents.

    ``stages_of_rank[r]`` (optional) gives each rank's stages in order, so
    measured events get the same ``chunk`` index as simulated ones.
    """
    chunk_maps = [{s: k for k, s in enumerate(st)} for st in stages_of_rank] if stages_of_rank else None
    out: list[SimEvent] = []
    for item in timeline:
        if isinstance(item, SimEvent):
            out.append(item)
            continue
        if len(item) != 4:
            raise ValueError(f"timeline entries are (rank, action, start, end), got {item!r}")
        rank, action, t0, t1 = item
        a = parse_action(action) if isinstance(action, str) else action
        if t1 < t0:
            raise ValueError(f"timeline entry ends before it starts: {item!r}")
        out.append(make_event(int(rank), a, t0, t1, chunk_maps[rank] if chunk_maps else None))
    return out


def _trace_events(events: list[SimEvent], time_scale: float, pid_offset: int, label: str) -> list[dict[str, Any]]:
    ranks = sorted({e.rank for e in events})
    prefix = f"{label} " if label else ""
    out: list[dict[str, Any]] = []
    for r in ranks:
        pid = pid_offset + r
        out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": f"{prefix}rank {r}"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        for track, tid in _TID.items():
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": track}})
    for e in events:
        args: dict[str, Any] = {"kind": e.kind, "stage": e.stage, "microbatch": e.microbatch}
        if e.peer is not None:
            args["peer"] = e.peer
        if e.stage2 is not None:
            args["backward_stage"] = e.stage2
            args["backward_microbatch"] = e.microbatch2
        out.append(
            {
                "ph": "X",
                "name": e.action,
                "cat": e.kind,
                "pid": pid_offset + e.rank,
                "tid": _TID[e.track],
                "ts": float(e.start) * time_scale,
                "dur": float(e.end - e.start) * time_scale,
                "args": args,
            }
        )
    return out


def chrome_trace(timeline: Timeline, time_scale: float = 1e6, label: str = "", **metadata: Any) -> dict[str, Any]:
    """Trace dict for one timeline.

    ``time_scale``: trace microseconds per time unit (1e6 for seconds).  Keyword
    ``metadata`` (schedule name, costs...) goes to the format's ``otherData``.
    """
    events = to_events(timeline)
    return {"traceEvents": _trace_events(events, time_scale, 0, label), "displayTimeUnit": "ms", "otherData": metadata}


def chrome_trace_compare(
    simulated: Timeline, measured: Timeline, time_scale: float = 1e6, **metadata: Any
) -> dict[str, Any]:
    """One trace with the simulated ranks first, then the measured ranks (pids offset past them)."""
    sim = to_events(simulated)
    meas = to_events(measured)
    offset = 1 + max((e.rank for e in sim), default=-1)
    events = _trace_events(sim, time_scale, 0, "simulated") + _trace_events(meas, time_scale, offset, "measured")
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": metadata}


def write_chrome_trace(
    path: str | os.PathLike[str],
    timeline: Timeline,
    time_scale: float = 1e6,
    measured: Timeline | None = None,
    **metadata: Any,
) -> None:
    """Write ``timeline`` (and, if given, a ``measured`` one alongside it) as chrome-trace JSON."""
    if measured is None:
        trace = chrome_trace(timeline, time_scale, **metadata)
    else:
        trace = chrome_trace_compare(timeline, measured, time_scale, **metadata)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(trace, fh)
