"""Simulator semantics on small hand-built schedules: comm costs, blocking, links, costs, critical path."""

from __future__ import annotations

import dataclasses
import io
import json
import math
from fractions import Fraction

import pytest

from dualpipe_kernels.schedules.costs import CommModel, CostModel
from dualpipe_kernels.schedules.ir import Schedule, parse_actions
from dualpipe_kernels.schedules.simulator import simulate


def two_rank_1f1b() -> Schedule:
    """1F1B on 2 ranks, 2 micro-batches, lowered by hand (RECV before its consumer, SEND after its producer)."""
    r0 = parse_actions("0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1")
    r1 = parse_actions("1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1")
    return Schedule("1f1b", 2, 2, (0, 1), ((0, 1),), (0, 0), [r0, r1], lowered=True)


COSTS = CostModel(f=1, b=2, w=1)


def test_zero_comm_1f1b_by_hand() -> None:
    # rank0: F0[0,1] F1[1,2] B0[4,6] B1[7,9]; rank1: F0[1,2] B0[2,4] F1[4,5] B1[5,7]
    res = simulate(two_rank_1f1b(), COSTS)
    assert res.makespan == 9
    assert res.busy_per_rank == [6, 6]
    assert res.bubble == 3 and res.bubble_per_rank == [3, 3]
    assert res.bubble_ratio == pytest.approx(3 / 9)
    assert res.peak_activations_per_rank == [2, 1]
    assert res.params_per_rank == 1 and res.params_by_rank == [1, 1]
    assert res.num_transfers == 4 and res.p2p_bytes == 0
    starts = {(e.rank, e.action): (e.start, e.end) for e in res.events}
    assert starts[(0, "0B0")] == (4, 6) and starts[(0, "0B1")] == (7, 9)
    assert starts[(1, "1F1")] == (4, 5) and starts[(1, "1B1")] == (5, 7)


def test_latency_async_vs_blocking() -> None:
    lat = Fraction(1, 2)
    # async: each of the 2 hops on the critical path (0F0 -> 1F0, 1B1 -> 0B1) adds L: 9 + 2L
    res = simulate(two_rank_1f1b(), COSTS, CommModel(latency=lat))
    assert res.makespan == 9 + 2 * lat
    assert res.comm_blocked_per_rank == [0, 0]
    # blocking: rank 1 also stalls L after sending 1B0, delaying 1F1/1B1: 9 + 3L
    res = simulate(two_rank_1f1b(), COSTS, CommModel(latency=lat, blocking=True))
    assert res.makespan == 9 + 3 * lat
    assert res.comm_blocked_per_rank == [2 * lat, 2 * lat]
    assert res.busy_per_rank == [6, 6]  # blocked time is idle, not busy
    assert res.bubble == 3 + 3 * lat


def test_bandwidth_occupies_link() -> None:
    # 4 bytes at 2 B/s: each transfer holds its link 2.  0SEND_F1 waits for 0SEND_F0 to leave the link:
    # rank0 sends at 1 ([1,3]) and at 2 ([3,5]); rank1 F0[3,4] B0[4,6], 1SEND_B0 [6,8], F1[6,7] B1[7,9],
    # 1SEND_B1 waits for the 1->0 link until 8: [9,11]; rank0 B0[8,10] B1[11,13].
    res = simulate(two_rank_1f1b(), COSTS, CommModel(activation_bytes=4, bandwidth=2))
    assert res.makespan == 13
    sends = {e.action: (e.start, e.end) for e in res.events if e.kind.startswith("SEND")}
    assert sends == {"0SEND_F0": (1, 3), "0SEND_F1": (3, 5), "1SEND_B0": (6, 8), "1SEND_B1": (9, 11)}
    assert res.p2p_bytes == 16 and res.num_transfers == 4


def test_latency_is_not_link_occupancy() -> None:
    # latency 10 and zero bytes: transfers pipeline on the link, both forward sends arrive 10 after leaving.
    res = simulate(two_rank_1f1b(), COSTS, CommModel(latency=10))
    sends = {e.action: (e.start, e.end) for e in res.events if e.kind == "SEND_F"}
    assert sends == {"0SEND_F0": (1, 11), "0SEND_F1": (2, 12)}


