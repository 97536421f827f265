"""Discrete-event simulator for lowered schedules.

The simulator runs the same lowered action lists the runtime executes (compute
plus SEND/RECV, see ``schedules.lowering``), so a measured timeline can be laid
over the simulated one.  Semantics:

* A rank executes its list strictly in order; a compute action starts when the
  rank is free and takes its cost (``CostModel``).
* SEND: the transfer starts when the rank reaches it and the directed link
  ``src -> dst`` is free; it occupies the link for ``bytes / bandwidth`` and
  arrives ``latency`` later (``CommModel``).  Async mode: the rank goes on at
  once.  Blocking mode: the rank is busy until the transfer arrives.
* RECV: the rank waits until the matching SEND's data has arrived.

Because a directed link only carries its source rank's sends, and a rank posts
them in list order, link FIFO order equals list order; the simulation is then a
single pass over the actions (each visited once, ranks woken when the data they
wait on is produced), O(actions) time and memory.

Two engines give identical numbers (tests check it on every generator):
``simulate`` on a lowered schedule walks its comm actions and records every
event; on a compute-only schedule it applies the lowering's rules inline
(receives right before the consuming compute, sends right after the producing
one, F half before B half in a pair) without building comm actions, about 3x
faster, and replays the lowered schedule only when events or the critical path
are asked for.

Reported figures (all in the cost model's time unit; activations and
parameters in units of one stage chunk, one micro-batch):

* ``busy_per_rank``: time spent computing; ``idle_per_rank = makespan - busy``
  (waiting for data, blocked in a blocking send, or done early).
* ``bubble_per_rank`` = ``idle_per_rank``; ``bubble`` = its maximum over ranks
  (DESIGN.md's reference table); ``bubble_ratio = bubble / makespan``, the share
  of the step the most idle rank spends not computing; ``idle_ratio`` = total
  idle / (ranks x makespan), the share of all device time lost.
* ``peak_activations_per_rank``: most chunk activations alive at once on a
  rank, counted in execution order: F adds one, B or I frees one, and an F&B
  pair counts its F before its backward frees.
* ``params_per_rank``: most stage chunks held by one rank.
* ``critical_path``: a chain of events from time 0 to the makespan, each one
  ready when the previous one ends (a RECV completes then; a compute or SEND
  starts then), except a SEND queued behind the previous SEND on its link,
  which starts when that one leaves the link (before its arrival).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from numbers import Real
from typing import Any

from .costs import CommModel, CostModel, Num, StageCosts
from .ir import Action, ActionType, Schedule

__all__ = ["SimEvent", "SimResult", "simulate", "action_kind", "make_event", "reference_bubble"]

_F, _B, _I, _W, _FB = ActionType.F, ActionType.B, ActionType.I, ActionType.W, ActionType.OVERLAP_F_B
_SEND_F, _RECV_F, _SEND_B, _RECV_B = ActionType.SEND_F, ActionType.RECV_F, ActionType.SEND_B, ActionType.RECV_B

COMPUTE_KINDS = ("F", "B", "I", "W", "F&B")
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")


def action_kind(action: Action) -> str:
    """Kind label of an action: F, B, I, W, F&B, SEND_F, RECV_F, SEND_B or RECV_B."""
    return "F&B" if action.type is _FB else action.type.value


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
    if action.type is _FB:
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
class _Timeline:
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
    _timeline: _Timeline | None = field(default=None, repr=False)
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
    def _events_source(self) -> _Timeline:
        if self._timeline is None:
            self._timeline = self.lowered_result()._timeline
        if self._timeline is None:
            raise RuntimeError("the lowered engine returned no timeline")
        return self._timeline

    def _chunk_maps(self) -> list[dict[int, int]]:
        sched = self._events_source.schedule
        return [{s: k for k, s in enumerate(sched.stages_of_rank(r))} for r in range(self.ranks)]

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
            d["critical_path"] = [
                e.action if e.track == "compute" else f"{e.rank}:{e.action}" for e in self.critical_path
            ]
        if events:
            d["events"] = [
                {"rank": e.rank, "action": e.action, "kind": e.kind, "start": num(e.start), "end": num(e.end)}
                for e in self.events
            ]
        return d


def _neighbour_tables(schedule: Schedule) -> tuple[list[list[int]], list[list[int]]]:
    """Per path: next stage and previous stage of every stage (-1 where none)."""
    s_count = schedule.num_stages
    nxt, prv = [], []
    for path in schedule.paths:
        n, p = [-1] * s_count, [-1] * s_count
        for k in range(len(path) - 1):
            n[path[k]] = path[k + 1]
            p[path[k + 1]] = path[k]
        nxt.append(n)
        prv.append(p)
    return nxt, prv


def simulate(schedule: Schedule, costs: CostModel | None = None, comm: CommModel | None = None) -> SimResult:
    """Simulate ``schedule`` (compute-only or lowered) under ``costs`` and ``comm``.

    Raises ValueError for invalid costs (naming the constraint) and for a
    schedule that deadlocks (naming each stuck rank, step and action).
    """
    costs = costs or CostModel()
    comm = comm or CommModel()
    sc = costs.resolve(schedule)
    if schedule.lowered:
        return _run_lowered(schedule, sc, comm)

    def replay() -> SimResult:
        from .lowering import lower_comms  # only needed for the event timeline

        return _run_lowered(lower_comms(schedule), sc, comm)

    return _run_direct(schedule, sc, comm, replay)


class _Links:
    """Directed links ``src -> dst``: when each is free again, and its transfer cost (cached)."""

    __slots__ = ("comm", "free", "last", "cost")

    def __init__(self, comm: CommModel, n_ranks: int) -> None:
        self.comm = comm
        self.free: list[dict[int, Num]] = [{} for _ in range(n_ranks)]
        self.last: list[dict[int, int]] = [{} for _ in range(n_ranks)]  # gid of the link's latest send
        self.cost: dict[tuple[int, int], tuple[Num, Num]] = {}

    def send(self, src: int, dst: int, t: Num, gid: int = -1) -> tuple[Num, Num, int]:
        """Post a transfer at ``t``: (link start, arrival, gid of the send it queued behind or -1)."""
        c = self.cost.get((src, dst))
        if c is None:
            c = self.cost[(src, dst)] = self.comm.link_time(src, dst)
        free = self.free[src].get(dst, 0)
        behind = -1
        if free > t:
            t, behind = free, self.last[src].get(dst, -1)
        self.free[src][dst] = t + c[0]
        self.last[src][dst] = gid
        return t, t + c[0] + c[1], behind


def _result(
    sched: Schedule,
    comm: CommModel,
    makespan: Num,
    busy: list[Num],
    blocked: list[Num],
    peak: list[int],
    n_sends: int,
    timeline: _Timeline | None,
    replay: Callable[[], SimResult] | None,
) -> SimResult:
    n_ranks = sched.num_ranks
    idle = [makespan - b for b in busy]
    bubble = max(idle) if idle else 0
    params = [len(sched.stages_of_rank(r)) for r in range(n_ranks)]
    return SimResult(
        schedule=sched.name,
        ranks=n_ranks,
        stages=sched.num_stages,
        microbatches=sched.num_microbatches,
        makespan=makespan,
        busy_per_rank=busy,
        idle_per_rank=idle,
        bubble=bubble,
        bubble_per_rank=list(idle),
        bubble_ratio=float(bubble / makespan) if makespan else 0.0,
        idle_ratio=float(sum(idle) / (n_ranks * makespan)) if makespan else 0.0,
        peak_activations=max(peak) if peak else 0,
        peak_activations_per_rank=peak,
        params_per_rank=max(params) if params else 0,
        params_by_rank=params,
        p2p_bytes=n_sends * comm.activation_bytes,
        num_transfers=n_sends,
        comm_blocked_per_rank=blocked,
        blocking_comm=comm.blocking,
        _timeline=timeline,
        _replay=replay,
    )


def _deadlock(sched: Schedule, pos: list[int]) -> None:
    stuck = [r for r in range(sched.num_ranks) if pos[r] < len(sched.actions[r])]
    if stuck:
        where = "; ".join(f"rank {r} step {pos[r]} waits at {sched.actions[r][pos[r]]}" for r in stuck)
        raise ValueError(f"schedule {sched.name!r} deadlocks: {where}")


def _run_lowered(sched: Schedule, sc: StageCosts, comm: CommModel) -> SimResult:
    """Walk the lowered lists, recording every action's start and end."""
    fc, bc, wc, ic, pair_cost = sc.f, sc.b, sc.w, sc.i, sc.pair
    n_ranks, n_mb = sched.num_ranks, sched.num_microbatches
    acts = sched.actions
    offsets = [0] * (n_ranks + 1)
    for r in range(n_ranks):
        offsets[r + 1] = offsets[r] + len(acts[r])
    total = offsets[n_ranks]
    start: list[Num] = [0] * total
    end: list[Num] = [0] * total
    pred = [-1] * total  # the event whose end made this one ready (critical path)

    nxt, prv = _neighbour_tables(sched)
    mb_path = sched.microbatch_path
    s2r = sched.stage_to_rank
    blocking = comm.blocking
    links = _Links(comm, n_ranks)

    clock: list[Num] = [0] * n_ranks
    pos = [0] * n_ranks
    last = [-1] * n_ranks  # gid of the event that set each rank's clock
    busy: list[Num] = [0] * n_ranks
    blocked: list[Num] = [0] * n_ranks
    live = [0] * n_ranks
    peak = [0] * n_ranks
    # transfer key ((receiving stage * N + mb) * 2 + is_grad) -> (arrival time, send gid)
    arrivals: list[tuple[Num, int] | None] = [None] * (2 * sched.num_stages * n_mb)
    waiting: dict[int, int] = {}  # transfer key -> rank blocked on it
    n_sends = 0
    ready = list(range(n_ranks - 1, -1, -1))

    while ready:
        r = ready.pop()
        ra = acts[r]
        n = len(ra)
        p, t, lg, base = pos[r], clock[r], last[r], offsets[r]
        bsy, lv, pk = busy[r], live[r], peak[r]
        while p < n:
            a = ra[p]
            g = base + p
            ty = a.type
            if ty is _F:
                d = fc[a.stage]
                lv += 1
                if lv > pk:
                    pk = lv
            elif ty is _FB:
                fa, ba = a.sub_actions
                d = pair_cost(fa.stage, ba.stage, ba.type is _B)
                if lv + 1 > pk:  # the F counts before the backward frees
                    pk = lv + 1
            elif ty is _B:
                d = bc[a.stage]
                lv -= 1
            elif ty is _I:
                d = ic[a.stage]
                lv -= 1
            elif ty is _W:
                d = wc[a.stage]
            elif ty is _RECV_F or ty is _RECV_B:
                key = ((a.stage * n_mb + a.microbatch) << 1) | (ty is _RECV_B)
                got = arrivals[key]
                if got is None:
                    waiting[key] = r
                    break
                arr, sg = got
                start[g] = t
                if arr >= t:  # the data, not the rank, was last: the critical path crosses ranks
                    t = arr
                    pred[g] = sg
                else:
                    pred[g] = lg
                end[g] = t
                lg = g
                p += 1
                continue
            else:  # SEND_F / SEND_B
                s, m = a.stage, a.microbatch
                fwd = ty is _SEND_F
                rs = (nxt if fwd else prv)[mb_path[m]][s]
                if rs < 0:
                    raise ValueError(f"rank {r} step {p}: {a} has no receiving stage for micro-batch {m}")
                dst = a.peer if a.peer is not None else s2r[rs]
                s0, arr, behind = links.send(r, dst, t, g)
                start[g], end[g] = s0, arr
                pred[g] = lg if behind < 0 else behind
                n_sends += 1
                if blocking:
                    blocked[r] += arr - t
                    t = arr
                    lg = g
                key = ((rs * n_mb + m) << 1) | (not fwd)
                arrivals[key] = (arr, g)
                w = waiting.pop(key, None)
                if w is not None:
                    ready.append(w)
                p += 1
                continue
            # compute action
            start[g] = t
            pred[g] = lg
            t += d
            end[g] = t
            bsy += d
            lg = g
            p += 1
        pos[r], clock[r], last[r], busy[r] = p, t, lg, bsy
        live[r], peak[r] = lv, pk

    _deadlock(sched, pos)
    crit_end = max(range(total), key=end.__getitem__) if total else -1
    makespan: Num = end[crit_end] if total else 0
    critical: list[int] = []
    g = crit_end
    while g >= 0:
        critical.append(g)
        g = pred[g]
    critical.reverse()
    tl = _Timeline(sched, start, end, offsets, critical)
    return _result(sched, comm, makespan, busy, blocked, peak, n_sends, tl, None)


