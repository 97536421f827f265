"""docs/architecture.md's reference table, reproduced by simulation as exact equalities.

Regime of the table (stated once, used by every test here): uniform stages,
zero communication cost, F = B - W (so I = F), B <= F&B <= F + B.  Costs are
small integers so every sum is exact.  Bubble = max over ranks of
(makespan - busy); activations and parameters in units of one stage chunk.
PP is the number of pipeline stages of the model: ranks for 1F1B, ZB1P and
DualPipe; 2 * ranks for DualPipeV (two chunks per rank in a V).
"""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dualpipe_kernels.schedules import build_schedule
from dualpipe_kernels.schedules.costs import CommModel, CostModel
from dualpipe_kernels.schedules.simulator import SimResult, simulate


def n_range(minimum: int, step: int = 1) -> list[int]:
    """Micro-batch counts from the minimum to 10x it: min, min+1, min+2, 2x, 10x (rounded to ``step``)."""
    ns = {minimum, minimum + step, minimum + 2 * step, 2 * minimum, 10 * minimum}
    return sorted(n for n in ns if n % step == 0)


# (F, B, W) with F = B - W, and the F&B values swept from B to F + B.
DUAL_COSTS = [(3, 5, 2, fb) for fb in (5, 6, 7, 8)] + [(5, 6, 1, 6), (5, 6, 1, 9), (5, 6, 1, 11)]


def dual_costs_for(ranks: int) -> list[tuple[int, int, int, int]]:
    # every F&B value for small pipes, a rotating pair of them for larger ones (keeps the sweep fast)
    if ranks <= 4:
        return DUAL_COSTS
    return [DUAL_COSTS[ranks % len(DUAL_COSTS)], DUAL_COSTS[(ranks + 3) % len(DUAL_COSTS)]]


@pytest.mark.parametrize("ranks", range(1, 17))
def test_1f1b_bubble_activations_params(ranks: int) -> None:
    # Holds for every N >= 1 (no regime beyond the table's); peak activations PP needs N >= PP.
    for f, b, w in ((1, 2, 1), (3, 5, 2), (2, 7, 3)):
        for n in n_range(1) + [ranks, ranks + 1, ranks + 2, 10 * ranks]:
            res = simulate(build_schedule("1f1b", ranks, n), CostModel(f=f, b=b, w=w))
            assert res.bubble == (ranks - 1) * (f + b), (ranks, n, f, b)
            assert res.bubble_per_rank == [(ranks - 1) * (f + b)] * ranks
            # rank r keeps PP - r activations alive at most (PP on rank 0), fewer when N is smaller
            assert res.peak_activations_per_rank == [min(ranks - r, n) for r in range(ranks)]
            assert res.params_per_rank == 1
    assert simulate(build_schedule("1f1b", ranks, 10 * ranks)).peak_activations == ranks


@pytest.mark.parametrize("ranks", range(1, 17))
def test_zb1p_bubble(ranks: int) -> None:
    # Regime: F = B - W = W (the ZB-H1 paper's setting) and N >= PP (a full steady state);
    # below that the deferred W's cannot all land in the cool-down.
    f = w = 2
    b = 4
    for n in n_range(ranks):
        res = simulate(build_schedule("zb1p", ranks, n), CostModel(f=f, b=b, w=w))
        assert res.bubble == (ranks - 1) * (f + b - 2 * w), (ranks, n)
        assert res.peak_activations == ranks  # as 1F1B
        assert res.params_per_rank == 1