def test_intra_vs_inter_node() -> None:
    intra = CommModel(latency=1, inter_latency=5, ranks_per_node=2)
    inter = CommModel(latency=1, inter_latency=5, ranks_per_node=1)
    assert simulate(two_rank_1f1b(), COSTS, intra).makespan == 9 + 2 * 1
    assert simulate(two_rank_1f1b(), COSTS, inter).makespan == 9 + 2 * 5
    bw = CommModel(activation_bytes=8, bandwidth=8, inter_bandwidth=2, ranks_per_node=1)
    assert bw.link_time(0, 1) == (4, 0)
    assert bw.link_time(0, 0) == (1, 0)


def test_critical_path_is_a_chain_from_zero_to_makespan() -> None:
    res = simulate(two_rank_1f1b(), COSTS, CommModel(latency=Fraction(1, 4)))
    path = res.critical_path
    assert path[0].start == 0 and path[-1].end == res.makespan
    for prev, cur in zip(path, path[1:], strict=False):
        # each event is ready when the previous one ends: a compute or send starts then,
        # a recv completes then (it may have been posted earlier)
        assert (cur.end if cur.kind.startswith("RECV") else cur.start) == prev.end
    actions = [e.action for e in path]
    assert actions[0] == "0F0" and actions[-1] == "0B1"
    assert "1SEND_B1" in actions and "0SEND_F0" in actions


def test_per_stage_costs_and_model_stage_indexing() -> None:
    res = simulate(two_rank_1f1b(), CostModel(f=[1, 3], b=[2, 4], w=[1, 1]))
    # rank0 F0[0,1] F1[1,2]; rank1 F0[1,4] B0[4,8]; rank0 B0[8,10]; rank1 F1[8,11] B1[11,15]; rank0 B1[15,17]
    assert res.makespan == 17
    assert res.busy_per_rank == [6, 14]
    with pytest.raises(ValueError, match="per-stage cost F has 3 entries"):
        simulate(two_rank_1f1b(), CostModel(f=[1, 2, 3]))


def test_overlap_pair_costs_and_activations() -> None:
    # one rank, two stages (both local, no comm): 0F0 1F0 then pair (0F1; 1B0), then 1B1 0B0 ... by hand
    acts = parse_actions("0F0 1F0 (0F1;1B0)OVERLAP_F_B 1F1 1B1 0B0 0I1 0W1")
    s = Schedule("v1", 1, 2, (0, 0), ((0, 1),), (0, 0), [acts], lowered=True)
    res = simulate(s, CostModel(f=2, b=5, w=2, fb=6))
    # F F (pair=6) F B B I W = 2+2+6+2+5+5+3+2
    assert res.makespan == 27 and res.bubble == 0
    # live: F->1, F->2, pair: F counts first -> 3 then B frees -> 2, F->3, B->2, B->1, I->0
    assert res.peak_activations_per_rank == [3]
    assert res.params_by_rank == [2]
    # a pair whose backward half is an I costs F&B - W
    acts = parse_actions("0F0 1F0 (0F1;1I0)OVERLAP_F_B 1W0 1F1 1B1 0B0 0B1")
    s = Schedule("v1", 1, 2, (0, 0), ((0, 1),), (0, 0), [acts], lowered=True)
    assert simulate(s, CostModel(f=2, b=5, w=2, fb=6)).makespan == 2 + 2 + 4 + 2 + 2 + 5 + 5 + 5


@pytest.mark.parametrize(
    ("costs", "message"),
    [
        (CostModel(f=0), "F must be > 0"),
        (CostModel(f=-1), "F must be > 0"),
        (CostModel(b=0), "B must be > 0"),
        (CostModel(w=0), "W must be > 0"),
        (CostModel(b=2, w=2), "W must be < B"),
        (CostModel(b=2, w=3), "W must be < B"),
        (CostModel(f=1, b=2, fb=4), "F&B must satisfy"),
        (CostModel(f=1, b=2, fb=1.5), "F&B must satisfy"),
        (CostModel(f=[1, -1]), "F must be > 0"),
    ],
)
def test_cost_validation(costs: CostModel, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        simulate(two_rank_1f1b(), costs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"latency": -1}, "latency must be >= 0"),
        ({"bandwidth": 0}, "bandwidth must be > 0"),
        ({"inter_bandwidth": -5}, "inter_bandwidth must be > 0"),
        ({"activation_bytes": -1}, "activation_bytes must be >= 0"),
        ({"ranks_per_node": 0}, "ranks_per_node must be >= 1"),
    ],
)
def test_comm_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CommModel(**kwargs)


