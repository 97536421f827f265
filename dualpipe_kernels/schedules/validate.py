"""Schedule validator: static rules, comm pairing and a deadlock-proving dry run.

:func:`validate` raises :class:`ScheduleError` (a ValueError) on the first
broken rule.  The message names the rank, the step (index in that rank's list
as given) and the action, and shows that rank's neighbourhood.  Checks:

1. every action: micro-batch in range, its stage on the micro-batch's path and
   held by this rank; a compute-only schedule has no comm actions;
2. per ``(stage, mb)``: exactly one F, and either one B or one I plus one W; F
   strictly before its B/I (not inside the same OVERLAP_F_B), I before W;
3. a lowered schedule: every SEND has exactly one RECV (:func:`comm_pairs`);
4. a dry run of the *lowered* form over the dependency program
   (:class:`~.deps.Program`): each rank runs its list in order; a RECV waits
   until the peer has run the matching SEND; a compute whose local input is
   not made yet can never run (it would come later on the same rank); no datum
   is made twice.  The run must finish every list, otherwise the wait-for
   chain is reported.

A compute-only schedule is dry-run through its lowering without materialising
it: ``lower_comms`` puts a RECV right before each compute with a remote input
and a SEND right after each producer, so "RECV waits for SEND" is exactly "the
compute waits until the producing compute has run".

Everything is O(number of actions).
"""

from __future__ import annotations

from ._program import gc_paused
from .deps import ROLE_COMPUTE, ROLE_RECV, DepKind, Program
from .explain import CommPair, comm_pairs, deadlock, explain, pairs_of, program_of
from .ir import Schedule
from .schedule_error import ScheduleError, neighbourhood

__all__ = ["ScheduleError", "validate", "comm_pairs", "CommPair", "neighbourhood"]


class _Stuck(Exception):
    """Internal: the fast pass found a problem; the slow static pass words it."""


def _dry_run(schedule: Schedule, prog: Program) -> None:
    """One pass in dependency order doing every check at once (the fast path).

    ``done`` marks data made, ``avail`` data posted to its consumer's rank (the
    SEND; without comm actions, the SEND lowering would put right after the
    compute), ``received`` data a RECV took in.  A rank blocks only where the
    lowered form has a RECV; anything else that is not ready can never become
    ready.  On any problem the slow checks (:mod:`.explain`) name it.  This loop
    is the validator's hot path (10^5-10^6 actions), hence written out inline.
    """
    lowered = schedule.lowered
    R = schedule.num_ranks
    K = prog.topo.num_keys
    done = bytearray(K)
    avail = bytearray(K) if lowered else done
    received = bytearray(K)
    waiting: dict[int, list[int]] = {}
    blocked_on = [-1] * R
    ptr = [0] * R
    work = list(range(R - 1, -1, -1))
    try:
        while work:
            r = work.pop()
            role, local, remote, makes = prog.role[r], prog.local[r], prog.remote[r], prog.makes[r]
            i, n = ptr[r], len(role)
            while i < n:
                ro = role[i]
                if ro != ROLE_COMPUTE:
                    if not lowered:
                        raise _Stuck
                    if ro == ROLE_RECV:
                        k = remote[i][0]
                        if not avail[k]:
                            waiting.setdefault(k, []).append(r)
                            blocked_on[r] = k
                            break
                        received[k] = 1
                    else:
                        k = local[i][0]
                        if not done[k]:
                            raise _Stuck  # SEND before the compute that makes the data
                        avail[k] = 1
                        if k in waiting:
                            work.extend(waiting.pop(k))
                    i += 1
                    continue
                for k in local[i]:
                    if not done[k]:
                        raise _Stuck  # made later on this very rank (or never): can never run
                wait = -1
                for k in remote[i]:
                    if lowered:
                        if not received[k]:
                            raise _Stuck  # no RECV before it
                    elif not done[k]:
                        wait = k
                        break
                if wait >= 0:
                    waiting.setdefault(wait, []).append(r)
                    blocked_on[r] = wait
                    break
                for k in makes[i]:
                    if done[k]:
                        raise _Stuck  # made twice
                    done[k] = 1
                    if waiting and not lowered and k in waiting:
                        work.extend(waiting.pop(k))
                i += 1
            ptr[r] = i
    except _Stuck:
        explain(schedule, prog)
        raise ScheduleError(
            f"{schedule.name}: validator bug: a check failed that the static pass does not name"
        ) from None
    counts = prog.counts(done)
    expected = sum(len(schedule.paths[p]) for p in prog.topo.mb_path)
    complete = counts[DepKind.ACT] == expected and counts[DepKind.GRAD] == expected
    stuck = [r for r in range(R) if ptr[r] < len(schedule.actions[r])]
    if stuck or not complete or counts[DepKind.WPEND] != counts[DepKind.WDONE]:
        explain(schedule, prog)  # missing actions explain a stall better than the stall itself
        if not stuck:
            raise ScheduleError(f"{schedule.name}: validator bug: counts differ but the static pass finds nothing")
        raise deadlock(schedule, prog, stuck[0], ptr, blocked_on)


def validate(schedule: Schedule) -> Program:
    """Raise :class:`ScheduleError` unless ``schedule`` is complete, consistent and deadlock-free.

    Returns the schedule's dependency program, marked as validated: a consumer
    given it (``simulate(..., program=)``) skips its own validation.
    """
    with gc_paused():  # 10^5-10^6 small tuples, no cycles
        prog = program_of(schedule)
        if schedule.lowered:
            pairs_of(schedule, prog)
        _dry_run(schedule, prog)
    prog.validated = True
    return prog
