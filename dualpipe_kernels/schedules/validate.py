"""Schedule validator: static rules, comm pairing and a deadlock-proving dry run.

:func:`validate` raises :class:`ScheduleError` (a ValueError) on the first
broken rule.  The message names the rank, the step (index in that rank's list
as given) and the action, and shows that rank's neighbourhood.  Checks:

1. every action: micro-batch in range, its stage on the micro-batch's path and
   held by this rank; a compute-only schedule has no comm actions;
2. per ``(stage, mb)``: exactly one F, and either one B or one I plus one W; F
   strictly before its B/I (not inside the same OVERLAP_F_B), I before W;
3. a lowered schedule: every SEND has exactly one RECV (:func:`comm_pairs`);
4. a dry run of the *lowered* form, driven by the dependency rules of
   :mod:`.deps`: each rank runs its list in order; a RECV waits until the peer
   has run the matching SEND; a SEND or compute whose local input is not ready
   yet can never become ready (it would come later on the same rank).  The run
   must finish every list, otherwise the wait-for chain is reported.

A compute-only schedule is dry-run through its lowering without materialising
it: ``lower_comms`` puts a RECV right before each compute with a cross-rank
input and a SEND right after each producer, so "RECV waits for SEND" is
exactly "the compute waits until the producing compute has run".

Everything is O(number of actions).
"""

from __future__ import annotations

from typing import NamedTuple

from .deps import DepKind, Topology
from .ir import Action, ActionType, Schedule

__all__ = ["ScheduleError", "validate", "comm_pairs", "CommPair", "neighbourhood"]

_F, _B, _I, _W, _PAIR = ActionType.F, ActionType.B, ActionType.I, ActionType.W, ActionType.OVERLAP_F_B
_SEND_F, _RECV_F, _SEND_B, _RECV_B = ActionType.SEND_F, ActionType.RECV_F, ActionType.SEND_B, ActionType.RECV_B
_COMM = (_SEND_F, _RECV_F, _SEND_B, _RECV_B)

_NEIGHBOURS = 4  # actions shown on each side of the culprit


