"""The validator's slow path: checks that name a broken rule precisely, and comm pairing.

:mod:`.validate` runs one fast dry run over the dependency program; when it
finds a problem, the checks here run one by one to word it (rank, step,
neighbourhood).  They read the same :class:`~.deps.Program`; only the
structure rules of the built-in kinds (one F per chunk, one B or I+W) are
written out here, since a pair of positions says more than a stuck key.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

from .deps import ROLE_COMPUTE, ROLE_RECV, ROLE_SEND, Program, ProgramError, Topology
from .ir import COMM_TYPES, T_B, T_F, T_I, T_PAIR, T_W, Action, ActionType, Schedule
from .schedule_error import ScheduleError, fail

__all__ = [
    "CommPair",
    "comm_pairs",
    "pairs_of",
    "program_of",
    "check_layout",
    "check_entries",
    "explain",
    "deadlock",
]


def check_layout(schedule: Schedule) -> Topology:
    """Stage placement, micro-batch paths and model stages are in range; the Topology."""
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
    """Per chunk (``Topology.chunk``): step of its F, B/I and W (-1: none); B/I kind (0 none, 1 B, 2 I)."""

    f: list[int]
    g: list[int]
    w: list[int]
    g_kind: bytearray


def _plain_computes(schedule: Schedule, r: int, i: int, a: Action) -> tuple[Action, ...]:
    """The halves of a pair (checked for shape), the action itself, or () for a comm action."""
    t = a.type
    if t in COMM_TYPES:
        if not schedule.lowered:
            raise fail(schedule, r, i, "comm action in a compute-only schedule (lower_comms adds them)")
        return ()
    if t is not T_PAIR:
        return (a,)
    halves = a.sub_actions
    if len(halves) != 2 or halves[0].type is not T_F or halves[1].type not in (T_B, T_I):
        raise fail(schedule, r, i, "OVERLAP_F_B must pair one F with one B or I")
    if halves[0].stage == halves[1].stage and halves[0].microbatch == halves[1].microbatch:
        raise fail(schedule, r, i, "an F and the backward of the same (stage, micro-batch) cannot overlap")
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
                    raise fail(schedule, r, i, f"micro-batch {m} out of range 0..{N - 1}")
                if not (0 <= s < S and on_path[mb_path[m]][s]):
                    raise fail(schedule, r, i, f"stage {s} is not on micro-batch {m}'s path {schedule.path(m)}")
                if s2r[s] != r:
                    raise fail(schedule, r, i, f"stage {s} lives on rank {s2r[s]}, not on rank {r}")


def _check_static(schedule: Schedule, topo: Topology) -> None:
    """Placement, then per (stage, mb): one F, one B or I+W, in order; then completeness."""
    _check_placement(schedule, topo)
    S, N = topo.num_stages, topo.num_microbatches
    pos = _Positions([-1] * (S * N), [-1] * (S * N), [-1] * (S * N), bytearray(S * N))
    pf, pg, pw, gk = pos
    for r, acts in enumerate(schedule.actions):
        for i, a in enumerate(acts):
            for c in _plain_computes(schedule, r, i, a):
                ct, s, m = c.type, c.stage, c.microbatch
                k = topo.chunk(s, m)
                chunk = f"stage {s}, micro-batch {m}"
                if ct is T_F:
                    if pf[k] >= 0:
                        raise fail(schedule, r, i, f"second F of {chunk} (first at step {pf[k]})")
                    pf[k] = i
                elif ct is T_B or ct is T_I:
                    if pg[k] >= 0:
                        raise fail(schedule, r, i, f"second backward of {chunk} (first at step {pg[k]})")
                    if pf[k] < 0:
                        raise fail(schedule, r, i, f"{ct.value} comes before the F of {chunk} (or it has none)")
                    pg[k] = i
                    gk[k] = 1 if ct is T_B else 2
                elif ct is T_W:
                    if gk[k] == 1:
                        raise fail(schedule, r, i, f"W after a full B of {chunk} (B already includes W)")
                    if gk[k] == 0:
                        raise fail(schedule, r, i, f"W comes before the I of {chunk} (or it has none)")
                    if pw[k] >= 0:
                        raise fail(schedule, r, i, f"second W of {chunk} (first at step {pw[k]})")
                    pw[k] = i
    _check_complete(schedule, topo, pos)


def _check_complete(schedule: Schedule, topo: Topology, pos: _Positions) -> None:
    N = topo.num_microbatches
    pf, pg, pw, gk = pos
    for m in range(N):
        for s in schedule.paths[topo.mb_path[m]]:
            k = topo.chunk(s, m)
            missing = None
            if pf[k] < 0:
                missing = "F"
            elif gk[k] == 0:
                missing = "B (or I+W)"
            elif gk[k] == 2 and pw[k] < 0:
                missing = "W"
            if missing:
                r = topo.stage_to_rank[s]
                raise fail(schedule, r, len(schedule.actions[r]), f"missing {missing} of stage {s}, micro-batch {m}")


# ---- comm pairing --------------------------------------------------------------


class CommPair(NamedTuple):
    """A matched transfer: the SEND at ``actions[send_rank][send_index]`` and its RECV."""

    send_rank: int
    send_index: int
    recv_rank: int
    recv_index: int


def program_of(schedule: Schedule) -> Program:
    """The dependency program of ``schedule``; a ScheduleError (worded by the static checks) if it has none."""
    topo = check_layout(schedule)
    error: ProgramError | None = None
    other: Exception | None = None
    try:
        return Program(schedule)
    except ProgramError as e:
        error = e
    except (AttributeError, TypeError, KeyError, IndexError, ValueError) as e:
        other = e
    # Checked only on failure (no cost otherwise): an entry that is no well-formed Action, blamed where it is.
    check_entries(schedule)
    if error is None:
        assert other is not None
        raise other  # not an entry's fault: the original error
    _check_static(schedule, topo)  # names the problem in the validator's words when it can
    raise fail(schedule, error.rank, error.step, error.problem) from None


def entry_problem(entry: object) -> str | None:
    """What is wrong with one entry of an action list as an :class:`Action` (None: well formed).

    The type must be an :class:`ActionType` (or another enum's member: a new action kind, whose dependency
    rule the program reports if missing), ``stage`` and ``microbatch`` integers >= 0 (not bool), ``peer``
    None or an integer, and an OVERLAP_F_B's ``sub_actions`` two well-formed actions.
    """
    if not isinstance(entry, Action):
        return f"the entry is a {type(entry).__name__} ({entry!r:.60}), not an Action"
    if not isinstance(entry.type, (ActionType, enum.Enum)):  # a new kind is an enum member with a dependency rule
        return f"the action's type must be an ActionType (e.g. ActionType.F), got {entry.type!r}"
    for name in ("stage", "microbatch"):
        v = getattr(entry, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            return f"the action's {name} must be an integer >= 0, got {v!r}"
    if entry.peer is not None and (isinstance(entry.peer, bool) or not isinstance(entry.peer, int)):
        return f"the action's peer must be None or an integer, got {entry.peer!r}"
    if entry.type is T_PAIR:
        subs = entry.sub_actions
        if not isinstance(subs, tuple) or len(subs) != 2:
            return f"OVERLAP_F_B needs two sub-actions, got {subs!r:.60}"
        for k, sub in enumerate(subs):
            problem = entry_problem(sub)
            if problem is not None:
                return f"sub-action {k} of OVERLAP_F_B: {problem}"
    return None


def check_entries(schedule: Schedule) -> None:
    """ScheduleError at the first entry of any rank's list that is not a well-formed Action (rank, step, field)."""
    for r, acts in enumerate(schedule.actions):
        for i, entry in enumerate(acts):
            problem = entry_problem(entry)
            if problem is not None:
                raise fail(schedule, r, i, problem)


