"""Planner: on a grid of synthetic problems, its choice is the best feasible plan by brute force.

The brute force evaluates every structurally valid configuration on its own:
per-stage costs summed from the layer table, the schedule built and simulated
through the public schedules API, a ring all-reduce added, and the memory
(parameter state + saved activations) counted by walking each rank's actions.
The brute force covers the keep policy; with every policy searched ("auto"), the
choice is the best of the per-policy choices, and recompute wins where keep cannot fit.
"""

from __future__ import annotations

import random

import pytest

from dualpipe_kernels.planner import Cluster, LayerCost, LayerTable, PlanError, plan
from dualpipe_kernels.planner.memory import PLAN_MEMORY_POLICIES
from dualpipe_kernels.planner.plan import enumerate_candidates
from dualpipe_kernels.schedules import ActionType, CommModel, CostModel, build_schedule, simulate

MULT = 4.0


def _table(rng: random.Random, n: int) -> LayerTable:
    rows = []
    for i in range(n):
        heavy = 4.0 if i in (0, n - 1) and rng.random() < 0.5 else 1.0  # embedding/head imbalance
        f = heavy * rng.uniform(0.5, 2.0)
        b = 2 * f * rng.uniform(0.8, 1.2)
        rows.append(LayerCost(f"l{i}", f, b, b * rng.uniform(0.3, 0.6), rng.uniform(1, 4) * 1e6,
                              heavy * rng.uniform(1, 3) * 1e6, rng.uniform(0.5, 1) * 1e6))  # fmt: skip
    return LayerTable(tuple(rows), microbatch_size=2)


def _sums(table, sizes, field, scale=1.0):
    out, start = [], 0
    for n in sizes:
        out.append(sum(getattr(x, field) for x in table.layers[start : start + n]) * scale)
        start += n
    return out


def _walk_peak(sched, act):
    """Most saved-activation bytes alive per rank: F adds, B or W frees (I keeps them for the W)."""
    peaks = []
    for r in range(sched.num_ranks):
        live = peak = 0.0
        for a in sched.compute_actions(r):
            for x in a.sub_actions or (a,):
                if x.type is ActionType.F:
                    live += act[x.stage]
                elif x.type in (ActionType.B, ActionType.W):
                    live -= act[x.stage]
                peak = max(peak, live)
        peaks.append(peak)
    return peaks


def _brute(table, cluster, batch):
    """(step, peak memory) of every candidate, evaluated independently of the planner's search."""
    cands, _ = enumerate_candidates(table, cluster, batch)
    out = []
    for c in cands:
        scale = c.microbatch_size / table.microbatch_size
        f, b, w = (_sums(table, c.partition, k, scale) for k in ("f_s", "b_s", "w_s"))
        sched = build_schedule(c.schedule, c.pp, c.microbatches)
        ends = [sum(c.partition[: k + 1]) for k in range(len(c.partition) - 1)]
        boundary = max((table.layers[e - 1].boundary_bytes for e in ends), default=0.0) * scale
        comm = CommModel(latency=cluster.intra_latency, bandwidth=cluster.intra_bandwidth, activation_bytes=boundary,
                         ranks_per_node=cluster.devices_per_node, inter_latency=cluster.inter_latency,
                         inter_bandwidth=cluster.inter_bandwidth)  # fmt: skip
        makespan = simulate(sched, CostModel(f=f, b=b, w=w), comm).makespan
        params = _sums(table, c.partition, "param_bytes")
        held = [[params[sched.model_stage[s]] for s in sched.stages_of_rank(r)] for r in range(c.pp)]
        members = c.dp * (2 if c.schedule == "dualpipe" else 1)
        spans_nodes = c.pp * c.dp > cluster.devices_per_node
        bw = cluster.inter_bandwidth if spans_nodes else cluster.intra_bandwidth
        lat = cluster.inter_latency if spans_nodes else cluster.intra_latency
        grad = max(sum(h) for h in held)
        allreduce = 0.0 if members == 1 else 2 * (members - 1) / members * grad / bw + 2 * (members - 1) * lat
        per_stage = _sums(table, c.partition, "activation_bytes", scale)
        # the first stage's input is the caller's batch, counted nowhere (its first layer's output stands in)
        per_stage[0] = max(per_stage[0] - table.layers[0].boundary_bytes * scale, 0.0)
        act = [per_stage[m] for m in sched.model_stage]
        mem = max(MULT * sum(h) + p for h, p in zip(held, _walk_peak(sched, act), strict=True))
        out.append((makespan + allreduce, mem, c))
    return out


def _problems():
    rng = random.Random(12)
    for k in range(54):
        devices = rng.choice([2, 4, 8])
        dpn = rng.choice([d for d in (1, 2, 4, 8) if devices % d == 0])
        table = _table(rng, rng.randint(4, 9))
        batch = rng.choice([8, 16, 24, 32])
        budget = rng.uniform(20, 120) * 1e6
        cluster = Cluster(devices, dpn, budget, intra_bandwidth=rng.choice([1e9, 1e12]), intra_latency=1e-3,
                          inter_bandwidth=rng.choice([1e8, 1e10]), inter_latency=5e-3)  # fmt: skip
        yield pytest.param(table, cluster, batch, id=f"p{k}-d{devices}-n{dpn}-L{len(table.layers)}-B{batch}")