class ScheduleError(ValueError):
    """A schedule breaks a rule.  ``rank``/``step``/``action`` locate it (None when global)."""

    def __init__(self, message: str, rank: int | None = None, step: int | None = None, action: object = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.step = step
        self.action = action


def neighbourhood(actions: list[Action], step: int, width: int = _NEIGHBOURS) -> str:
    """``actions`` around ``step`` with the culprit in brackets (``step == len`` marks the end)."""
    lo, hi = max(0, step - width), min(len(actions), step + width + 1)
    parts = ["..."] if lo > 0 else []
    for j in range(lo, hi):
        parts.append(f"[{actions[j]}]" if j == step else str(actions[j]))
    if step >= len(actions):
        parts.append("[<end>]")
    if hi < len(actions):
        parts.append("...")
    return " ".join(parts)


def _fail(schedule: Schedule, rank: int, step: int, problem: str) -> ScheduleError:
    acts = schedule.actions[rank]
    action = acts[step] if step < len(acts) else None
    where = f"rank {rank}, step {step} ({action if action is not None else 'end of list'})"
    msg = f"{schedule.name}: {where}: {problem}\n  rank {rank}: {neighbourhood(acts, step)}"
    return ScheduleError(msg, rank, step, action)


def _describe(topo: Topology, key: int) -> str:
    d = topo.unkey(key)
    what = "activation" if d.kind is DepKind.ACT else "input gradient"
    return f"the {what} of stage {d.stage}, micro-batch {d.microbatch}"


def _topology(schedule: Schedule) -> Topology:
    S = schedule.num_stages
    for s, r in enumerate(schedule.stage_to_rank):
        if not 0 <= r < schedule.num_ranks:
            raise ScheduleError(
                f"{schedule.name}: stage {s} is placed on rank {r}, but there are {schedule.num_ranks} ranks"
            )
    for m, p in enumerate(schedule.microbatch_path):
        if not 0 <= p < len(schedule.paths):
            raise ScheduleError(
                f"{schedule.name}: micro-batch {m} uses path {p}, but there are {len(schedule.paths)} paths"
            )
    if len(schedule.model_stage) != S:
        raise ScheduleError(f"{schedule.name}: model_stage has {len(schedule.model_stage)} entries for {S} stages")
    try:
        return Topology(schedule)
    except ValueError as e:
        raise ScheduleError(f"{schedule.name}: {e}") from None


class _Positions(NamedTuple):
    """Per ``stage * N + mb``: step of its F, of its B/I, of its W (-1: none) and the B/I kind (0 none, 1 B, 2 I)."""

    f: list[int]
    g: list[int]
    w: list[int]
    g_kind: bytearray


def _plain_computes(schedule: Schedule, r: int, i: int, a: Action) -> tuple[Action, ...]:
    """The halves of a pair (checked for shape), the action itself, or () for a comm action."""
    t = a.type
    if t in _COMM:
        if not schedule.lowered:
            raise _fail(schedule, r, i, "comm action in a compute-only schedule (lower_comms adds them)")
        return ()
    if t is not _PAIR:
        return (a,)
    halves = a.sub_actions
    if len(halves) != 2 or halves[0].type is not _F or halves[1].type not in (_B, _I):
        raise _fail(schedule, r, i, "OVERLAP_F_B must pair one F with one B or I")
    if halves[0].stage == halves[1].stage and halves[0].microbatch == halves[1].microbatch:
        raise _fail(schedule, r, i, "an F and the backward of the same (stage, micro-batch) cannot overlap")
    return halves


def _check_placement(schedule: Schedule, topo: Topology) -> None:
    """Every compute: micro-batch in range, stage on its path and held by this rank."""
    S, N = topo.num_stages, topo.num_microbatches
    s2r, mb_path, on_path = topo.stage_to_rank, topo.mb_path, topo.on_path
    for r, acts in enumerate(schedule.actions):
        for i, a in enumerate(acts):
            for c in _plain_computes(schedule, r, i, a):
                s, m = c.stage, c.microbatch
                if not 0 <= m < N:
                    raise _fail(schedule, r, i, f"micro-batch {m} out of range 0..{N - 1}")
                if not (0 <= s < S and on_path[mb_path[m]][s]):
                    raise _fail(schedule, r, i, f"stage {s} is not on micro-batch {m}'s path {schedule.path(m)}")
                if s2r[s] != r:
                    raise _fail(schedule, r, i, f"stage {s} lives on rank {s2r[s]}, not on rank {r}")


def _check_static(schedule: Schedule, topo: Topology) -> _Positions:
    """Placement, then per (stage, mb): one F, one B or I+W, in order; then completeness."""
    _check_placement(schedule, topo)
    S, N = topo.num_stages, topo.num_microbatches
    pos = _Positions([-1] * (S * N), [-1] * (S * N), [-1] * (S * N), bytearray(S * N))
    pf, pg, pw, gk = pos
    for r, acts in enumerate(schedule.actions):
        for i, a in enumerate(acts):
            for c in _plain_computes(schedule, r, i, a):
                ct, s, m = c.type, c.stage, c.microbatch
                k = s * N + m
                chunk = f"stage {s}, micro-batch {m}"
                if ct is _F:
                    if pf[k] >= 0:
                        raise _fail(schedule, r, i, f"second F of {chunk} (first at step {pf[k]})")
                    pf[k] = i
                elif ct is _B or ct is _I:
                    if pg[k] >= 0:
                        raise _fail(schedule, r, i, f"second backward of {chunk} (first at step {pg[k]})")
                    if pf[k] < 0:
                        raise _fail(schedule, r, i, f"{ct.value} comes before the F of {chunk} (or it has none)")
                    pg[k] = i
                    gk[k] = 1 if ct is _B else 2
                elif ct is _W:
                    if gk[k] == 1:
                        raise _fail(schedule, r, i, f"W after a full B of {chunk} (B already includes W)")
                    if gk[k] == 0:
                        raise _fail(schedule, r, i, f"W comes before the I of {chunk} (or it has none)")
                    if pw[k] >= 0:
                        raise _fail(schedule, r, i, f"second W of {chunk} (first at step {pw[k]})")
                    pw[k] = i
    _check_complete(schedule, topo, pos)
    return pos


def _check_complete(schedule: Schedule, topo: Topology, pos: _Positions) -> None:
    N = topo.num_microbatches
    pf, pg, pw, gk = pos
    for m in range(N):
        for s in schedule.paths[topo.mb_path[m]]:
            k = s * N + m
            missing = None
            if pf[k] < 0:
                missing = "F"
            elif gk[k] == 0:
                missing = "B (or I+W)"
            elif gk[k] == 2 and pw[k] < 0:
                missing = "W"
            if missing:
                r = topo.stage_to_rank[s]
                raise _fail(schedule, r, len(schedule.actions[r]), f"missing {missing} of stage {s}, micro-batch {m}")


# ---- comm pairing --------------------------------------------------------------


class CommPair(NamedTuple):
    """A matched transfer: the SEND at ``actions[send_rank][send_index]`` and its RECV."""

    send_rank: int
    send_index: int
    recv_rank: int
    recv_index: int


def _comm_key(topo: Topology, a: Action) -> tuple[int, int]:
    """(data key, the other stage) of a comm action; the other stage is -1 at a path end.

    Keys as in :func:`_dry_run`: ``stage * N + mb`` for an activation,
    ``S * N + stage * N + mb`` for an input gradient (stage = the producer).
    """
    t, s, m = a.type, a.stage, a.microbatch
    N = topo.num_microbatches
    p = topo.mb_path[m]
    if t is _SEND_F:
        return s * N + m, topo.next[p][s]
    if t is _SEND_B:
        return (topo.num_stages + s) * N + m, topo.prev[p][s]
    if t is _RECV_F:
        other = topo.prev[p][s]
        return other * N + m, other
    other = topo.next[p][s]
    return (topo.num_stages + other) * N + m, other


def comm_pairs(schedule: Schedule) -> list[CommPair]:
    """Match every SEND with its RECV; ScheduleError for one with no partner, a duplicate or a wrong peer.

    ``SEND_F`` of stage ``s``, micro-batch ``m`` matches ``RECV_F`` of
    ``next(s, m)``; ``SEND_B`` of ``s`` matches ``RECV_B`` of ``prev(s, m)``.
    Pairs come in the order of the sends (rank by rank).
    """
    topo = _topology(schedule)
    N, S = topo.num_microbatches, topo.num_stages
    s2r, mbp, nxt_t, prv_t, on_t = topo.stage_to_rank, topo.mb_path, topo.next, topo.prev, topo.on_path
    # Per data key (see _comm_key): where its SEND / RECV is, as (rank, step); -1 rank: none yet.
    send_at: list[tuple[int, int, int]] = []
    recv_at = [(-1, -1)] * (2 * S * N)
    for r, acts in enumerate(schedule.actions):
        for i, a in enumerate(acts):
            t = a.type
            if t not in _COMM:
                continue
            s, m = a.stage, a.microbatch
            if not (0 <= m < N and 0 <= s < S and on_t[mbp[m]][s]):
                raise _fail(schedule, r, i, f"stage {s} is not on micro-batch {m}'s path")
            if s2r[s] != r:
                raise _fail(schedule, r, i, f"stage {s} lives on rank {s2r[s]}, not on rank {r}")
            p = mbp[m]
            if t is _SEND_F:
                key, other = s * N + m, nxt_t[p][s]
            elif t is _SEND_B:
                key, other = (S + s) * N + m, prv_t[p][s]
            elif t is _RECV_F:
                other = prv_t[p][s]
                key = other * N + m
            else:
                other = nxt_t[p][s]
                key = (S + other) * N + m
            if other < 0:
                raise _fail(schedule, r, i, "no neighbour stage to exchange with at this end of the path")
            if s2r[other] == r:
                raise _fail(schedule, r, i, f"neighbour stage {other} is on the same rank: no transfer needed")
            if a.peer is not None and a.peer != s2r[other]:
                raise _fail(schedule, r, i, f"peer is {a.peer}, but stage {other} lives on rank {s2r[other]}")
            if t is _SEND_F or t is _SEND_B:
                send_at.append((key, r, i))
            else:
                if recv_at[key][0] >= 0:
                    r0, i0 = recv_at[key]
                    raise _fail(schedule, r, i, f"duplicate of rank {r0}, step {i0}")
                recv_at[key] = (r, i)
    pairs: list[CommPair] = []
    matched = bytearray(2 * S * N)
    for key, sr, si in send_at:
        rr, ri = recv_at[key]
        if rr < 0:
            raise _fail(schedule, sr, si, "no matching receive")
        if matched[key]:
            raise _fail(schedule, sr, si, "a second send of the same data")
        matched[key] = 1
        pairs.append(CommPair(sr, si, rr, ri))
    if len(pairs) != sum(1 for rr, _ in recv_at if rr >= 0):
        for key, (rr, ri) in enumerate(recv_at):
            if rr >= 0 and not matched[key]:
                raise _fail(schedule, rr, ri, "no matching send")
    return pairs


# ---- dry run ---------------------------------------------------------------------


class _Stuck(Exception):
    """Internal: the fast pass found a problem; the slow static pass words it."""


def _dry_run(schedule: Schedule, topo: Topology) -> None:
    """One pass in dependency order doing every check at once (the fast path).

    Data keys: ``stage * N + mb`` for an activation, ``S * N + stage * N + mb``
    for an input gradient.  ``done`` marks data computed, ``avail`` data posted
    to its consumer's rank (the SEND; without comm actions, the SEND lowering
    would put right after the compute), ``received`` data a RECV took in.
    A rank blocks only where the lowered form has a RECV; anything else that is
    not ready can never become ready.  On any problem the slow static checks
    run to name it precisely.  This loop is the validator's hot path (10^5-10^6
    actions), hence written out inline.
    """
    N, S = topo.num_microbatches, topo.num_stages
    SN = S * N
    s2r, mbp, nxt_t, prv_t, on_t = topo.stage_to_rank, topo.mb_path, topo.next, topo.prev, topo.on_path
    lowered = schedule.lowered
    R = schedule.num_ranks
    done = bytearray(2 * SN)
    avail = bytearray(2 * SN) if lowered else done
    received = bytearray(2 * SN)
    w_done = bytearray(SN)
    g_kind = bytearray(SN)  # 1: full B, 2: I
    n_f = n_g = n_i = n_w = 0
    waiting: dict[int, list[int]] = {}
    blocked_on = [-1] * R
    ptr = [0] * R
    work = list(range(R - 1, -1, -1))
    try:
        while work:
            r = work.pop()
            acts = schedule.actions[r]
            i, n = ptr[r], len(acts)
            while i < n:
                a = acts[i]
                t = a.type
                if t in _COMM:
                    if not lowered:
                        raise _Stuck
                    # comm_pairs has checked these; the key arithmetic is _comm_key's, inline
                    st, m = a.stage, a.microbatch
                    if t is _RECV_F:
                        key = prv_t[mbp[m]][st] * N + m
                    elif t is _RECV_B:
                        key = SN + nxt_t[mbp[m]][st] * N + m
                    else:
                        key = st * N + m + (SN if t is _SEND_B else 0)
                    if t is _RECV_F or t is _RECV_B:
                        if not avail[key]:
                            waiting.setdefault(key, []).append(r)
                            blocked_on[r] = key
                            break
                        received[key] = 1
                    else:
                        if not done[key]:
                            raise _Stuck  # SEND before the compute that makes the data
                        avail[key] = 1
                        if key in waiting:
                            work.extend(waiting.pop(key))
                    i += 1
                    continue
                if t is _PAIR:
                    cs = a.sub_actions
                    if cs[0].stage == cs[1].stage and cs[0].microbatch == cs[1].microbatch:
                        raise _Stuck
                else:
                    cs = (a,)
                # 1. may every half run now?  (-1: yes; else the cross-rank data to wait for)
                wait = -1
                for c in cs:
                    ct, st, m = c.type, c.stage, c.microbatch
                    if not (0 <= m < N and 0 <= st < S):
                        raise _Stuck
                    p = mbp[m]
                    if not on_t[p][st] or s2r[st] != r:
                        raise _Stuck
                    k = st * N + m
                    if ct is _F:
                        if done[k]:
                            raise _Stuck
                        src = prv_t[p][st]
                        dk = src * N + m
                    elif ct is _B or ct is _I:
                        if done[SN + k] or not done[k]:
                            raise _Stuck
                        src = nxt_t[p][st]
                        dk = SN + src * N + m
                    elif ct is _W:
                        if g_kind[k] != 2 or w_done[k]:
                            raise _Stuck
                        continue
                    else:
                        raise _Stuck
                    if src < 0:
                        continue
                    if s2r[src] == r:
                        if not done[dk]:
                            raise _Stuck  # made later on this very rank: can never run
                    elif lowered:
                        if not received[dk]:
                            raise _Stuck  # no RECV before it
                    elif not done[dk]:
                        wait = dk
                        break
                if wait >= 0:
                    waiting.setdefault(wait, []).append(r)
                    blocked_on[r] = wait
                    break
                # 2. run it
                for c in cs:
                    ct = c.type
                    k = c.stage * N + c.microbatch
                    if ct is _F:
                        n_f += 1
                    elif ct is _W:
                        n_w += 1
                        w_done[k] = 1
                        continue
                    else:
                        n_g += 1
                        if ct is _I:
                            n_i += 1
                            g_kind[k] = 2
                        else:
                            g_kind[k] = 1
                        k += SN
                    done[k] = 1
                    if waiting and not lowered and k in waiting:
                        work.extend(waiting.pop(k))
                i += 1
            ptr[r] = i
    except _Stuck:
        _explain(schedule, topo)
        raise ScheduleError(
            f"{schedule.name}: validator bug: a check failed that the static pass does not name"
        ) from None
    expected = sum(len(schedule.paths[p]) for p in mbp)
    stuck = [r for r in range(R) if ptr[r] < len(schedule.actions[r])]
    if stuck or n_f != expected or n_g != expected or n_w != n_i:
        _explain(schedule, topo)  # missing actions explain a stall better than the stall itself
        if not stuck:
            raise ScheduleError(f"{schedule.name}: validator bug: counts differ but the static pass finds nothing")
        raise _deadlock(schedule, topo, stuck[0], ptr, blocked_on)


def _explain(schedule: Schedule, topo: Topology) -> None:
    """Slow path: run the static checks, which raise a precise ScheduleError if any rule is broken."""
    pos = _check_static(schedule, topo)
    _check_local_order(schedule, topo, pos)
    if schedule.lowered:
        comm_pairs(schedule)
        _check_comm_order(schedule, topo, pos)


def _check_local_order(schedule: Schedule, topo: Topology, pos: _Positions) -> None:
    """Data made and used on the same rank must be made first (e.g. the turn of a V)."""
    N, SN = topo.num_microbatches, topo.num_stages * topo.num_microbatches
    needs: list[int] = []
    for r, acts in enumerate(schedule.actions):
        for i, a in enumerate(acts):
            needs.clear()
            for c in a.computes():
                _needs(topo, c, needs)
            for key in needs:
                kind, k = divmod(key, SN)
                if topo.stage_to_rank[k // N] != r:
                    continue
                j = pos.f[k] if kind == 0 else pos.g[k]
                if j >= i:
                    where = "in the same step" if j == i else f"later, at step {j}"
                    raise _fail(
                        schedule, r, i, f"deadlock: needs {_describe(topo, key)}, which this rank computes {where}"
                    )


def _check_comm_order(schedule: Schedule, topo: Topology, pos: _Positions) -> None:
    """Lowered: a SEND comes after the compute making its data; a compute after the RECVs it reads."""
    N, SN = topo.num_microbatches, topo.num_stages * topo.num_microbatches
    recv_step: dict[int, int] = {}
    for acts in schedule.actions:
        for i, a in enumerate(acts):
            if a.type is _RECV_F or a.type is _RECV_B:
                recv_step[_comm_key(topo, a)[0]] = i
    needs: list[int] = []
    for r, acts in enumerate(schedule.actions):
        for i, a in enumerate(acts):
            if a.type is _SEND_F or a.type is _SEND_B:
                key = _comm_key(topo, a)[0]
                kind, k = divmod(key, SN)
                j = pos.f[k] if kind == 0 else pos.g[k]
                if j > i:
                    raise _fail(schedule, r, i, f"sends {_describe(topo, key)} before computing it (at step {j})")
                continue
            needs.clear()
            for c in a.computes():
                _needs(topo, c, needs)
            for key in needs:
                src = topo.stage_to_rank[(key % SN) // N]
                if src != r and recv_step.get(key, i) >= i:
                    raise _fail(
                        schedule,
                        r,
                        i,
                        f"needs {_describe(topo, key)} from rank {src} but has no RECV for it before this step",
                    )


def _needs(topo: Topology, c: Action, out: list[int]) -> None:
    """Append the data keys plain compute ``c`` reads (the rules of deps.dependency_keys)."""
    t, s, m = c.type, c.stage, c.microbatch
    N, SN = topo.num_microbatches, topo.num_stages * topo.num_microbatches
    p = topo.mb_path[m]
    if t is _F:
        prev = topo.prev[p][s]
        if prev >= 0:
            out.append(prev * N + m)
    elif t is _B or t is _I:
        out.append(s * N + m)
        nxt = topo.next[p][s]
        if nxt >= 0:
            out.append(SN + nxt * N + m)
    elif t is _W:
        out.append(SN + s * N + m)


def _deadlock(schedule: Schedule, topo: Topology, r0: int, ptr: list[int], blocked_on: list[int]) -> ScheduleError:
    """Follow who waits for whom from rank ``r0`` until a rank repeats: that is the cycle."""
    N, SN = topo.num_microbatches, topo.num_stages * topo.num_microbatches
    chain: list[str] = []
    seen: list[int] = []
    r = r0
    while r not in seen:
        seen.append(r)
        key = blocked_on[r]
        src = topo.stage_to_rank[(key % SN) // N]
        acts = schedule.actions[r]
        chain.append(f"rank {r} at step {ptr[r]} ({acts[ptr[r]]}) waits for {_describe(topo, key)} from rank {src}")
        if ptr[src] >= len(schedule.actions[src]):
            chain.append(f"rank {src} finished without sending it")
            break
        r = src
    else:
        chain.append(f"back to rank {r}: a cycle")
    return _fail(schedule, r0, ptr[r0], "deadlock: " + "; ".join(chain))


def validate(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` unless ``schedule`` is complete, consistent and deadlock-free."""
    topo = _topology(schedule)
    if schedule.lowered:
        comm_pairs(schedule)
    _dry_run(schedule, topo)
