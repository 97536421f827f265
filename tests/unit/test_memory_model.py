"""The simulator's memory model (schedules/memory_model.py), `simulate --memory-policy` and `bench memory --json`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dualpipe_kernels.cli import main
from dualpipe_kernels.schedules.costs import CostModel
from dualpipe_kernels.schedules.generators import build_schedule
from dualpipe_kernels.schedules.memory_model import (
    MEMORY_POLICIES,
    ChunkBytes,
    peak_saved_bytes,
    predict,
    reload_points,
)
from dualpipe_kernels.schedules.simulator import simulate

NAMES = ["dualpipe", "dualpipev", "1f1b", "gpipe", "interleaved1f1b", "zb1p", "zbv"]


@pytest.mark.parametrize("name", NAMES)
def test_keep_peak_is_peak_activations_times_chunk_bytes(name):
    sched = build_schedule(name, 4, 8)
    res = simulate(sched, CostModel())
    got = peak_saved_bytes(sched, "keep", ChunkBytes(1000))
    want = [1000 * p for p in res.peak_activations_per_rank]
    if name in ("zb1p", "zbv"):
        # After an I the runtime's graph (and what it saved) lives until the W; the reference table frees at the I.
        assert all(g >= w for g, w in zip(got, want, strict=True))
    else:
        assert got == want


@pytest.mark.parametrize("name", NAMES)
def test_every_policy_holds_at_most_keep(name):
    sched = build_schedule(name, 4, 8)
    sizes = ChunkBytes(900, 100)
    keep = peak_saved_bytes(sched, "keep", sizes)
    for policy in MEMORY_POLICIES:
        got = peak_saved_bytes(sched, policy, sizes)
        assert all(g <= k for g, k in zip(got, keep, strict=True)), policy
    # recompute without I/W splits: the inputs of the live chunks (one more inside an F&B pair) plus one
    # chunk's recomputed activations
    if name not in ("zb1p", "zbv", "dualpipe", "dualpipev"):
        rec = peak_saved_bytes(sched, "recompute", sizes)
        acts = simulate(sched, CostModel()).peak_activations_per_rank
        assert all(r <= 100 * (a + 1) + 800 for r, a in zip(rec, acts, strict=True))


def test_reload_points_skip_what_the_next_actions_consume():
    sched = build_schedule("1f1b", 4, 8)
    reload_at, resident = reload_points(sched.actions[3], 2)
    assert not reload_at and len(resident) == 8  # the last stage runs each B right after its F
    reload_at, resident = reload_points(sched.actions[0], 2)
    comps = [a for a in sched.actions[0] if a.is_compute]
    for p, keys in reload_at.items():
        for key in keys:
            q = next(i for i, a in enumerate(comps) if a.type.value in "BI" and (a.stage, a.microbatch) == key)
            assert q - p == 2


def test_offload_in_forward_is_held_through_the_f_and_moved_back_whole():
    """``in_forward`` under offload (what the F holds before its tensors leave, e.g. a stage input counted
    with the chunk on the V's turn): the peak grows by at most its excess over ``saved``, and a chunk
    that offloads nothing still costs only ``kept``."""
    sched = build_schedule("dualpipev", 4, 16)
    base = peak_saved_bytes(sched, "offload", ChunkBytes(800, 200))
    more = peak_saved_bytes(sched, "offload", ChunkBytes(800, 200, in_forward=1000))
    assert all(b < m <= b + 200 * 4 for b, m in zip(base, more, strict=True)), (base, more)
    assert ChunkBytes(800, 200, in_forward=1000).moved("offload") == 800  # leaves and comes back
    assert ChunkBytes(800, 200, in_forward=1000).moved("recompute") == 600  # in_forward is offload's only
    assert peak_saved_bytes(sched, "offload", ChunkBytes(800, 200, in_forward=200)) <= base


def test_recompute_costs_an_f_per_backward_and_offload_hides_behind_work():
    sched = build_schedule("1f1b", 2, 4)
    sizes = ChunkBytes(100, 10)
    keep = predict(sched, "keep", sizes, CostModel(f=1, b=2, w=1))
    rec = predict(sched, "recompute", sizes, CostModel(f=1, b=2, w=1))
    assert rec.makespan == simulate(sched, CostModel(f=1, b=3, w=1)).makespan > keep.makespan
    fast = predict(sched, "offload", sizes, CostModel(f=1, b=2, w=1), host_bandwidth=1000)
    slow = predict(sched, "offload", sizes, CostModel(f=1, b=2, w=1), host_bandwidth=1)
    assert fast.makespan == keep.makespan <= slow.makespan


def test_bad_sizes_and_policies_are_named():
    with pytest.raises(ValueError, match="kept bytes"):
        ChunkBytes(10, 20)
    with pytest.raises(ValueError, match="memory policy 'swap'"):
        peak_saved_bytes(build_schedule("1f1b", 2, 4), "swap", ChunkBytes(1))


def test_simulate_cli_prints_peak_saved_bytes_per_rank(capsys):
    argv = ["simulate", "--schedule", "dualpipev", "--ranks", "4", "--microbatches", "16", "--json"]
    assert main([*argv, "--memory-policy", "recompute", "--activation-bytes", "1000", "--kept-bytes", "100"]) == 0
    d = json.loads(capsys.readouterr().out)
    sched = build_schedule("dualpipev", 4, 16)
    assert d["peak_saved_bytes_per_rank"] == peak_saved_bytes(sched, "recompute", ChunkBytes(1000, 100))
    assert d["peak_saved_bytes"] == max(d["peak_saved_bytes_per_rank"]) and d["memory_policy"] == "recompute"
    assert main(argv[:-1] + ["--memory-policy", "offload", "--activation-bytes", "10"]) == 0
    assert "peak saved bytes per rank" in capsys.readouterr().out


@pytest.mark.timeout(300)
def test_bench_memory_json_contract(tmp_path: Path, capsys):
    argv = ["bench", "memory", "--ranks", "2", "--microbatches", "4", "--steps", "1", "--f-ms", "1"]
    argv += ["--activation-bytes", "4096", "--depth", "2", "--json", "--out", str(tmp_path)]
    assert main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    keys = {"schedule", "ranks", "microbatches", "policy", "peak_saved_bytes", "peak_saved_bytes_keep"}
    keys |= {"predicted_peak_saved_bytes", "step_s", "step_s_keep", "predicted_step_s", "bit_exact"}
    keys |= {"host_bytes", "predicted_host_bytes"}
    assert len(res["rows"]) == 2 * 7  # two schedules x every policy
    for row in res["rows"]:
        assert keys <= set(row)
        assert row["peak_saved_bytes"] == pytest.approx(row["predicted_peak_saved_bytes"], rel=0.1)
        assert row["bit_exact"] is (row["policy"] in ("keep", "recompute", "offload"))
        assert row["host_bytes"] == pytest.approx(row["predicted_host_bytes"], rel=0.1)
        assert (row["host_bytes"] > 0) is row["policy"].startswith("offload")
        assert 0 < row["peak_saved_bytes"] <= row["peak_saved_bytes_keep"]
    assert (tmp_path / "memory.md").stat().st_size > 0


def test_policy_arguments_are_checked_and_named():
    from dualpipe_kernels.runtime.memory_plan import MemoryPolicy, parse_memory_policy

    assert {s: p.name for s, p in parse_memory_policy("compress:fp8", [0, 3]).items()} == {
        0: "compress:fp8",
        3: "compress:fp8",
    }
    got = parse_memory_policy({3: "offload"}, [0, 3])
    assert (got[0].kind, got[3].kind) == ("keep", "offload")
    with pytest.raises(ValueError, match="stage\\(s\\) \\[5\\]"):
        parse_memory_policy({5: "offload"}, [0, 3])
    with pytest.raises(ValueError, match="'swap' is unknown"):
        MemoryPolicy.parse("swap")
    assert MemoryPolicy.parse("offload:fp8").name == "offload:fp8"
    assert MemoryPolicy.parse("offload").dtype is None  # lossless unless a format is named
    assert MemoryPolicy.parse("offload:bf16").dtype == torch.bfloat16
    assert MemoryPolicy("compress").name == "compress:bf16"
    for bad in ("keep:fp8", "recompute:bf16", "offload:fp16", "compress:none", "offload:"):
        with pytest.raises(ValueError, match="is unknown; a format goes with compress or offload"):
            MemoryPolicy.parse(bad)
    with pytest.raises(ValueError, match="offload_path 'zero' is unknown"):
        MemoryPolicy("offload", offload_path="zero")
    with pytest.raises(ValueError, match="lookahead >= 1"):
        MemoryPolicy("offload", lookahead=0)


def test_recompute_under_the_iw_split_holds_inputs_between_i_and_w():
    # DualPipeV's split backwards: the recomputation goes after the I and comes back for the W.
    sched = build_schedule("dualpipev", 4, 16)
    sizes = ChunkBytes(17, 1)  # the memory bench's chunk: 16 saved blocks plus its input
    keep = max(peak_saved_bytes(sched, "keep", sizes))
    assert max(peak_saved_bytes(sched, "recompute", sizes)) <= 0.40 * keep


def test_recompute_adds_an_f_to_b_i_and_w_also_inside_a_pair():
    from dualpipe_kernels.schedules.memory_model import policy_costs

    sched = build_schedule("zbv", 2, 4)
    sizes = ChunkBytes(10, 1)
    sc = policy_costs(sched, CostModel(f=2, b=5, w=3, fb=6), "recompute", sizes).resolve(sched)
    assert (sc.b[0], sc.i[0], sc.w[0]) == (7, 4, 5)
    assert sc.pair(0, 1, True) == 8 and sc.pair(0, 1, False) == 8 - 3  # F&B + F; its I half: F&B + F - W
    replay = policy_costs(sched, CostModel(f=2, b=5, w=3), "recompute", sizes, recompute_s=[1] * 4).resolve(sched)
    assert (replay.b[0], replay.i[0], replay.w[0], replay.f[0]) == (6, 3, 4, 2)
    with pytest.raises(ValueError, match="one cost per stage"):
        policy_costs(sched, CostModel(), "recompute", sizes, recompute_s=[1])


def test_compress_peak_counts_the_whole_input_until_the_end_of_the_forward():
    sched = build_schedule("1f1b", 2, 4)
    settled = max(peak_saved_bytes(sched, "compress:fp8", ChunkBytes(17, 1, 4)))
    during = max(peak_saved_bytes(sched, "compress:fp8", ChunkBytes(17, 1, 4, in_forward=5)))
    assert during == settled + 1  # one forward in flight at the peak holds its whole input


def test_in_situ_costs_charge_the_runtime_work_and_not_the_waits():
    from dualpipe_kernels.benchmarks.in_situ_costs import in_situ_costs

    # rank 0: F0 at 1-11 ms, F1 at 12-30 ms with a receive wait of 8 ms inside; step 40 ms
    r0 = [(0, "0F0", 0.001, 0.011), (0, "0F1", 0.012, 0.030), (0, "0RECV_F1", 0.012, 0.020)]
    got = in_situ_costs([[(r0, 0.040)]], 1)
    assert got.f[0] == pytest.approx(0.0105)  # median of 10 ms and (18 - 8) + 1 ms of runtime work
    assert got.forward_s[0] == pytest.approx(0.010)  # the spans alone
    assert got.fixed_s == pytest.approx(0.001 + 0.010)  # before the first compute and after the last


def test_fit_latency_finds_the_latency_a_step_was_simulated_with():
    from dualpipe_kernels.benchmarks.in_situ_costs import InSituCosts, fit_latency
    from dualpipe_kernels.schedules.costs import CommModel

    sched = build_schedule("dualpipev", 4, 8)
    costs = InSituCosts([0.01] * 8, [0.02] * 8, [0.01] * 8, [0.03] * 8, [0.01] * 8, fixed_s=0.002)
    step = simulate(sched, costs.cost_model(), CommModel(latency=0.003)).makespan + 0.002
    assert fit_latency(costs, sched, step).latency_s == pytest.approx(0.003, abs=1e-6)
    assert fit_latency(costs, sched, 0.0).latency_s == 0.0
