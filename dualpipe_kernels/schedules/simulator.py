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

Both engines read the schedule's dependency program (:class:`~.deps.Program`),
the one description of what every action needs and makes, and give identical
numbers (tests check it on every generator): ``simulate`` on a lowered
schedule walks its comm actions and records every event; on a compute-only
schedule it waits on each compute's remote needs and posts its sends (what
the lowering would put around it) without building comm actions, about 3x
faster, and replays the lowered schedule only when events or the critical path
are asked for.

``simulate`` validates its input (:func:`~.validate.validate`: ValueError for
a schedule that would run wrong or deadlock) unless it is given the program
that ``validate`` returned for that very schedule (``program=``), which is the
fast path for a caller that has just validated.

Reported figures (all in the cost model's time unit; activations and
parameters in units of one stage chunk, one micro-batch):

* ``busy_per_rank``: time spent computing; ``idle_per_rank = makespan - busy``
  (waiting for data, blocked in a blocking send, or done early).
* ``bubble_per_rank`` = ``idle_per_rank``; ``bubble`` = its maximum over ranks
  (docs/architecture.md's reference table); ``bubble_ratio = bubble / makespan``, the share
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

from collections.abc import Callable
from numbers import Real

from ._program import gc_paused
from .costs import CommModel, CostModel, Num, StageCosts
from .deps import ROLE_COMPUTE, ROLE_SEND, RULES, Program
from .ir import T_B, T_F, T_I, T_PAIR, T_W, Action, Schedule
from .simresult import SimEvent, SimResult, Timeline, action_kind, make_event
from .validate import validate

__all__ = ["SimEvent", "SimResult", "simulate", "action_kind", "make_event", "reference_bubble"]


def simulate(
    schedule: Schedule,
    costs: CostModel | None = None,
    comm: CommModel | None = None,
    *,
    program: Program | None = None,
) -> SimResult:
    """Simulate ``schedule`` (compute-only or lowered) under ``costs`` and ``comm``.

    Raises ValueError for invalid costs (naming the constraint) and for an
    invalid schedule (``ScheduleError``: B before F, a missing or duplicated
    action, a stage out of range, a deadlock...).  ``program``: what
    :func:`~.validate.validate` returned for ``schedule``; skips the validation
    (a program not validated, or of another schedule, is ignored).
    """
    costs = costs or CostModel()
    comm = comm or CommModel()
    if program is None or not program.validated or program.schedule is not schedule:
        program = validate(schedule)
    sc = costs.resolve(schedule)
    prog = program

    def replay() -> SimResult:
        from .lowering import lower_program  # only needed for the event timeline

        with gc_paused():
            return _run_lowered(lower_program(prog), sc, comm)

    with gc_paused():
        if schedule.lowered:
            return _run_lowered(prog, sc, comm)
        return _run_direct(prog, sc, comm, replay)


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
    timeline: Timeline | None,
    replay: Callable[[], SimResult] | None,
) -> SimResult:
    n_ranks = sched.num_ranks
    idle = [makespan - b for b in busy]
    bubble = max(idle) if idle else 0
    params = [0] * n_ranks  # one pass over the placement (stages_of_rank per rank would be O(ranks x stages))
    for r in sched.stage_to_rank:
        params[r] += 1
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


def _cost_of(sc: StageCosts) -> Callable[[Action], tuple[Num, int, int]]:
    """``cost_of(action)``: (duration, change of live activations, bump of the peak before it).

    The peak counts an F before anything frees: F (+1, bump 1); an F&B pair
    (0, bump 1: its F counts before its backward frees); B or I (-1, 0); W (0, 0);
    another kind: its rule's ``cost`` and ``live``.
    """
    fc, bc, wc, ic, pair_cost = sc.f, sc.b, sc.w, sc.i, sc.pair

    def cost_of(a: Action) -> tuple[Num, int, int]:
        ty = a.type
        if ty is T_F:
            return fc[a.stage], 1, 1
        if ty is T_B:
            return bc[a.stage], -1, 0
        if ty is T_I:
            return ic[a.stage], -1, 0
        if ty is T_W:
            return wc[a.stage], 0, 0
        if ty is T_PAIR:
            fa, ba = a.sub_actions
            return pair_cost(fa.stage, ba.stage, ba.type is T_B), 0, 1
        rule = RULES[ty]
        return rule.cost(sc, a.stage), rule.live, max(rule.live, 0)

    return cost_of