@pytest.mark.parametrize("ranks", range(2, 17, 2))
def test_dualpipe_bubble_activations_params(ranks: int) -> None:
    # DualPipe with PP = ranks: even ranks, even N >= 2 * ranks.
    for f, b, w, fb in dual_costs_for(ranks):
        assert f == b - w and b <= fb <= f + b
        for n in n_range(2 * ranks, step=2):
            res = simulate(build_schedule("dualpipe", ranks, n), CostModel(f=f, b=b, w=w, fb=fb))
            assert res.bubble == (ranks // 2 - 1) * (fb + b - 3 * w), (ranks, n, fb)
            assert res.peak_activations_per_rank == [ranks + 1] * ranks, (ranks, n)
            assert res.params_per_rank == 2 and res.params_by_rank == [2] * ranks


@pytest.mark.parametrize("ranks", range(1, 17))
def test_dualpipev_bubble_activations_params(ranks: int) -> None:
    # DualPipeV with R ranks holds PP = 2R stages; the table's (PP/2 - 1) is (R - 1).  N >= 2R.
    pp = 2 * ranks
    for f, b, w, fb in dual_costs_for(ranks):
        for n in n_range(2 * ranks):
            res = simulate(build_schedule("dualpipev", ranks, n), CostModel(f=f, b=b, w=w, fb=fb))
            assert res.bubble == (ranks - 1) * (fb + b - 3 * w), (ranks, n, fb)
            assert res.peak_activations_per_rank == [pp + 1] * ranks, (ranks, n)
            assert res.params_per_rank == 2 and res.params_by_rank == [2] * ranks


def test_fractional_costs_stay_exact() -> None:
    # Same formulas with Fraction costs (non-dyadic): the simulator only adds and compares.
    f, w = Fraction(1, 3), Fraction(1, 7)
    b, fb = f + w, f + w + Fraction(1, 5)
    res = simulate(build_schedule("dualpipev", 4, 8), CostModel(f=f, b=b, w=w, fb=fb))
    assert res.bubble == 3 * (fb + b - 3 * w)
    res = simulate(build_schedule("dualpipe", 6, 24), CostModel(f=f, b=b, w=w, fb=fb))
    assert res.bubble == 2 * (fb + b - 3 * w)


def test_bubble_ordering_at_equal_stage_count() -> None:
    # With PP = 8 stages and the costs of the table's regime: DualPipe(V) < ZB1P < 1F1B, the paper's ordering.
    f, b, w, fb = 2, 4, 2, 5
    costs = CostModel(f=f, b=b, w=w, fb=fb)
    one = simulate(build_schedule("1f1b", 8, 32), costs).bubble
    zb = simulate(build_schedule("zb1p", 8, 32), costs).bubble
    dual = simulate(build_schedule("dualpipe", 8, 32), costs).bubble
    dualv = simulate(build_schedule("dualpipev", 4, 32), costs).bubble  # 8 stages on 4 ranks
    assert dual == dualv == 3 * (fb + b - 3 * w) < zb == 7 * (f + b - 2 * w) < one == 7 * (f + b)


# ---- other schedules: sanity ---------------------------------------------------------------


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 8])
def test_gpipe(ranks: int) -> None:
    f, b, w = 2, 4, 1
    for n in (1, ranks, 3 * ranks):
        res = simulate(build_schedule("gpipe", ranks, n), CostModel(f=f, b=b, w=w))
        assert res.bubble == (ranks - 1) * (f + b)  # same fill/drain bubble as 1F1B ...
        assert res.peak_activations_per_rank == [n] * ranks  # ... but every micro-batch's activation is held
        assert res.makespan == (n + ranks - 1) * (f + b)


@pytest.mark.parametrize(("ranks", "v"), [(2, 2), (4, 2), (4, 3), (3, 4)])
def test_interleaved_1f1b(ranks: int, v: int) -> None:
    # Chunk costs are 1/V of a full stage's: the bubble is (R-1)(F+B) per chunk, i.e. 1F1B's divided by V.
    f, b, w = 2, 4, 1
    for n in (ranks, 2 * ranks, 4 * ranks):
        res = simulate(build_schedule("interleaved1f1b", ranks, n, v), CostModel(f=f, b=b, w=w))
        assert res.bubble == (ranks - 1) * (f + b), (ranks, v, n)
        assert res.params_per_rank == v
        assert res.stages == ranks * v


@pytest.mark.parametrize("ranks", [1, 2, 4, 6])
def test_zbv_beats_interleaved_and_holds_two_chunks(ranks: int) -> None:
    f, b, w = 2, 4, 2
    for n in (2 * ranks, 4 * ranks):
        costs = CostModel(f=f, b=b, w=w)
        zbv = simulate(build_schedule("zbv", ranks, n), costs)
        inter = simulate(build_schedule("interleaved1f1b", ranks, n, 2), costs)
        assert zbv.params_by_rank == [2] * ranks
        assert zbv.bubble <= inter.bubble
        if ranks > 1:
            assert 0 < zbv.bubble < (ranks - 1) * (f + b)
        assert sum(zbv.busy_per_rank) == 2 * n * ranks * (f + b)  # every chunk's F, I and W, once


@pytest.mark.parametrize("name", ["dualpipe", "dualpipev", "1f1b", "gpipe", "interleaved1f1b", "zb1p", "zbv"])
@pytest.mark.parametrize(
    "comm",
    [
        CommModel(),
        CommModel(latency=Fraction(1, 2)),
        CommModel(latency=1, activation_bytes=3, bandwidth=2),
        CommModel(latency=1, activation_bytes=3, bandwidth=2, blocking=True),
        CommModel(
            latency=Fraction(1, 4),
            inter_latency=3,
            activation_bytes=4,
            bandwidth=8,
            inter_bandwidth=1,
            ranks_per_node=2,
        ),
    ],
    ids=["free", "latency", "bandwidth", "blocking", "two-nodes"],
)
def test_direct_and_lowered_engines_agree(name: str, comm: CommModel) -> None:
    """The inline-comm engine (compute-only input) and the lowered walk give identical numbers."""
    ranks, n = (4, 8)
    sched = build_schedule(name, ranks, n)
    costs = CostModel(f=3, b=5, w=2, fb=6)
    direct = simulate(sched, costs, comm)
    lowered = direct.lowered_result()  # what simulate(lower_comms(sched)) returns
    for key in (
        "makespan",
        "busy_per_rank",
        "bubble_per_rank",
        "peak_activations_per_rank",
        "p2p_bytes",
        "num_transfers",
        "comm_blocked_per_rank",
        "params_by_rank",
    ):
        assert getattr(direct, key) == getattr(lowered, key), key
    # the replayed timeline has every compute action once and one SEND per counted transfer
    events = direct.events
    assert sum(e.track == "compute" for e in events) == sum(len(a) for a in sched.actions)
    assert sum(e.kind.startswith("SEND") for e in events) == direct.num_transfers
    assert max(e.end for e in events) == direct.makespan
    assert direct.critical_path[0].start == 0 and direct.critical_path[-1].end == direct.makespan


