"""Property tests: every generator over its valid range validates, lowers and pairs its comms;
the validator's verdict on mutated schedules agrees with a naive, independent checker."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dualpipe_kernels.schedules import (
    SCHEDULE_NAMES,
    ActionType,
    Schedule,
    ScheduleError,
    build_schedule,
    comm_pairs,
    lower_comms,
    validate,
)

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def valid_args(draw: st.DrawFn, name: str) -> tuple[str, int, int, int | None]:
    """(name, ranks, micro-batches, stages_per_rank) in the generator's valid range (ranks <= 16, N <= 64)."""
    if name == "dualpipe":
        ranks = draw(st.integers(1, 8)) * 2
        n = draw(st.integers(ranks, 32)) * 2
        return name, ranks, n, None
    if name == "dualpipev":
        ranks = draw(st.integers(1, 16))
        return name, ranks, draw(st.integers(2 * ranks, 64)), None
    if name == "interleaved1f1b":
        ranks = draw(st.integers(1, 16))
        n = ranks * draw(st.integers(1, 64 // ranks))
        return name, ranks, n, draw(st.integers(1, 4))
    return name, draw(st.integers(1, 16)), draw(st.integers(1, 64)), None


def _cross_rank_edges(s: Schedule) -> int:
    """Transfers the schedule implies: each hop of a path between two ranks, once forward, once backward."""
    hops = 0
    for m in range(s.num_microbatches):
        p = s.path(m)
        hops += sum(1 for a, b in zip(p, p[1:], strict=False) if s.stage_to_rank[a] != s.stage_to_rank[b])
    return 2 * hops


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_every_generator_validates_and_pairs_its_comms(name: str) -> None:
    @SETTINGS
    @given(valid_args(name))
    def check(args: tuple[str, int, int, int | None]) -> None:
        _check_generated(*args)

    check()


def _check_generated(name: str, ranks: int, n: int, v: int | None) -> None:
    s = build_schedule(name, ranks, n, v)
    validate(s)
    low = lower_comms(s)
    validate(low)
    pairs = comm_pairs(low)
    assert len(pairs) == _cross_rank_edges(s)
    assert 2 * len(pairs) == sum(1 for acts in low.actions for a in acts if a.is_comm)
    assert all(low.actions[p.send_rank][p.send_index].peer == p.recv_rank for p in pairs)
    assert all(low.actions[p.recv_rank][p.recv_index].peer == p.send_rank for p in pairs)
    assert naive_ok(s)


# ---- an independent checker ---------------------------------------------------------------


def naive_ok(s: Schedule) -> bool:
    """Valid iff placement and counts are right and a round-robin run in list order finishes.

    Written from the rules alone (Schedule.prev_stage/next_stage, no shared code
    with the validator) and quadratic, so only for small cases.
    """
    count: Counter[tuple[str, int, int]] = Counter()
    for r, acts in enumerate(s.actions):
        for a in acts:
            if a.is_comm:
                return False
            halves = a.computes()
            if len(halves) == 2 and (halves[0].stage, halves[0].microbatch) == (halves[1].stage, halves[1].microbatch):
                return False
            for c in halves:
                if not 0 <= c.microbatch < s.num_microbatches or c.stage not in s.path(c.microbatch):
                    return False
                if s.stage_to_rank[c.stage] != r:
                    return False
                count[(c.type.value, c.stage, c.microbatch)] += 1
    for m in range(s.num_microbatches):
        for st_ in s.path(m):
            f, b, i, w = (count[(k, st_, m)] for k in "FBIW")
            if f != 1 or (b, i, w) not in ((1, 0, 0), (0, 1, 1)):
                return False
    done: set[tuple[str, int, int]] = set()

    def ready(c) -> bool:  # type: ignore[no-untyped-def]
        m = c.microbatch
        if c.type is ActionType.F:
            prev = s.prev_stage(c.stage, m)
            return prev is None or ("F", prev, m) in done
        if c.type in (ActionType.B, ActionType.I):
            nxt = s.next_stage(c.stage, m)
            return ("F", c.stage, m) in done and (nxt is None or ("G", nxt, m) in done)
        return ("I", c.stage, m) in done

    ptr = [0] * s.num_ranks
    progress = True
    while progress:
        progress = False
        for r, acts in enumerate(s.actions):
            while ptr[r] < len(acts) and all(ready(c) for c in acts[ptr[r]].computes()):
                for c in acts[ptr[r]].computes():
                    if c.type is ActionType.F:
                        done.add(("F", c.stage, c.microbatch))
                    elif c.type is ActionType.W:
                        pass
                    else:
                        done.add(("G", c.stage, c.microbatch))
                        if c.type is ActionType.I:
                            done.add(("I", c.stage, c.microbatch))
                ptr[r] += 1
                progress = True
    return all(ptr[r] == len(acts) for r, acts in enumerate(s.actions))


@st.composite
def mutated(draw: st.DrawFn) -> Schedule:
    """A small valid schedule with one random edit: swap, move to another rank, drop or duplicate."""
    name = draw(st.sampled_from(["dualpipe", "dualpipev", "1f1b", "interleaved1f1b", "zb1p", "zbv"]))
    if name == "dualpipe":
        ranks = draw(st.sampled_from([2, 4]))
        n = draw(st.integers(ranks, ranks + 2)) * 2
    elif name == "dualpipev":
        ranks = draw(st.integers(1, 3))
        n = draw(st.integers(2 * ranks, 2 * ranks + 3))
    elif name == "interleaved1f1b":
        ranks = draw(st.integers(1, 3))
        n = ranks * draw(st.integers(1, 3))
    else:
        ranks, n = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    s = build_schedule(name, ranks, n)
    actions = [list(a) for a in s.actions]
    r = draw(st.integers(0, ranks - 1))
    row = actions[r]
    i = draw(st.integers(0, len(row) - 1))
    edit = draw(st.sampled_from(["swap", "swap_near", "move", "drop", "dup"]))
    if edit == "swap":
        j = draw(st.integers(0, len(row) - 1))
        row[i], row[j] = row[j], row[i]
    elif edit == "swap_near" and i + 1 < len(row):
        row[i], row[i + 1] = row[i + 1], row[i]
    elif edit == "move":
        other = actions[draw(st.integers(0, ranks - 1))]
        a = row.pop(i)
        other.insert(draw(st.integers(0, len(other))), a)
    elif edit == "drop":
        row.pop(i)
    elif edit == "dup":
        row.insert(draw(st.integers(0, len(row))), row[i])
    return dataclasses.replace(s, actions=actions)


@settings(max_examples=300, deadline=None)
@given(mutated())
def test_validator_agrees_with_naive_checker(s: Schedule) -> None:
    expected = naive_ok(s)
    event(f"valid={expected}")
    try:
        validate(s)
        verdict = True
    except ScheduleError as e:
        verdict = False
        assert "validator bug" not in str(e)
        assert e.rank is not None and e.step is not None
        assert f"rank {e.rank}, step {e.step}" in str(e)
    assert verdict == expected, str(s)
    if expected:
        validate(lower_comms(s))


@st.composite
def mutated_lowered(draw: st.DrawFn) -> Schedule:
    """A lowered small schedule with one random swap, move or drop (comm actions included)."""
    s = draw(st.sampled_from([("dualpipe", 2, 4), ("dualpipev", 2, 5), ("1f1b", 3, 3), ("zbv", 2, 3)]))
    low = lower_comms(build_schedule(*s))
    actions = [list(a) for a in low.actions]
    r = draw(st.integers(0, low.num_ranks - 1))
    row = actions[r]
    i = draw(st.integers(0, len(row) - 1))
    edit = draw(st.sampled_from(["swap", "move", "drop"]))
    if edit == "swap":
        j = draw(st.integers(0, len(row) - 1))
        row[i], row[j] = row[j], row[i]
    elif edit == "move":
        other = actions[draw(st.integers(0, low.num_ranks - 1))]
        other.insert(draw(st.integers(0, len(other))), row.pop(i))
    else:
        row.pop(i)
    return dataclasses.replace(low, actions=actions)


@settings(max_examples=200, deadline=None)
@given(mutated_lowered())
def test_lowered_mutations_are_caught_or_sound(s: Schedule) -> None:
    try:
        validate(s)
    except ScheduleError as e:
        assert "validator bug" not in str(e)
        assert e.rank is not None and e.step is not None
        event("rejected")
        return
    event("accepted")
    # Accepted: its compute order is valid on its own and lowering it again gives the same comms.
    compute_only = dataclasses.replace(s, actions=[[a for a in r if a.is_compute] for r in s.actions], lowered=False)
    assert naive_ok(compute_only)
    assert len(comm_pairs(s)) == len(comm_pairs(lower_comms(compute_only)))