def comm_pairs(schedule: Schedule) -> list[CommPair]:
    """Match every SEND with its RECV; ScheduleError for one with no partner, a duplicate or a wrong peer.

    ``SEND_F`` of stage ``s``, micro-batch ``m`` matches ``RECV_F`` of
    ``next(s, m)``; ``SEND_B`` of ``s`` matches ``RECV_B`` of ``prev(s, m)``.
    Pairs come in the order of the sends (rank by rank).
    """
    return pairs_of(schedule, program_of(schedule))


def pairs_of(schedule: Schedule, prog: Program) -> list[CommPair]:
    """:func:`comm_pairs` on an already built program."""
    send_at: list[tuple[int, int, int]] = []
    recv_at: dict[int, tuple[int, int]] = {}
    for r, roles in enumerate(prog.role):
        for i, role in enumerate(roles):
            if role == ROLE_SEND:
                send_at.append((prog.local[r][i][0], r, i))
            elif role == ROLE_RECV:
                key = prog.remote[r][i][0]
                if key in recv_at:
                    r0, i0 = recv_at[key]
                    raise fail(schedule, r, i, f"duplicate of rank {r0}, step {i0}")
                recv_at[key] = (r, i)
    pairs: list[CommPair] = []
    matched: set[int] = set()
    for key, sr, si in send_at:
        got = recv_at.get(key)
        if got is None:
            raise fail(schedule, sr, si, "no matching receive")
        if key in matched:
            raise fail(schedule, sr, si, "a second send of the same data")
        matched.add(key)
        pairs.append(CommPair(sr, si, got[0], got[1]))
    for key, (rr, ri) in recv_at.items():
        if key not in matched:
            raise fail(schedule, rr, ri, "no matching send")
    return pairs


