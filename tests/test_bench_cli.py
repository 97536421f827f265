"""``dualpipe-kernels bench``: the schedules suite's JSON contract (tiny run), the registry, the results writer."""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dualpipe_kernels.benchmarks.common import Progress, markdown_table, median, stamp, write_results
from dualpipe_kernels.cli import main
from dualpipe_kernels.commands import bench

ROOT = Path(__file__).resolve().parents[1]
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


@pytest.mark.timeout(300)
def test_bench_schedules_quick_json_contract(tmp_path: Path) -> None:
    proc = _run_cli(
        ["bench", "schedules", "--quick", "--schedules", "dualpipev,1f1b", "--json", "--out", str(tmp_path)]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout)
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
    # The simulator's prediction for the requested sleeps (F=2, B=4, W=2 ms per chunk) is exact arithmetic;
    # simulated_s uses the chunk costs measured alone (sleep + overshoot + tensor work), so it is larger.
    sim = {r["schedule"]: r["simulated_nominal_s"] for r in res["rows"]}
    assert sim["1f1b"] == pytest.approx(8 * 12e-3 + 1 * 12e-3)  # N (F+B) + (R-1)(F+B), stages of two chunks
    assert all(r["simulated_s"] >= r["simulated_nominal_s"] for r in res["rows"])
    # ... and simulated_s is exactly the simulator fed the costs written to the config.
    from dualpipe_kernels.benchmarks.schedules import _chunk_costs_from_config, simulate_sleep

    cfg = res["config"]
    costs = _chunk_costs_from_config(cfg)
    assert costs is not None and set(costs) == {1, 2}  # dualpipev: 1 chunk per stage, 1f1b: 2
    for r in res["rows"]:
        again = simulate_sleep(r["schedule"], 2, 8, cfg["f_s"], cfg["b_s"], cfg["w_s"], chunk_costs=costs)
        assert float(again.makespan) == pytest.approx(r["simulated_s"], rel=1e-12)
        assert r["ratio_sleep_only"] == pytest.approx(r["measured_s"] / r["simulated_sleep_only_s"])
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
    assert "| dualpipev | 2 | 8 |" in (tmp_path / "schedules.md").read_text()


def test_bench_bad_option_exits_2(capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "schedules", "--ranks", "3", "--schedules", "dualpipe", "--out", "/nonexistent"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "even" in err


def test_registry_reports_a_missing_suite_clearly() -> None:
    mod, err = bench._import_suite("no_such_suite")
    assert mod is None and "No module named" in (err or "")
    mod, err = bench._import_suite("schedules")
    assert err is None and mod is not None and mod.NAME == "schedules"
    assert set(bench.SUITES) >= {"schedules", "overlap", "transport"}


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
    for name in ("schedules", "overlap"):
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


def test_busy_time_leaves_out_receive_waits_inside_compute() -> None:
    from dualpipe_kernels.benchmarks.schedules import busy_time

    timeline = [
        (0, "0F0", 0.0, 1.0),
        (0, "0SEND_F0", 1.0, 1.1),
        (0, "(0F1;0B0)OVERLAP_F_B", 1.1, 4.0),
        (0, "0RECV_B0", 2.0, 2.5),  # the pair's backward half waited 0.5 s for its gradient
        (0, "0RECV_F2", 4.0, 4.2),  # a wait outside any compute is not in the compute spans anyway
        (0, "SYNC_MIRROR_GRADS", 4.2, 5.0),  # bookkeeping: not a schedule action
    ]
    assert busy_time(timeline) == pytest.approx(1.0 + 2.9 - 0.5)


@pytest.mark.timeout(200)
def test_bench_runtime_sleep_quick_json_contract(tmp_path: Path) -> None:
    proc = _run_cli(
        [
            "bench",
            "runtime_sleep",
            "--quick",
            "--ranks",
            "2",
            "--f",
            "0.004",
            "--b",
            "0.008",
            "--w",
            "0.004",
            "--activation-bytes",
            "65536",
            "--json",
            "--out",
            str(tmp_path),
        ],
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout)
    (row,) = res["rows"]
    cc = res["chunk_costs_s"]
    # Chunks timed alone cost at least their sleeps; the simulator is fed exactly those costs.
    assert cc["F"] >= 0.004 and cc["W"] >= 0.004 and cc["I"] >= 0.004
    from dualpipe_kernels.benchmarks.runtime_sleep import simulate_sleep

    sim = simulate_sleep("dualpipev", 2, row["microbatches"], cc["F"], cc["I"] + cc["W"], cc["W"])
    assert float(sim.makespan) == pytest.approx(row["simulated_s"], rel=1e-12)
    assert row["ratio"] == pytest.approx(row["measured_s"] / row["simulated_s"])
    assert row["ratio_sleep_only"] == pytest.approx(row["measured_s"] / row["simulated_sleep_only_s"])
    # Sleeps cannot finish before the schedule allows (timer slack aside).
    assert row["measured_s"] >= 0.97 * row["simulated_sleep_only_s"]
    assert (tmp_path / "runtime_sleep.md").stat().st_size > 0