def assert_critical_chain(res: SimResult) -> None:
    """Each critical-path event is ready when the previous one ends, from time 0 to the makespan."""
    path = res.critical_path
    assert path[0].start == 0 and path[-1].end == res.makespan
    for prev, cur in zip(path, path[1:], strict=False):
        if (
            cur.kind.startswith("SEND")
            and prev.kind.startswith("SEND")
            and (cur.rank, cur.peer) == (prev.rank, prev.peer)
        ):
            # queued behind the previous transfer on its link: starts when that one leaves the link
            # (at the same instant when the earlier transfer occupies the link for zero time)
            assert prev.start <= cur.start <= prev.end, (prev, cur)
            continue
        assert (cur.end if cur.kind.startswith("RECV") else cur.start) == prev.end, (prev, cur)


@pytest.mark.parametrize("name", ["dualpipe", "dualpipev", "1f1b", "zb1p", "zbv"])
def test_critical_path_on_generated_schedules(name: str) -> None:
    sched = build_schedule(name, 4, 12)
    for comm in (CommModel(), CommModel(latency=1, activation_bytes=2, bandwidth=1, blocking=True)):
        res = simulate(sched, CostModel(f=3, b=5, w=2, fb=6), comm)
        assert_critical_chain(res)
        # a chain of back-to-back events can be no longer than the makespan, and compute dominates it here
        assert sum(float(e.duration) for e in res.critical_path if e.track == "compute") <= res.makespan


def test_per_model_stage_costs_for_dualpipe() -> None:
    # DualPipe holds two copies of each model stage; a per-model-stage list applies to both copies.
    sched = build_schedule("dualpipe", 4, 8)
    f, b = [1, 2, 3, 4], [3, 4, 5, 6]
    by_model = simulate(sched, CostModel(f=f, b=b, w=1))
    by_stage = simulate(sched, CostModel(f=f + f, b=b + b, w=1))  # stage R + s is model stage s
    assert by_model.makespan == by_stage.makespan and by_model.busy_per_rank == by_stage.busy_per_rank
    # rank 0 holds model stages 0 and 3: 4 micro-batches through each copy
    assert by_model.busy_per_rank[0] == 4 * (1 + 3) + 4 * (4 + 6)


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(["dualpipe", "dualpipev", "1f1b", "gpipe", "interleaved1f1b", "zb1p", "zbv"]),
    ranks=st.integers(1, 6),
    extra=st.integers(0, 6),
    f=st.integers(1, 4),
    w=st.integers(1, 4),
    i=st.integers(1, 4),
    latency=st.integers(0, 3),
    nbytes=st.integers(0, 4),
    rpn=st.sampled_from([None, 1, 2]),
    blocking=st.booleans(),
)
def test_engines_agree_property(
    name: str,
    ranks: int,
    extra: int,
    f: int,
    w: int,
    i: int,
    latency: int,
    nbytes: int,
    rpn: int | None,
    blocking: bool,
) -> None:
    if name == "dualpipe":
        ranks += ranks % 2
        n = 2 * ranks + 2 * extra
    elif name == "interleaved1f1b":
        n = ranks * (1 + extra % 3)
    else:
        n = 2 * ranks + extra
    b = i + w
    costs = CostModel(f=f, b=b, w=w, fb=max(f, b) + (f + b - max(f, b)) // 2)
    comm = CommModel(
        latency=latency,
        activation_bytes=nbytes,
        bandwidth=2,
        inter_latency=2 * latency,
        ranks_per_node=rpn,
        blocking=blocking,
    )
    direct = simulate(build_schedule(name, ranks, n), costs, comm)
    lowered = direct.lowered_result()
    assert (direct.makespan, direct.busy_per_rank, direct.peak_activations_per_rank, direct.comm_blocked_per_rank) == (
        lowered.makespan,
        lowered.busy_per_rank,
        lowered.peak_activations_per_rank,
        lowered.comm_blocked_per_rank,
    )
    assert_critical_chain(lowered)