@pytest.mark.parametrize("table,cluster,batch", list(_problems()))
def test_choice_is_the_best_feasible_by_brute_force(table, cluster, batch):
    every = _brute(table, cluster, batch)
    feasible = [(step, mem, c) for step, mem, c in every if mem <= cluster.memory_bytes]
    if not feasible:
        with pytest.raises(PlanError, match="raise the memory budget by at least"):
            plan(table, cluster, batch, state_multiplier=MULT, memory_policy="keep")
        return
    result = plan(table, cluster, batch, state_multiplier=MULT, top=3, memory_policy="keep")
    best_step = min(step for step, _, _ in feasible)
    assert result.best.simulated_step_s == pytest.approx(best_step, rel=1e-9)
    assert result.best.feasible and result.best.peak_memory_bytes <= cluster.memory_bytes
    # The planner's memory prediction for its choice is the brute force's count.
    mine = next(m for s, m, c in every if (c.schedule, c.pp, c.microbatches, c.microbatch_size) == (
        result.best.schedule, result.best.pp, result.best.microbatches, result.best.microbatch_size))  # fmt: skip
    assert result.best.peak_memory_bytes == pytest.approx(mine, rel=1e-9)
    steps = [c.simulated_step_s for c in result.candidates if c.feasible]
    assert steps == sorted(steps) and len(result.explanation) >= 2


def test_a_layer_that_fits_nowhere_names_it():
    table = LayerTable((LayerCost("tiny", 1, 2, 1, 10, 10, 10), LayerCost("huge", 1, 2, 1, 10, 100e6, 10)))
    with pytest.raises(PlanError, match=r"layer 'huge' fits on no device.*raise the memory budget by at least 0.3"):
        plan(table, Cluster(2, 2, 100e6), 8)


def test_bad_cluster_inputs():
    with pytest.raises(ValueError, match=r"devices \(12\) must be a multiple of devices per node \(8\)"):
        Cluster(12, 8, 1e9)
    with pytest.raises(ValueError, match="memory_bytes must be a finite number"):
        Cluster(8, 8, float("nan"))
    with pytest.raises(ValueError, match="finite number >= 0"):
        LayerCost("x", float("inf"), 1, 0.5, 0, 0, 0)


def test_parameter_count_table_plans_compute_only():
    rows = tuple(LayerCost(f"l{i}", n, 2 * n, n, 0, 4 * n, 0) for i, n in enumerate([10, 10, 10, 40]))
    result = plan(LayerTable(rows, unit="params"), Cluster(4, 4, 1e9), 16)
    assert result.unit == "params" and all(c.allreduce_s == 0 for c in result.candidates)
    # No link costs in a unitless table, so pure data parallelism has no bubble and wins.
    assert (result.best.pp, result.best.dp, result.best.bubble_s) == (1, 4, 0)


@pytest.mark.parametrize("table,cluster,batch", list(_problems())[:20])
def test_auto_policy_is_the_best_per_policy_choice(table, cluster, batch):
    best = {}
    for policy in PLAN_MEMORY_POLICIES:
        try:
            best[policy] = plan(table, cluster, batch, state_multiplier=MULT, memory_policy=policy, top=1).best
        except PlanError:
            pass
    if not best:
        with pytest.raises(PlanError, match="raise the memory budget by at least"):
            plan(table, cluster, batch, state_multiplier=MULT)
        return
    got = plan(table, cluster, batch, state_multiplier=MULT, top=3).best
    want = min(best.values(), key=lambda c: (c.simulated_step_s, PLAN_MEMORY_POLICIES.index(c.memory_policy)))
    assert got.simulated_step_s == pytest.approx(want.simulated_step_s, rel=1e-12)
    assert got.memory_policy == want.memory_policy and got.peak_memory_bytes <= cluster.memory_bytes


def test_recompute_is_chosen_when_keep_cannot_fit():
    # Big activations, small stage inputs: keep needs ~pp micro-batches of activations in flight, recompute
    # only their inputs plus one chunk.  Offload is ruled out by a slow host link (it would be slower).
    rows = tuple(LayerCost(f"l{i}", 1.0, 2.0, 1.0, 50e6, 1e6, 1e5) for i in range(8))
    table = LayerTable(rows)
    cluster = Cluster(4, 4, 160e6, host_bandwidth=1e3)
    with pytest.raises(PlanError, match="no plan fits"):
        plan(table, cluster, 16, memory_policy="keep")
    result = plan(table, cluster, 16)
    best = result.best
    assert best.memory_policy == "recompute" and best.feasible and best.peak_memory_bytes <= 160e6
    # recompute costs an F per backward: slower than keep would be with enough memory
    roomy = plan(table, Cluster(4, 4, 10e9, host_bandwidth=1e3), 16, memory_policy="keep").best
    assert best.simulated_step_s > roomy.simulated_step_s
    assert {c.memory_policy for c in result.candidates} <= set(PLAN_MEMORY_POLICIES)


def test_auto_chooses_an_offload_cast_only_where_the_lossless_reloads_cannot_hide():
    # The table above with keep out of memory: on a 10 MB/s host link the lossless offload's reloads show in
    # the step while fp8's quarter of the bytes hide behind compute, so auto takes offload:fp8; on a link fast
    # enough for both, the tie goes to the lossless offload.
    rows = tuple(LayerCost(f"l{i}", 1.0, 2.0, 1.0, 50e6, 1e6, 1e5) for i in range(8))
    table = LayerTable(rows)
    slow = Cluster(4, 4, 160e6, host_bandwidth=1e7)
    best = plan(table, slow, 16).best
    assert best.memory_policy == "offload:fp8" and best.feasible and best.peak_memory_bytes <= 160e6
    lossless = plan(table, slow, 16, memory_policy="offload").best
    assert best.simulated_step_s < lossless.simulated_step_s
    assert best.peak_memory_bytes == pytest.approx(lossless.peak_memory_bytes, rel=1e-9)  # same device bytes
    assert plan(table, Cluster(4, 4, 160e6, host_bandwidth=1e8), 16).best.memory_policy == "offload"