def test_deadlock_names_rank_step_and_action() -> None:
    # both ranks receive first: nobody ever sends
    r0 = parse_actions("0RECV_B0 0F0 0SEND_F0 0B0")
    r1 = parse_actions("1RECV_F0 1F0 1B0 1SEND_B0")
    s = Schedule("bad", 2, 1, (0, 1), ((0, 1),), (0,), [r0, r1], lowered=True)
    # simulate validates first: the validator names the wait-for cycle
    with pytest.raises(
        ValueError, match=r"deadlock: rank 0 at step 0 \(0RECV_B0\) .* rank 1 at step 0 \(1RECV_F0\) .* a cycle"
    ):
        simulate(s)


def test_to_dict_is_json_and_exact_for_ints() -> None:
    res = simulate(two_rank_1f1b(), COSTS, CommModel(activation_bytes=4, bandwidth=math.inf))
    d = json.loads(json.dumps(res.to_dict(events=True)))
    assert d["makespan"] == 9 and d["bubble"] == 3 and d["p2p_bytes"] == 16
    assert d["peak_activations"] == 2 and d["params_per_rank"] == 1
    assert len(d["events"]) == 16
    assert d["critical_path"][0] == "0F0"


def test_deadlock_in_compute_only_schedule() -> None:
    # rank 1 runs micro-batch 1 before 0, rank 0 sends 0 first and waits for its gradient: a cross-rank cycle
    r0 = parse_actions("0F0 0B0 0F1 0B1")
    r1 = parse_actions("1F1 1B1 1F0 1B0")
    s = Schedule("cycle", 2, 2, (0, 1), ((0, 1),), (0, 0), [r0, r1])
    with pytest.raises(ValueError, match=r"deadlock: rank 0 at step 1 \(0B0\) .* rank 1 at step 0 \(1F1\)"):
        simulate(s)


def test_compute_only_and_hand_lowered_agree() -> None:
    r0 = parse_actions("0F0 0F1 0B0 0B1")
    r1 = parse_actions("1F0 1B0 1F1 1B1")
    s = Schedule("1f1b", 2, 2, (0, 1), ((0, 1),), (0, 0), [r0, r1])
    for comm in (
        CommModel(),
        CommModel(latency=Fraction(1, 2), blocking=True),
        CommModel(activation_bytes=4, bandwidth=2),
    ):
        direct, by_hand = simulate(s, COSTS, comm), simulate(two_rank_1f1b(), COSTS, comm)
        assert (direct.makespan, direct.busy_per_rank, direct.comm_blocked_per_rank) == (
            by_hand.makespan,
            by_hand.busy_per_rank,
            by_hand.comm_blocked_per_rank,
        )
        assert [e.action for e in direct.events] == [e.action for e in by_hand.events]  # lowering = the hand version


def test_lowered_csv_round_trip_simulates_the_same() -> None:
    from dualpipe_kernels.schedules import build_schedule, load_csv, lower_comms, to_csv

    sched = build_schedule("dualpipev", 3, 7)
    buf = io.StringIO()
    to_csv(lower_comms(sched), buf, include_comms=True)
    buf.seek(0)
    loaded = load_csv(buf, name="dualpipev")
    assert loaded.lowered
    comm = CommModel(latency=1, activation_bytes=2, bandwidth=1)
    expected = simulate(sched, COSTS, comm).to_dict()
    assert simulate(loaded, COSTS, comm).to_dict() == expected
    # without peers (not part of the string form) the simulator derives them from the stage placement
    loaded.actions = [[dataclasses.replace(a, peer=None) for a in acts] for acts in loaded.actions]
    assert simulate(loaded, COSTS, comm).to_dict() == expected