# ---- ordering ----------------------------------------------------------------------


def explain(schedule: Schedule, prog: Program) -> None:
    """Run the static checks in turn; each raises a precise ScheduleError if its rule is broken."""
    _check_static(schedule, prog.topo)
    made_at = _made_at(prog)
    _check_local_order(schedule, prog, made_at)
    if schedule.lowered:
        pairs_of(schedule, prog)
        _check_comm_order(schedule, prog, made_at)


def _made_at(prog: Program) -> dict[int, int]:
    """key -> the step of the action that makes it (on the key's own rank); a key made twice is an error."""
    out: dict[int, int] = {}
    for r, makes in enumerate(prog.makes):
        for i, keys in enumerate(makes):
            for k in keys:
                if k in out:
                    raise fail(prog.schedule, r, i, f"makes {prog.topo.describe(k)} again (first at step {out[k]})")
                out[k] = i
    return out


def _check_local_order(schedule: Schedule, prog: Program, made_at: dict[int, int]) -> None:
    """Data made and used on the same rank must be made first (e.g. the turn of a V)."""
    topo = prog.topo
    for r, local in enumerate(prog.local):
        for i, keys in enumerate(local):
            if prog.role[r][i] != ROLE_COMPUTE:
                continue
            for key in keys:
                j = made_at.get(key, -1)
                if j < 0:
                    raise fail(schedule, r, i, f"needs {topo.describe(key)}, which no action makes")
                if j >= i:
                    where = "in the same step" if j == i else f"later, at step {j}"
                    problem = f"deadlock: needs {topo.describe(key)}, which this rank computes {where}"
                    raise fail(schedule, r, i, problem)


def _check_comm_order(schedule: Schedule, prog: Program, made_at: dict[int, int]) -> None:
    """Lowered: a SEND comes after the compute making its data; a compute after the RECVs it reads."""
    topo = prog.topo
    recv_step: dict[int, int] = {}
    for r, roles in enumerate(prog.role):
        for i, role in enumerate(roles):
            if role == ROLE_RECV:
                recv_step[prog.remote[r][i][0]] = i
    for r, roles in enumerate(prog.role):
        for i, role in enumerate(roles):
            if role == ROLE_SEND:
                key = prog.local[r][i][0]
                j = made_at.get(key, len(roles))
                if j > i:
                    raise fail(schedule, r, i, f"sends {topo.describe(key)} before computing it (at step {j})")
            elif role == ROLE_COMPUTE:
                for key in prog.remote[r][i]:
                    if recv_step.get(key, i) >= i:
                        src = topo.key_rank(key)
                        raise fail(
                            schedule,
                            r,
                            i,
                            f"needs {topo.describe(key)} from rank {src} but has no RECV for it before this step",
                        )


def deadlock(schedule: Schedule, prog: Program, r0: int, ptr: list[int], blocked_on: list[int]) -> ScheduleError:
    """Follow who waits for whom from rank ``r0`` until a rank repeats: that is the cycle."""
    topo = prog.topo
    chain: list[str] = []
    seen: list[int] = []
    r = r0
    while r not in seen:
        seen.append(r)
        key = blocked_on[r]
        src = topo.key_rank(key)
        acts = schedule.actions[r]
        chain.append(f"rank {r} at step {ptr[r]} ({acts[ptr[r]]}) waits for {topo.describe(key)} from rank {src}")
        if ptr[src] >= len(schedule.actions[src]):
            chain.append(f"rank {src} finished without sending it")
            break
        r = src
    else:
        chain.append(f"back to rank {r}: a cycle")
    return fail(schedule, r0, ptr[r0], "deadlock: " + "; ".join(chain))
