"""Validator and lowering: injected bugs are caught with rank/step/action, comm actions pair up."""

from __future__ import annotations

import dataclasses

import pytest

from dualpipe_kernels.schedules import (
    Action,
    ActionType,
    Schedule,
    ScheduleError,
    build_schedule,
    comm_pairs,
    dependencies,
    lower_comms,
    parse_action,
    parse_actions,
    validate,
)


def _with_rank(s: Schedule, rank: int, text: str) -> Schedule:
    """A copy of ``s`` whose rank ``rank`` runs ``text`` instead."""
    actions = [list(a) for a in s.actions]
    actions[rank] = parse_actions(text)
    return dataclasses.replace(s, actions=actions)


def _fails(s: Schedule, rank: int, step: int, *words: str) -> ScheduleError:
    with pytest.raises(ScheduleError) as info:
        validate(s)
    err = info.value
    msg = str(err)
    assert (err.rank, err.step) == (rank, step), msg
    assert f"rank {rank}, step {step}" in msg
    for w in words:
        assert w in msg, msg
    # The neighbourhood of the rank's list is printed, culprit in brackets.
    assert f"\n  rank {rank}: " in msg
    return err


# ---- valid schedules ------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, ranks, n",
    [("dualpipe", 4, 8), ("dualpipev", 3, 7), ("dualpipev", 1, 2), ("interleaved1f1b", 3, 6), ("zbv", 3, 2)],
)
def test_generated_schedules_validate_before_and_after_lowering(name: str, ranks: int, n: int) -> None:
    s = build_schedule(name, ranks, n)
    validate(s)
    lowered = lower_comms(s)
    assert lowered.lowered and not s.lowered
    validate(lowered)


# ---- injected bugs ------------------------------------------------------------------


def test_b_before_its_f() -> None:
    s = build_schedule("1f1b", 2, 2)  # rank 0: 0F0 0F1 0B0 0B1
    err = _fails(_with_rank(s, 0, "0B0 0F0 0F1 0B1"), 0, 0, "0B0", "before the F of stage 0, micro-batch 0")
    assert err.action == parse_action("0B0")
    assert "[0B0] 0F0" in str(err)


def test_w_before_its_i_and_w_after_full_b() -> None:
    s = build_schedule("zb1p", 2, 2)  # rank 1: 1F0 1I0 1F1 1I1 1W0 1W1
    _fails(_with_rank(s, 1, "1F0 1W0 1I0 1F1 1I1 1W1"), 1, 1, "W comes before the I")
    s = build_schedule("1f1b", 2, 2)
    _fails(_with_rank(s, 1, "1F0 1B0 1W0 1F1 1B1"), 1, 2, "W after a full B")


def test_dropped_actions_are_missing() -> None:
    s = build_schedule("zb1p", 2, 2)
    _fails(_with_rank(s, 1, "1F0 1I0 1F1 1I1 1W0"), 1, 5, "missing W of stage 1, micro-batch 1", "<end>")
    s = build_schedule("dualpipev", 2, 4)
    rank1 = s.to_strings()[1]
    rank1.remove("1F2")  # the activation rank 1 sends on to stage 2 never exists
    err = pytest.raises(ScheduleError, validate, _with_rank(s, 1, " ".join(rank1))).value
    assert err.rank == 1 and "1F2" not in str(err.action)
    assert "F of stage 1, micro-batch 2" in str(err)


def test_duplicate_action() -> None:
    s = build_schedule("1f1b", 2, 2)
    _fails(_with_rank(s, 1, "1F0 1B0 1F1 1B1 1F1"), 1, 4, "second F of stage 1, micro-batch 1 (first at step 2)")


def test_action_on_the_wrong_rank() -> None:
    s = build_schedule("1f1b", 2, 2)
    actions = [list(a) for a in s.actions]
    actions[1].insert(2, actions[0].pop(1))  # 0F1 moves to rank 1
    _fails(dataclasses.replace(s, actions=actions), 1, 2, "0F1", "stage 0 lives on rank 0, not on rank 1")


def test_stage_not_on_the_microbatch_path() -> None:
    s = build_schedule("dualpipe", 2, 4)  # mb 0 goes down stages 0, 1 only
    rank0 = s.to_strings()[0]
    bad = _with_rank(s, 0, " ".join(["3F0"] + rank0))
    _fails(bad, 0, 0, "stage 3 is not on micro-batch 0's path (0, 1)")