def _cross_tables(sched: Schedule) -> tuple[list[list[int]], ...]:
    """Per path and stage: the stage across a rank boundary in each direction, or -1.

    ``src_f``: where an F's input comes from; ``dst_f``: where its output goes;
    ``src_b``/``dst_b`` the same for a backward's gradient.  -1 where the
    neighbour is missing or on the same rank (no transfer, the order suffices).
    """
    nxt, prv = _neighbour_tables(sched)
    s2r = sched.stage_to_rank

    def cross(table: list[int]) -> list[int]:
        return [o if o >= 0 and s2r[o] != s2r[s] else -1 for s, o in enumerate(table)]

    return [cross(t) for t in prv], [cross(t) for t in nxt], [cross(t) for t in nxt], [cross(t) for t in prv]


def _run_direct(sched: Schedule, sc: StageCosts, comm: CommModel, replay: Callable[[], SimResult]) -> SimResult:
    """Simulate a compute-only schedule with the lowering's comm rules applied inline (no timeline kept).

    Hot loop: tables replace every per-action lookup that can be precomputed,
    and the plain F / B / I sends are written out rather than called.
    """
    fc, bc, wc, ic, pair_cost = sc.f, sc.b, sc.w, sc.i, sc.pair
    n_ranks, n_mb = sched.num_ranks, sched.num_microbatches
    acts = sched.actions
    src_f, dst_f, src_b, dst_b = _cross_tables(sched)
    mb_path = sched.microbatch_path
    s2r = sched.stage_to_rank
    blocking = comm.blocking
    instant = comm.is_free and not blocking  # every transfer arrives when it is posted
    # Per source rank, per destination rank: when the link is free again, its occupancy and latency.
    link_free: list[dict[int, Num]] = [{} for _ in range(n_ranks)]
    link_occ: list[dict[int, Num]] = [{} for _ in range(n_ranks)]
    link_lat: list[dict[int, Num]] = [{} for _ in range(n_ranks)]
    for tables in (dst_f, dst_b):
        for table in tables:
            for s, o in enumerate(table):
                if o >= 0:
                    src, dst = s2r[s], s2r[o]
                    link_free[src][dst] = 0
                    link_occ[src][dst], link_lat[src][dst] = comm.link_time(src, dst)
    # Key of the data a stage produces: ((stage * N + mb) * 2 + is_grad); value: arrival at its remote consumer.
    arrivals: list[Num | None] = [None] * (2 * sched.num_stages * n_mb)
    waiting: dict[int, int] = {}
    clock: list[Num] = [0] * n_ranks
    pos = [0] * n_ranks
    busy: list[Num] = [0] * n_ranks
    blocked: list[Num] = [0] * n_ranks
    live = [0] * n_ranks
    peak = [0] * n_ranks
    n_sends = 0
    ready = list(range(n_ranks - 1, -1, -1))

    def post(r: int, dst: int, key: int, t: Num) -> Num:
        """Post one transfer from rank ``r`` at ``t``; returns the rank's clock afterwards."""
        nonlocal n_sends
        n_sends += 1
        if instant:
            arr = t
        else:
            start = link_free[r][dst]
            if start < t:
                start = t
            start += link_occ[r][dst]
            link_free[r][dst] = start
            arr = start + link_lat[r][dst]
        arrivals[key] = arr
        w = waiting.pop(key, None)
        if w is not None:
            ready.append(w)
        if blocking:
            blocked[r] += arr - t
            return arr
        return t

    def pair(r: int, a: Action, t: Num) -> Num | None:
        """Run an F&B pair at ``t`` (its receives, compute, sends); None when an input is missing."""
        fa, ba = a.sub_actions
        pf, pb = mb_path[fa.microbatch], mb_path[ba.microbatch]
        o = src_f[pf][fa.stage]
        k1 = (o * n_mb + fa.microbatch) << 1 if o >= 0 else -1
        o = src_b[pb][ba.stage]
        k2 = ((o * n_mb + ba.microbatch) << 1) | 1 if o >= 0 else -1
        x1 = arrivals[k1] if k1 >= 0 else t
        x2 = arrivals[k2] if k2 >= 0 else t
        if x1 is None or x2 is None:
            waiting[k1 if x1 is None else k2] = r
            return None
        t = max(t, x1, x2) + pair_cost(fa.stage, ba.stage, ba.type is _B)
        o = dst_f[pf][fa.stage]
        if o >= 0:
            t = post(r, s2r[o], (fa.stage * n_mb + fa.microbatch) << 1, t)
        o = dst_b[pb][ba.stage]
        if o >= 0:
            t = post(r, s2r[o], ((ba.stage * n_mb + ba.microbatch) << 1) | 1, t)
        return t

    while ready:
        r = ready.pop()
        ra = acts[r]
        n = len(ra)
        p, t, bsy, lv, pk = pos[r], clock[r], busy[r], live[r], peak[r]
        while p < n:
            a = ra[p]
            ty = a.type
            s = a.stage
            if ty is _F:
                m = a.microbatch
                pth = mb_path[m]
                o = src_f[pth][s]
                if o >= 0:
                    key = (o * n_mb + m) << 1
                    x = arrivals[key]
                    if x is None:
                        waiting[key] = r
                        break
                    if x > t:
                        t = x
                d = fc[s]
                t += d
                bsy += d
                lv += 1
                if lv > pk:
                    pk = lv
                o = dst_f[pth][s]
                if o >= 0:
                    t = post(r, s2r[o], (s * n_mb + m) << 1, t)
            elif ty is _B or ty is _I:
                m = a.microbatch
                pth = mb_path[m]
                o = src_b[pth][s]
                if o >= 0:
                    key = ((o * n_mb + m) << 1) | 1
                    x = arrivals[key]
                    if x is None:
                        waiting[key] = r
                        break
                    if x > t:
                        t = x
                d = bc[s] if ty is _B else ic[s]
                t += d
                bsy += d
                lv -= 1
                o = dst_b[pth][s]
                if o >= 0:
                    t = post(r, s2r[o], ((s * n_mb + m) << 1) | 1, t)
            elif ty is _W:
                d = wc[s]
                t += d
                bsy += d
            elif ty is _FB:
                t1 = pair(r, a, t)
                if t1 is None:
                    break
                t = t1
                fa, ba = a.sub_actions
                d = pair_cost(fa.stage, ba.stage, ba.type is _B)
                bsy += d
                if lv + 1 > pk:  # the F counts before the backward frees
                    pk = lv + 1
            else:
                raise ValueError(f"rank {r} step {p}: {a} is a comm action in a schedule marked compute-only")
            p += 1
        pos[r], clock[r], busy[r], live[r], peak[r] = p, t, bsy, lv, pk

    _deadlock(sched, pos)
    # Every transfer is consumed by a compute on its receiver, so no event ends after the last rank's clock.
    makespan: Num = max(clock) if clock else 0
    return _result(sched, comm, makespan, busy, blocked, peak, n_sends, None, replay)


def reference_bubble(name: str, ranks: int, costs: CostModel) -> Num | None:
    """The reference table's bubble (DESIGN.md) for uniform costs, or None.

    None when the schedule has no row in the table or the costs are per stage.
    The formulas are exact for zero communication cost and F = B - W (ZB1P:
    also W = F), B <= F&B <= F + B; outside that regime they are a yardstick.
    """
    f, b, w = costs.f, costs.b, costs.w
    if not (isinstance(f, Real) and isinstance(b, Real) and isinstance(w, Real)):
        return None
    fb = f + b if costs.fb is None else costs.fb
    if not isinstance(fb, Real):
        return None
    if name == "1f1b":
        return (ranks - 1) * (f + b)
    if name == "zb1p":
        return (ranks - 1) * (f + b - 2 * w)
    if name == "dualpipe":
        return (ranks // 2 - 1) * (fb + b - 3 * w)
    if name == "dualpipev":
        return (ranks - 1) * (fb + b - 3 * w)
    return None
