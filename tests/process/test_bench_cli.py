"""``dualpipe-kernels bench``: the schedules suite's JSON contract (tiny run), the registry, the results writer."""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dualpipe_kernels.benchmarks.common import Progress, markdown_table, median, stamp, write_results
from dualpipe_kernels.cli import main
from dualpipe_kernels.commands import bench

ROOT = Path(__file__).resolve().parents[2]
ROW_KEYS = ("schedule", "ranks", "microbatches", "measured_s", "simulated_s", "ratio", "hidden_comm_share")
PEER_KEYS = ("name", "schedule", "ranks", "microbatches", "step_s", "ours_step_s", "ratio")


def _run_cli(args: list[str], timeout: int = 280) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-m", "dualpipe_kernels", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _run_json(args: list[str]) -> tuple[subprocess.CompletedProcess[str], Any]:
    """``dualpipe-kernels <args>``, which must succeed; (the process, its stdout parsed as JSON)."""
    proc = _run_cli(args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads(proc.stdout)


def _check_overlap_fields(row: dict) -> None:
    """The overlap contract (docs/architecture.md): exposed_comm_s reported; the share in [0, 1] or null (noise)."""
    assert "exposed_comm_s" in row and "hidden_comm_share" in row
    share, raw = row["hidden_comm_share"], row.get("hidden_comm_share_raw")
    assert share is None or 0.0 <= share <= 1.0, share
    if raw is not None:
        assert row["hidden_comm_noise"] == (not -1e-9 <= raw <= 1.0 + 1e-9)
        assert share == (None if row["hidden_comm_noise"] else pytest.approx(raw))
        assert row["exposed_comm_s"] == pytest.approx(row["t_step_s"] - row["t_compute_s"])
        assert raw == pytest.approx(1 - row["exposed_comm_s"] / row["t_comm_s"])


@pytest.mark.timeout(300)
def test_bench_schedules_quick_json_contract(tmp_path: Path) -> None:
    # the short-chunk row left out here: test_bench_schedules_short_chunks_only checks it
    argv = ["bench", "schedules", "--quick", "--schedules", "dualpipev,1f1b", "--no-short-chunks"]
    proc, res = _run_json([*argv, "--json", "--out", str(tmp_path)])
    assert "[" in proc.stderr and "bench schedules" in proc.stderr  # progress on stderr only
    assert {r["schedule"] for r in res["rows"]} == {"dualpipev", "1f1b"}
    for r in res["rows"]:
        for k in ROW_KEYS:
            assert k in r, k
        assert r.get("error") is None, r.get("error")
        assert r["ranks"] == 2 and r["microbatches"] == 8
        assert r["ratio"] == pytest.approx(r["measured_s"] / r["simulated_s"])
        # Sleeps cannot run faster than the schedule allows: measured >= the simulator fed only the
        # sleeps and their overshoot (minus timer slack).  (simulated_s, fed costs timed alone in a
        # few quick repeats, is an estimate, not a bound.)
        assert r["measured_s"] >= 0.97 * r["simulated_sleep_only_s"]
        _check_overlap_fields(r)
        assert r["t_step_s"] == pytest.approx(r["measured_s"])
        # The same-run compute probe sleeps as long as the real step: bounded below like it.
        assert r["t_compute_s"] >= 0.97 * r["simulated_sleep_only_s"]
        assert r["t_comm_s"] > 0 and r["link_bandwidth_gbps"] > 0 and r["link_latency_s"] > 0
        # 16384-byte activations: every receive of the busiest rank was recorded, each timed on the link.
        assert r["transfers_per_rank_max"] >= 8
        # The simulator with the measured link is never faster than with free communication.
        assert r["simulated_with_comm_s"] >= r["simulated_s"] - 1e-12
        assert r["simulated_exposed_comm_s"] == pytest.approx(r["simulated_with_comm_s"] - r["simulated_s"])
    # The simulator's prediction for the requested sleeps (F=2, B=4, W=2 ms per chunk) is exact arithmetic;
    # simulated_s uses the chunk costs measured alone (sleep + overshoot + tensor work), so it is larger.
    sim = {r["schedule"]: r["simulated_nominal_s"] for r in res["rows"]}
    assert sim["1f1b"] == pytest.approx(8 * 12e-3 + 1 * 12e-3)  # N (F+B) + (R-1)(F+B), stages of two chunks
    assert all(r["simulated_s"] >= r["simulated_nominal_s"] for r in res["rows"])
    # ... and simulated_s is exactly the simulator fed the costs written to the config.
    from dualpipe_kernels.benchmarks.sleep_runs import chunk_costs_from_config, simulate_sleep

    costs = chunk_costs_from_config(res["config"])
    assert costs is not None and set(costs) == {1, 2}  # dualpipev: 1 chunk per stage, 1f1b: 2
    for r in res["rows"]:
        again = simulate_sleep(r["schedule"], 2, 8, costs)
        assert float(again.makespan) == pytest.approx(r["simulated_s"], rel=1e-12)
        assert r["ratio_sleep_only"] == pytest.approx(r["measured_s"] / r["simulated_sleep_only_s"])
    assert res["short_chunks"] == []  # --no-short-chunks
    # What the ranks asked of the host: some CPU per step, never more than the host's CPUs for the step.
    for r in res["rows"]:
        assert r["host_cpus"] >= 1
        assert 0 < r["rank_cpu_s"] <= r["measured_s"] * r["host_cpus"]
    assert {p["name"] for p in res["peers"]} == {"torch.ScheduleDualPipeV", "torch.Schedule1F1B"}
    for p in res["peers"]:
        for k in PEER_KEYS:
            assert k in p, k
        assert p["ratio"] == pytest.approx(p["ours_step_s"] / p["step_s"])
    for name in ("schedules.json", "schedules.md", "schedules_bubble.png", "schedules_timeline.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    written = json.loads((tmp_path / "schedules.json").read_text())
    assert written["stamp"]["git_revision"] and written["stamp"]["torch"]
    assert written["stamp"]["machine"]["cpu_cores"] >= 1
    md = (tmp_path / "schedules.md").read_text()
    assert "| dualpipev | 2 | 8 |" in md and "T_comm" in md


@pytest.mark.timeout(120)
def test_bench_schedules_short_chunks_only(tmp_path: Path) -> None:
    argv = ["bench", "schedules", "--quick", "--short-chunks-only", "--short-launches", "2"]
    _, res = _run_json([*argv, "--json", "--no-plots", "--out", str(tmp_path)])
    assert res["rows"] == [] and res["peers"] == [] and res["timeline"] is None
    # The short-chunk row (1/2/1 ms chunks; quick: 2 x 8): the same row as a schedule's, its own calibrated chunks.
    (short,) = res["short_chunks"]
    assert (short["schedule"], short["ranks"], short["microbatches"]) == ("dualpipev", 2, 8)
    assert (short["f_s"], short["b_s"], short["w_s"]) == (0.001, 0.002, 0.001)
    assert short.get("error") is None and short["ratio"] == pytest.approx(short["measured_s"] / short["simulated_s"])
    assert short["measured_s"] >= 0.97 * short["simulated_sleep_only_s"]
    # shorter than the quick rows' nominal steps (2/4/2 ms chunks, 2 x 8: the contract test's rows)
    from dualpipe_kernels.benchmarks.sleep_runs import nominal_chunks, simulate_sleep

    quick = nominal_chunks(2e-3, 4e-3, 2e-3)
    rows_nominal = [float(simulate_sleep(s, 2, 8, quick).makespan) for s in ("dualpipev", "1f1b")]
    assert short["simulated_nominal_s"] < min(rows_nominal)
    # what the ranks asked of the host: some CPU per step, never more than the host's CPUs for the step
    assert short["host_cpus"] >= 1 and 0 < short["rank_cpu_s"] <= short["measured_s"] * short["host_cpus"]
    # two launches: the row is the lower middle one (of two, the smaller ratio), with both and their range
    assert short["launches"] == 2 and len(short["ratios"]) == 2
    assert short["ratio"] == short["ratio_min"] == min(short["ratios"]) and short["ratio_max"] == max(short["ratios"])
    # the compute floor: a rank's chunks (2 per rank, 8 micro-batches, F + B = 3 ms each) with no runtime
    # (lower bounds only: the sleeps cannot be shorter; how much longer depends on the machine's load)
    assert short["floor_alone_s"] >= 2 * 8 * 0.003 and short["floor_together_s"] >= 2 * 8 * 0.003
    assert short["floor_inflation"] == pytest.approx(short["floor_together_s"] / short["floor_alone_s"])
    assert short["alone_drift"] > 0  # the same chunks, timed in the launch and before it
    # (ratio_runtime is defined as what the other two leave of the ratio: the three come from one launch)
    split = short["floor_inflation"] * short["alone_drift"] * short["ratio_runtime"]
    assert split == pytest.approx(short["ratio"])
    # the bare pipeline (same chunks and transfers, no runtime): a rank's chunks at least, and the two shares
    # multiply to the ratio (measured / simulated = bare / simulated x measured / bare)
    assert short["bare_s"] >= 2 * 8 * 0.003
    assert short["bare_over_simulated"] * short["measured_over_bare"] == pytest.approx(short["ratio"])
    md = (tmp_path / "schedules.md").read_text()
    assert "Short chunks" in md and "of CPU per step" in md and "| dualpipev | 2 | 8 |" in md
    assert "2 launches" in md and "no runtime and no communication" in md and "the bare pipeline" in md


def test_bench_schedules_short_chunks_only_needs_the_short_row() -> None:
    import argparse

    from dualpipe_kernels.benchmarks.schedules import SchedulesConfig, add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    with pytest.raises(ValueError, match="--short-chunks-only and --no-short-chunks"):
        SchedulesConfig.from_args(p.parse_args(["--short-chunks-only", "--no-short-chunks"]))
    with pytest.raises(ValueError, match="--short-launches must be >= 1"):
        SchedulesConfig.from_args(p.parse_args(["--short-launches", "0"]))
    assert SchedulesConfig.from_args(p.parse_args([])).short_chunks().short_launches == 3


@pytest.mark.timeout(200)
def test_bench_overlap_quick_json_contract(tmp_path: Path) -> None:
    argv = ["bench", "overlap", "--quick", "--transports", "native", "--formats", "none,fp8"]
    _, res = _run_json([*argv, "--json", "--out", str(tmp_path)])
    rows = res["rows"]
    assert [(r["transport"], r["activation_bytes"], r["boundary_format"]) for r in rows] == [
        ("native", 65536, "none"),
        ("native", 65536, "fp8"),
    ]
    for row in rows:
        assert row.get("error") is None, row.get("error")
        _check_overlap_fields(row)
        assert row["t_comm_s"] > 0 and "simulated_exposed_comm_s" in row
    # fp8 moves e4m3 codes plus one fp32 scale per 128 values: about a quarter of the fp32 bytes
    assert rows[0]["wire_bytes_per_transfer"] == 65536 and rows[1]["wire_bytes_per_transfer"] <= 0.26 * 65536
    md = (tmp_path / "overlap.md").read_text()
    assert "comm hidden" in md and "fp8" in md


@pytest.mark.timeout(200)
def test_bench_transport_rows_carry_the_cross_core_ceiling(tmp_path: Path) -> None:
    _, res = _run_json(
        ["bench", "transport", "--quick", "--max-size", "65536", "--json", "--no-plots", "--out", str(tmp_path)]
    )
    assert [r["size_bytes"] for r in res["rows"]] == [4096, 65536]
    for r in res["rows"]:
        for k in ("size_bytes", "native_gbps", "gloo_gbps", "memcpy_gbps", "native_latency_us", "gloo_latency_us"):
            assert k in r, k  # docs/architecture.md contract
        assert r["cross_core_copy_gbps"] > 0
        assert r["native_over_ceiling"] == pytest.approx(r["native_gbps"] / r["cross_core_copy_gbps"])
        for k in ("native_gbps", "gloo_gbps", "cross_core_copy_gbps", "memcpy_gbps"):
            assert r[f"{k}_min"] <= r[k] <= r[f"{k}_max"], k
        assert r["native_bit_exact"] and r["gloo_bit_exact"]
        # a packed message that fits a ring slot, packed in it and via a copy: both arrive intact
        assert r["packed_in_place_bit_exact"] and r["packed_copy_bit_exact"]
        assert r["packed_in_place_us"] > 0 and r["packed_copy_us"] > 0
    assert "bandwidth_vs_ceiling" in res["targets"]


def test_cross_core_copy_times_every_repeat() -> None:
    from dualpipe_kernels.benchmarks.transport import _cross_core_copy_times

    times = _cross_core_copy_times(1 << 16, 3)
    assert len(times) == 3 and all(t > 0 for t in times)


def test_bench_engine_suite_reports_against_its_target(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from dualpipe_kernels.schedules import build_schedule

    argv = ["bench", "engine", "--ranks", "2", "--microbatches", "4", "--repeats", "2", "--lowered"]
    assert main([*argv, "--json", "--out", str(tmp_path)]) == 0
    res = json.loads(capsys.readouterr().out)
    (row,) = res["rows"]
    assert row["compute_actions"] == sum(len(a) for a in build_schedule("dualpipev", 2, 4).actions)
    assert row["ratio_to_target"] == pytest.approx(row["total_s"] / 2.0)
    assert len(res["repeats"]) == 2 and {"build_s", "validate_s", "simulate_s", "lower_s"} <= set(res["repeats"][0])
    assert (tmp_path / "engine.md").stat().st_size > 0


def test_bench_bad_option_exits_2(capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "schedules", "--ranks", "3", "--schedules", "dualpipe", "--out", "/nonexistent"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "even" in err


def test_registry_reports_a_missing_suite_clearly() -> None:
    mod, err = bench._import_suite("no_such_suite")
    assert mod is None and "No module named" in (err or "")
    mod, err = bench._import_suite("schedules")
    assert err is None and mod is not None and mod.NAME == "schedules"
    assert set(bench.SUITES) >= {"schedules", "overlap", "transport", "engine"}
    assert "runtime_sleep" not in bench.SUITES  # merged into schedules: one benchmark of one thing


def test_unavailable_suite_run_gives_one_line(capsys: pytest.CaptureFixture) -> None:
    args = argparse.Namespace(suite="transport", suite_error="ModuleNotFoundError: No module named 'x'")
    assert bench.run(args) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "unavailable" in err and "transport" in err


def test_results_writer_and_helpers(tmp_path: Path) -> None:
    res = {"rows": [{"a": 1, "b": 0.123456, "c": None}]}
    paths = write_results("demo_suite", res, markdown_table(res["rows"], ["a", "b", "c"]), tmp_path)
    assert [p.name for p in paths] == ["demo_suite.json", "demo_suite.md"]
    j = json.loads(paths[0].read_text())
    assert j["rows"] == res["rows"] and j["suite"] == "demo_suite"
    for k in ("machine", "torch", "triton", "git_revision", "date_utc"):
        assert k in j["stamp"]
    md = paths[1].read_text()
    assert "| 1 | 0.1235 | - |" in md and "Machine:" in md
    assert median([3.0, 1.0, 2.0]) == 2.0
    with pytest.raises(ValueError, match="at least one"):
        median([])
    assert set(stamp()["machine"]) >= {"cpu_model", "cpu_cores", "hostname"}
    buf = io.StringIO()
    bar = Progress(4, "t", stream=buf)
    bar.update("one")
    bar.update("two", advance=3)
    lines = buf.getvalue().splitlines()
    assert len(lines) == 2 and "1/4" in lines[0] and "4/4" in lines[1] and "#" * 24 in lines[1]


def test_bench_all_gives_each_suite_its_defaults_plus_the_common_options() -> None:
    for name in ("schedules", "overlap", "engine"):
        mod, err = bench._import_suite(name)
        assert mod is not None, err
        common = argparse.Namespace(json=True, out="somewhere", quick=True, no_plots=True)
        ns = bench._suite_args(mod, common)
        assert (ns.json, ns.out, ns.quick, ns.no_plots) == (True, "somewhere", True, True)
        assert ns.suite == name
    assert bench._suite_args(bench._import_suite("schedules")[0], common).schedules == [
        "dualpipev",
        "dualpipe",
        "1f1b",
        "zb1p",
    ]


def test_bandwidth_plot_from_transport_rows(tmp_path: Path) -> None:
    from dualpipe_kernels.benchmarks.common import plot_bandwidth

    rows = [
        {"size_bytes": s, "native_gbps": s / 1e5, "gloo_gbps": s / 3e5, "memcpy_gbps": 10.0}
        for s in (1 << 10, 1 << 16, 1 << 20)
    ]
    path = plot_bandwidth({"rows": rows}, tmp_path / "bw.png")
    assert path is not None and path.stat().st_size > 5000
    assert plot_bandwidth({"rows": []}, tmp_path / "none.png") is None


def test_building_the_cli_imports_no_suite_and_no_torch() -> None:
    code = (
        "import sys; from dualpipe_kernels.cli import build_parser; build_parser(); "
        "suites = {'dualpipe_kernels.benchmarks.' + n for n in ('schedules', 'overlap', 'transport')}; "
        "bad = [m for m in sys.modules if m == 'torch' or m in suites]; "
        "assert not bad, bad"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_sleep_chunk_costs_at_least_the_sleeps_and_b_on_a_first_stage() -> None:
    import time

    import torch

    from dualpipe_kernels.benchmarks.sleep_stages import SleepStage, measure_chunk_costs

    c = measure_chunk_costs(0.004, 0.006, 0.002, 16384, repeats=2)
    assert c.f >= 0.004 and c.w >= 0.002 and c.i >= 0.004 and c.b >= 0.006
    # The first stage's input needs no gradient; its backward still sleeps the whole B (I and W).
    stage = SleepStage(0.0, 0.006, 0.002)
    y = stage(torch.zeros(4, 256))
    t0 = time.perf_counter()
    y.sum().backward()
    assert time.perf_counter() - t0 >= 0.006
    assert stage.weight.grad is not None and torch.equal(stage.weight.grad, torch.zeros(1))


def test_sleep_chunk_makes_one_activation_sized_tensor_per_forward_and_backward() -> None:
    """A chunk stands for device compute: its host work is one output (forward) and one input gradient
    (backward), whatever the activation size, and its split backward still defers the W sleep."""
    import time

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from dualpipe_kernels.benchmarks.sleep_stages import SleepStage
    from dualpipe_kernels.runtime.zero_bubble import WeightGradStore

    class Sized(TorchDispatchMode):
        def __init__(self, numel: int) -> None:
            super().__init__()
            self.numel, self.made = numel, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            leaves = torch.utils._pytree.tree_leaves
            seen = {t.untyped_storage().data_ptr() for t in leaves((args, kwargs)) if torch.is_tensor(t)}
            # new memory of an activation's size (views such as autograd's detach are not)
            self.made += sum(
                1
                for t in leaves(out)
                if torch.is_tensor(t) and t.numel() == self.numel and t.untyped_storage().data_ptr() not in seen
            )
            return out

    stage = SleepStage(0.0, 0.004, 0.003)
    x = torch.ones(64, 256, requires_grad=True)
    with Sized(x.numel()) as fwd:
        y = stage(x)
    assert fwd.made == 1 and y.shape == x.shape and not torch.any(y)
    store = WeightGradStore()
    with store.bind():
        store.enabled = True
        grad = torch.ones_like(y)
        t0 = time.perf_counter()
        with Sized(x.numel()) as bwd:
            torch.autograd.backward([y], [grad])
        t_i = time.perf_counter() - t0
        store.enabled = False
        store.flush(0)
    t0 = time.perf_counter()
    store.pop(0)
    t_w = time.perf_counter() - t0
    assert bwd.made == 1 and x.grad is not None and not torch.any(x.grad)
    assert 0.001 <= t_i < 0.003 + 0.002 and t_w >= 0.003  # I = B - W here, W at the W action


@pytest.mark.parametrize("name", ["dualpipev", "zb1p", "1f1b", "dualpipe"])
def test_compute_floor_runs_each_ranks_compute_actions_once(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank's compute list with no runtime: one forward per F, one backward per B or I, each I's W sleep
    deferred to its W action (run by the store's pop), a B's slept at once; nothing left over."""
    import torch

    from dualpipe_kernels.benchmarks import sleep_stages
    from dualpipe_kernels.benchmarks.compute_floor import _compute_step
    from dualpipe_kernels.runtime.zero_bubble import WeightGradStore
    from dualpipe_kernels.schedules.generators import build_schedule
    from dualpipe_kernels.schedules.ir import T_B, T_F, T_I

    sleeps: list[tuple[float, bool]] = []  # (seconds, inside a W action)
    in_pop = [False]
    monkeypatch.setattr(sleep_stages, "sleep_seconds", lambda sec: sleeps.append((sec, in_pop[0])))
    pop = WeightGradStore.pop

    def popping(self, key=None):  # type: ignore[no-untyped-def]
        in_pop[0] = True
        try:
            pop(self, key)
        finally:
            in_pop[0] = False

    monkeypatch.setattr(WeightGradStore, "pop", popping)
    sched = build_schedule(name, 2, 4)
    for rank in range(2):
        sleeps.clear()
        acts = [a for op in sched.compute_actions(rank) for a in op.computes()]
        count = {t: sum(a.type is t for a in acts) for t in (T_F, T_B, T_I)}
        modules = {s: sleep_stages.SleepStage(0.001, 0.003, 0.002) for s in sched.stages_of_rank(rank)}
        x = torch.zeros(4, 256)
        _compute_step(list(sched.compute_actions(rank)), modules, x, torch.zeros_like(x))
        assert sum(1 for sec, _ in sleeps if sec == 0.001) == count[T_F] + count[T_B] + count[T_I]  # F and I parts
        w = [inside for sec, inside in sleeps if sec == 0.002]
        assert (w.count(True), w.count(False)) == (count[T_I], count[T_B]), (name, rank)


def test_busy_time_leaves_out_receive_waits_inside_compute() -> None:
    from dualpipe_kernels.runtime.timeline import busy_time

    timeline = [
        (0, "0F0", 0.0, 1.0),
        (0, "0SEND_F0", 1.0, 1.1),
        (0, "(0F1;0B0)OVERLAP_F_B", 1.1, 4.0),
        (0, "0RECV_B0", 2.0, 2.5),  # the pair's backward half waited 0.5 s for its gradient
        (0, "0RECV_F2", 4.0, 4.2),  # a wait outside any compute is not in the compute spans anyway
        (0, "SYNC_MIRROR_GRADS", 4.2, 5.0),  # bookkeeping: not a schedule action
    ]
    assert busy_time(timeline) == pytest.approx(1.0 + 2.9 - 0.5)


@pytest.mark.parametrize(
    "t_step, t_compute, t_comm, share",
    [
        (1.05, 1.0, 0.1, 0.5),  # half of the 0.1 s of transfers showed in the step
        (1.0, 1.0, 0.1, 1.0),  # all hidden
        (1.1, 1.0, 0.1, 0.0),  # none hidden
    ],
)
def test_overlap_metric_in_range(t_step: float, t_compute: float, t_comm: float, share: float) -> None:
    from dualpipe_kernels.benchmarks.metrics import overlap_metric

    m = overlap_metric(t_step, t_compute, t_comm)
    assert m.hidden_comm_share == pytest.approx(share) and m.hidden_comm_share_raw == pytest.approx(share)
    assert not m.hidden_comm_noise and m.exposed_comm_s == pytest.approx(t_step - t_compute)


@pytest.mark.parametrize(
    "t_step, t_compute, t_comm, raw",
    [
        (0.98, 1.0, 0.01, 3.0),  # the step with data ran faster than the one without: noise, not "300% hidden"
        (1.5, 1.0, 0.1, -4.0),  # slower by more than the transfers cost: noise, not a share
        (1.0, 1.0, 0.0, None),  # nothing to hide
    ],
)
def test_overlap_metric_out_of_range_is_flagged_noise_and_null(
    t_step: float, t_compute: float, t_comm: float, raw: float | None
) -> None:
    from dualpipe_kernels.benchmarks.metrics import overlap_metric, share_text

    m = overlap_metric(t_step, t_compute, t_comm)
    assert m.hidden_comm_noise and m.hidden_comm_share is None
    assert m.hidden_comm_share_raw == (None if raw is None else pytest.approx(raw))
    assert m.as_dict()["hidden_comm_share"] is None and m.as_dict()["exposed_comm_s"] == pytest.approx(
        t_step - t_compute
    )
    assert share_text(m.hidden_comm_share, m.hidden_comm_share_raw) == (
        "-" if raw is None else f"noise (raw {raw:.2f})"
    )
    with pytest.raises(ValueError, match="T_comm"):
        overlap_metric(1.0, 1.0, -0.1)


def test_payload_switch_forwards_gathered_sends_cut_like_the_others() -> None:
    """The runtime's gathered small sends take the inner transport's path behind the switch too."""
    import torch

    from dualpipe_kernels.benchmarks.payload import KEEP_WHOLE_BYTES, TINY_BYTES, PayloadSwitch
    from dualpipe_kernels.transport.base import Handle, Transport

    class Plain(Transport):
        """No gathered sends; nothing else is called here."""

        @property
        def rank(self) -> int:
            return 0

        def isend(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "") -> Handle:
            raise AssertionError("not called")

        def irecv(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "") -> Handle:
            raise AssertionError("not called")

    class Gatherer(Plain):
        """Writes a gathered message's pieces into one zeroed byte string, as the native ring does."""

        def __init__(self) -> None:
            super().__init__()
            self.sent: dict[int, bytes] = {}

        def try_isend_gather(self, pieces, nbytes, peer, tag):  # type: ignore[no-untyped-def]
            msg = bytearray(nbytes)
            for off, t in pieces:
                raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
                msg[off : off + len(raw)] = raw
            self.sent[tag] = bytes(msg)
            return True

    inner = Gatherer()
    sw = PayloadSwitch(inner)
    meta = torch.arange(KEEP_WHOLE_BYTES // 8, dtype=torch.int64)
    data = torch.arange(2048, dtype=torch.float32)
    nbytes = KEEP_WHOLE_BYTES + 64 + data.nbytes  # 64 zero bytes between the metadata and the data
    whole = bytearray(nbytes)
    whole[:KEEP_WHOLE_BYTES] = meta.numpy().tobytes()
    whole[KEEP_WHOLE_BYTES + 64 :] = data.numpy().tobytes()
    pieces = [(0, meta), (KEEP_WHOLE_BYTES + 64, data)]
    assert sw.try_isend_gather(pieces, nbytes, 1, 7) and inner.sent[7] == bytes(whole)
    sw.tiny = True  # a cut step: the message's first bytes, as isend cuts them and irecv expects them
    kept = KEEP_WHOLE_BYTES + TINY_BYTES
    assert sw.try_isend_gather(pieces, nbytes, 1, 8) and inner.sent[8] == bytes(whole[:kept])
    small = [(0, meta)]
    assert sw.try_isend_gather(small, KEEP_WHOLE_BYTES, 1, 9) and inner.sent[9] == bytes(whole[:KEEP_WHOLE_BYTES])
    # a piece the cut cannot view as bytes, or an inner transport that cannot gather: False (a buffer goes)
    strided = torch.arange(4096, dtype=torch.float32)[::2]
    assert not sw.try_isend_gather([(0, meta), (KEEP_WHOLE_BYTES, strided)], KEEP_WHOLE_BYTES + 8192, 1, 10)
    assert 10 not in inner.sent
    assert not PayloadSwitch(Plain()).try_isend_gather(pieces, nbytes, 1, 11)
    # what the pipeline may send as one gathered message is the inner transport's (runtime/boundary/inline.py)
    assert PayloadSwitch(Plain()).message_inline_bytes == 0

    class Wide(Gatherer):
        message_inline_bytes = 1 << 18  # type: ignore[assignment]

    assert PayloadSwitch(Wide()).message_inline_bytes == 1 << 18


def test_payload_switch_cuts_large_transfers_and_records_what_a_step_moves() -> None:
    import torch

    from dualpipe_kernels.benchmarks.payload import KEEP_WHOLE_BYTES, TINY_BYTES, LinkTiming, PayloadSwitch
    from dualpipe_kernels.benchmarks.sleep_runs import comm_alone_s
    from dualpipe_kernels.transport.base import Handle, Transport

    class Done(Handle):
        def wait(self, timeout: float | None = None) -> None:
            return None

        def is_completed(self) -> bool:
            return True

    class Loopback(Transport):
        """One process: a send's bytes land in the receive posted with the same tag."""

        def __init__(self) -> None:
            super().__init__()
            self.sent: dict[int, torch.Tensor] = {}
            self.closed = False

        @property
        def rank(self) -> int:
            return 0

        def isend(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "") -> Handle:
            self.sent[tag] = tensor.clone()
            return Done()

        def irecv(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "") -> Handle:
            tensor.copy_(self.sent[tag])  # a size mismatch would raise here
            return Done()

        def close(self) -> None:
            self.closed = True

    inner = Loopback()
    sw = PayloadSwitch(inner)
    big, meta = torch.arange(4096, dtype=torch.float32), torch.arange(KEEP_WHOLE_BYTES // 8, dtype=torch.int64)
    for tag, t in ((1, big), (2, meta)):
        sw.isend(t, 0, tag)
        got = torch.zeros_like(t)
        sw.irecv(got, 0, tag)
        assert torch.equal(got, t)
    assert sw.received_bytes == [big.numel() * 4]  # the metadata-sized message is not payload
    sw.received_bytes.clear()
    sw.tiny = True
    sw.isend(big, 0, 3)
    kept = KEEP_WHOLE_BYTES + TINY_BYTES  # the head of a small message (its metadata) always moves
    assert inner.sent[3].numel() == kept  # only the first bytes move
    got = torch.zeros_like(big)
    sw.irecv(got, 0, 3)
    assert torch.equal(got[: kept // 4], big[: kept // 4]) and not got[kept // 4 :].any()
    sw.isend(meta, 0, 4)
    assert torch.equal(inner.sent[4], meta)  # metadata stays whole: the runtime's protocol is unchanged
    assert sw.received_bytes == []  # cut receives are not what a real step moves
    sw.close()
    assert inner.closed
    # the runtime posts tensors on the switch's wire device: the inner transport's (a CUDA transport
    # refuses host tensors), CPU for one without a device
    from dualpipe_kernels.runtime.boundary.header import wire_device

    assert wire_device(sw) == torch.device("cpu")
    inner.device, inner.device_native = torch.device("cuda", 0), True  # type: ignore[attr-defined]
    assert wire_device(PayloadSwitch(inner)) == torch.device("cuda", 0)
    inner.device_native = False  # type: ignore[attr-defined]  # host memory, stages device tensors itself
    assert wire_device(PayloadSwitch(inner)) == torch.device("cpu")
    link = LinkTiming(latency_s=1e-5, nbytes=1 << 20, one_way_s=1e-5 + (1 << 20) / 1e9, bandwidth_bps=1e9)
    assert link.transfer_s(1 << 20) == pytest.approx(link.one_way_s)
    assert comm_alone_s([[1 << 20, 1 << 20], [1 << 20]], link) == pytest.approx(2 * link.one_way_s)


def test_measured_stage_costs_medians_and_gaps() -> None:
    from dualpipe_kernels.runtime.timeline import measured_stage_costs

    tl = [
        (0, "0F0", 0.0, 1.0),
        (0, "0F1", 1.0, 4.0),
        (0, "0F2", 4.0, 6.0),  # F median 2
        (0, "0B0", 6.0, 10.0),  # B 4
        (0, "0I1", 10.0, 13.0),
        (0, "0W1", 13.0, 14.0),  # W 1
        (1, "(1F0;1B0)OVERLAP_F_B", 0.0, 5.0),  # stage 1: only a pair: F, B filled consistently
        (0, "SYNC_MIRROR_GRADS", 14.0, 15.0),  # runtime bookkeeping: ignored
        (1, "1SEND_F0", 5.0, 6.0),  # comm: ignored
    ]
    c = measured_stage_costs(tl, 2)
    assert (c.f[0], c.b[0], c.w[0], c.fb[0]) == (2.0, 4.0, 1.0, 6.0)
    assert c.fb[1] <= c.f[1] + c.b[1] and 0 < c.w[1] < c.b[1]
    from dualpipe_kernels.schedules import build_schedule

    assert c.cost_model().resolve(build_schedule("1f1b", 2, 2)).f == (2.0, c.f[1])  # the simulator accepts them


def test_sleep_stages_run_with_a_tight_timer_slack() -> None:
    """A sleeping thread's timer slack is 1 ns (read back with PR_GET_TIMERSLACK), so a sleep stands for its
    length.  (A new thread inherits its creator's slack, which an earlier test may have set: reset first.)"""
    import ctypes
    import threading

    from dualpipe_kernels.benchmarks.sleep_stages import sleep_seconds

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl.restype = ctypes.c_long
    slack: list[int] = []

    def sleeper() -> None:
        prctl(29, ctypes.c_ulong(50_000), 0, 0, 0)  # PR_SET_TIMERSLACK: Linux's default
        slack.append(prctl(30, 0, 0, 0, 0))  # PR_GET_TIMERSLACK
        sleep_seconds(1e-4)
        slack.append(prctl(30, 0, 0, 0, 0))

    t = threading.Thread(target=sleeper)
    t.start()
    t.join()
    assert slack == [50_000, 1]


def test_chunk_costs_are_measured_on_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """measure_chunk_costs times the chunk on one intra-op thread, as every rank runs, and restores the count."""
    import torch

    from dualpipe_kernels.benchmarks import sleep_stages

    seen: list[int] = []
    real = sleep_stages.sleep_seconds

    def spy(seconds: float) -> None:
        seen.append(torch.get_num_threads())
        real(seconds)

    monkeypatch.setattr(sleep_stages, "sleep_seconds", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        costs = sleep_stages.measure_chunk_costs(1e-3, 2e-3, 1e-3, 4096, repeats=2)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert seen and set(seen) == {1}
    assert 1e-3 <= costs.f < 0.1 and 2e-3 <= costs.b < 0.1