def test_cross_rank_deadlock_names_the_cycle() -> None:
    s = build_schedule("gpipe", 2, 2)
    s = _with_rank(s, 0, "0F0 0B0 0F1 0B1")  # waits for 1B0 before sending mb 1 on
    s = _with_rank(s, 1, "1F0 1F1 1B1 1B0")  # needs mb 1 before it does 1B0
    err = _fails(s, 0, 1, "0B0", "deadlock", "rank 1 at step 1 (1F1) waits for the activation of stage 0")
    assert "a cycle" in str(err)
    # The same schedule, lowered: the receives are where the ranks wait.
    with pytest.raises(ScheduleError, match="deadlock") as info:
        validate(lower_comms(s))
    assert info.value.rank == 0 and info.value.action.type is ActionType.RECV_B


def test_same_rank_deadlock_at_the_turn_of_the_v() -> None:
    s = build_schedule("dualpipev", 2, 4)
    rank1 = s.to_strings()[1]  # 1F0 2F0 ...: stage 2 needs stage 1's activation, same rank
    rank1[0], rank1[1] = rank1[1], rank1[0]
    _fails(_with_rank(s, 1, " ".join(rank1)), 1, 0, "2F0", "deadlock", "which this rank computes later, at step 1")


def test_overlap_of_the_same_chunk_rejected() -> None:
    s = build_schedule("1f1b", 1, 1)
    pair = Action.overlap(parse_action("0F0"), parse_action("0B0"))
    bad = dataclasses.replace(s, actions=[[pair]])
    _fails(bad, 0, 0, "cannot overlap")


def test_comm_action_in_compute_only_schedule() -> None:
    s = build_schedule("1f1b", 2, 1)
    _fails(_with_rank(s, 0, "0F0 0SEND_F0 0B0"), 0, 1, "comm action in a compute-only schedule")


# ---- lowered schedules ------------------------------------------------------------


def test_lowering_inserts_comms_around_compute() -> None:
    s = build_schedule("dualpipev", 2, 4)
    low = lower_comms(s)
    r1 = low.to_strings()[1]
    assert r1[:8] == ["1RECV_F0", "1F0", "2F0", "2SEND_F0", "1RECV_F1", "1F1", "2F1", "2SEND_F1"]
    # At the turn of the V both halves of this pair hand over on the same rank: only sends.
    i = r1.index("(2F2;1B0)OVERLAP_F_B")
    assert r1[i - 1 : i + 3] == ["2B0", "(2F2;1B0)OVERLAP_F_B", "2SEND_F2", "1SEND_B0"]
    # DualPipe rank 1: both receives before the pair (F's, then B's), both sends after.
    d1 = lower_comms(build_schedule("dualpipe", 4, 8)).to_strings()[1]
    i = d1.index("(6F6;1B0)OVERLAP_F_B")
    assert d1[i - 2 : i + 3] == ["6RECV_F6", "1RECV_B0", "(6F6;1B0)OVERLAP_F_B", "6SEND_F6", "1SEND_B0"]
    peers = {a.peer for a in low.actions[1] if a.is_comm}
    assert peers == {0}
    # Compute order is untouched.
    assert [a for a in low.actions[1] if a.is_compute] == s.actions[1]


def test_single_rank_v_has_no_comm() -> None:
    low = lower_comms(build_schedule("dualpipev", 1, 4))
    assert not any(a.is_comm for a in low.actions[0])
    assert comm_pairs(low) == []


@pytest.mark.parametrize("name, ranks, n", [("dualpipe", 4, 8), ("dualpipev", 3, 6), ("interleaved1f1b", 2, 4)])
def test_every_send_has_its_receive(name: str, ranks: int, n: int) -> None:
    s = build_schedule(name, ranks, n)
    low = lower_comms(s)
    pairs = comm_pairs(low)
    n_comm = sum(1 for acts in low.actions for a in acts if a.is_comm)
    assert 2 * len(pairs) == n_comm
    for p in pairs:
        send = low.actions[p.send_rank][p.send_index]
        recv = low.actions[p.recv_rank][p.recv_index]
        assert send.peer == p.recv_rank and recv.peer == p.send_rank
        assert send.microbatch == recv.microbatch
        kind = {ActionType.SEND_F: ActionType.RECV_F, ActionType.SEND_B: ActionType.RECV_B}[send.type]
        assert recv.type is kind
        expected_recv_stage = (
            s.next_stage(send.stage, send.microbatch)
            if send.type is ActionType.SEND_F
            else s.prev_stage(send.stage, send.microbatch)
        )
        assert recv.stage == expected_recv_stage