def _run_lowered(prog: Program, sc: StageCosts, comm: CommModel) -> SimResult:
    """Walk the lowered lists, recording every action's start and end."""
    sched = prog.schedule
    cost_of = _cost_of(sc)
    n_ranks = sched.num_ranks
    acts = sched.actions
    offsets = [0] * (n_ranks + 1)
    for r in range(n_ranks):
        offsets[r + 1] = offsets[r] + len(acts[r])
    total = offsets[n_ranks]
    start: list[Num] = [0] * total
    end: list[Num] = [0] * total
    pred = [-1] * total  # the event whose end made this one ready (critical path)

    blocking = comm.blocking
    links = _Links(comm, n_ranks)

    clock: list[Num] = [0] * n_ranks
    pos = [0] * n_ranks
    last = [-1] * n_ranks  # gid of the event that set each rank's clock
    busy: list[Num] = [0] * n_ranks
    blocked: list[Num] = [0] * n_ranks
    live = [0] * n_ranks
    peak = [0] * n_ranks
    # data key -> (arrival time at its receiver, send gid)
    arrivals: list[tuple[Num, int] | None] = [None] * prog.topo.num_keys
    waiting: dict[int, int] = {}  # data key -> rank blocked on it
    n_sends = 0
    ready = list(range(n_ranks - 1, -1, -1))

    while ready:
        r = ready.pop()
        ra, role, remote, sends = acts[r], prog.role[r], prog.remote[r], prog.sends[r]
        n = len(ra)
        p, t, lg, base = pos[r], clock[r], last[r], offsets[r]
        bsy, lv, pk = busy[r], live[r], peak[r]
        while p < n:
            a = ra[p]
            g = base + p
            ro = role[p]
            if ro != ROLE_COMPUTE:
                if ro == ROLE_SEND:
                    key, dst = sends[p][0]
                    s0, arr, behind = links.send(r, dst, t, g)
                    start[g], end[g] = s0, arr
                    pred[g] = lg if behind < 0 else behind
                    n_sends += 1
                    if blocking:
                        blocked[r] += arr - t
                        t = arr
                        lg = g
                    arrivals[key] = (arr, g)
                    w = waiting.pop(key, None)
                    if w is not None:
                        ready.append(w)
                else:  # RECV
                    key = remote[p][0]
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
            d, delta, bump = cost_of(a)
            if lv + bump > pk:
                pk = lv + bump
            lv += delta
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
    tl = Timeline(sched, start, end, offsets, critical)
    return _result(sched, comm, makespan, busy, blocked, peak, n_sends, tl, None)


def _run_direct(prog: Program, sc: StageCosts, comm: CommModel, replay: Callable[[], SimResult]) -> SimResult:
    """Simulate a compute-only schedule: each compute waits on its remote needs and posts its sends.

    That is what the lowered lists do (a RECV right before the consumer, a SEND
    right after the producer), without building them or keeping a timeline.
    """
    sched = prog.schedule
    cost_of = _cost_of(sc)
    n_ranks = sched.num_ranks
    acts = sched.actions
    blocking = comm.blocking
    instant = comm.is_free and not blocking  # every transfer arrives when it is posted
    # Per source rank, per destination rank: when the link is free again, its occupancy and latency.
    link_free: list[dict[int, Num]] = [{} for _ in range(n_ranks)]
    link_cost: list[dict[int, tuple[Num, Num]]] = [{} for _ in range(n_ranks)]
    arrivals: list[Num | None] = [None] * prog.topo.num_keys  # data key -> arrival at its remote consumer
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
            c = link_cost[r].get(dst)
            if c is None:
                c = link_cost[r][dst] = comm.link_time(r, dst)
            start = link_free[r].get(dst, 0)
            if start < t:
                start = t
            start += c[0]
            link_free[r][dst] = start
            arr = start + c[1]
        arrivals[key] = arr
        w = waiting.pop(key, None)
        if w is not None:
            ready.append(w)
        if blocking:
            blocked[r] += arr - t
            return arr
        return t

    while ready:
        r = ready.pop()
        ra, remote, sends = acts[r], prog.remote[r], prog.sends[r]
        n = len(ra)
        p, t, bsy, lv, pk = pos[r], clock[r], busy[r], live[r], peak[r]
        while p < n:
            need = remote[p]
            if need:
                x = arrivals[need[0]]
                if x is None:
                    waiting[need[0]] = r
                    break
                for k in need[1:]:
                    y = arrivals[k]
                    if y is None:
                        x = None
                        waiting[k] = r
                        break
                    if y > x:
                        x = y
                if x is None:
                    break
                if x > t:
                    t = x
            d, delta, bump = cost_of(ra[p])
            if lv + bump > pk:
                pk = lv + bump
            lv += delta
            t += d
            bsy += d
            for k, dst in sends[p]:
                t = post(r, dst, k, t)
            p += 1
        pos[r], clock[r], busy[r], live[r], peak[r] = p, t, bsy, lv, pk

    _deadlock(sched, pos)
    # Every transfer is consumed by a compute on its receiver, so no event ends after the last rank's clock.
    makespan: Num = max(clock) if clock else 0
    return _result(sched, comm, makespan, busy, blocked, peak, n_sends, None, replay)


def reference_bubble(name: str, ranks: int, costs: CostModel) -> Num | None:
    """The reference table's bubble (docs/architecture.md) for uniform costs, or None.

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