def test_lowered_bugs_are_caught() -> None:
    low = lower_comms(build_schedule("1f1b", 2, 2))
    r0 = low.to_strings()[0]  # 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1
    # A receive dropped: its send has no partner.
    acts = [list(a) for a in low.actions]
    del acts[0][r0.index("0RECV_B0")]
    with pytest.raises(ScheduleError, match="no matching receive") as info:
        validate(dataclasses.replace(low, actions=acts))
    assert info.value.rank == 1 and info.value.action.type is ActionType.SEND_B
    # A send moved before the compute that makes its data.
    acts = [list(a) for a in low.actions]
    acts[0][0], acts[0][1] = acts[0][1], acts[0][0]
    with pytest.raises(ScheduleError, match="sends the activation of stage 0, micro-batch 0 before computing it"):
        validate(dataclasses.replace(low, actions=acts))
    # A wrong peer.
    acts = [list(a) for a in low.actions]
    acts[0][1] = Action(ActionType.SEND_F, 0, 0, (), 5)
    with pytest.raises(ScheduleError, match="peer is 5, but stage 1 lives on rank 1"):
        validate(dataclasses.replace(low, actions=acts))
    # A receive placed after the compute that needs it.
    acts = [list(a) for a in low.actions]
    acts[1][0], acts[1][1] = acts[1][1], acts[1][0]
    with pytest.raises(ScheduleError, match="no RECV for it before this step") as info:
        validate(dataclasses.replace(low, actions=acts))
    assert (info.value.rank, info.value.step) == (1, 0)


def test_lower_twice_is_an_error() -> None:
    low = lower_comms(build_schedule("1f1b", 2, 2))
    with pytest.raises(ValueError, match="already lowered"):
        lower_comms(low)


# ---- dependency rules ------------------------------------------------------------------


def test_dependencies() -> None:
    s = build_schedule("dualpipev", 2, 4)  # path 0 1 2 3; W deferred as I on some chunks
    assert dependencies(s, parse_action("0F1")) == []
    assert dependencies(s, parse_action("2F1")) == [parse_action("1F1")]
    assert dependencies(s, parse_action("3B1")) == [parse_action("3F1")]  # loss stage
    assert dependencies(s, parse_action("1B0")) == [parse_action("1F0"), parse_action("2B0")]
    assert dependencies(s, parse_action("2I3")) == [parse_action("2F3"), parse_action("3B3")]
    assert dependencies(s, parse_action("0W2")) == [parse_action("0I2")]
    pair = parse_action("(2F2;1B0)OVERLAP_F_B")
    assert dependencies(s, pair) == [parse_action("1F2"), parse_action("1F0"), parse_action("2B0")]


def _with_entry(s: Schedule, rank: int, step: int, entry: object) -> Schedule:
    actions = [list(a) for a in s.actions]
    actions[rank][step] = entry  # type: ignore[call-overload]
    return dataclasses.replace(s, actions=actions)


F = ActionType.F


@pytest.mark.parametrize("lowered", [False, True])
@pytest.mark.parametrize(
    "entry,field",
    [
        ("0F0", "not an Action"),
        (None, "not an Action"),
        (3, "not an Action"),
        (Action(F, "0", 0), "stage"),  # type: ignore[arg-type]
        (Action(F, 0, "0"), "microbatch"),  # type: ignore[arg-type]
        (Action(F, 0, 0.0), "microbatch"),  # type: ignore[arg-type]
        (Action(F, -1, 0), "stage"),
        (Action("F", 0, 0), "ActionType"),  # type: ignore[arg-type]
        (Action(ActionType.OVERLAP_F_B, 0, 0, (None, None)), "sub-action 0"),  # type: ignore[arg-type]
    ],
)
@pytest.mark.parametrize("where", [(0, 0), (1, 3)])
def test_a_malformed_entry_is_blamed_at_its_rank_and_step(lowered, entry, field, where) -> None:
    s = build_schedule("1f1b", 2, 4)
    if lowered:
        s = lower_comms(s)
    rank, step = where
    with pytest.raises(ScheduleError) as e:
        validate(_with_entry(s, rank, step, entry))
    assert (e.value.rank, e.value.step) == (rank, step), str(e.value)
    first = str(e.value).splitlines()[0]
    assert f"rank {rank}, step {step}" in first and field in first, first
