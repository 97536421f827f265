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
        # Sleeps cannot run faster than the schedule allows: measured >= simulated (minus timer slack).
        assert r["measured_s"] >= 0.97 * r["simulated_s"]
    # The simulator's prediction for the requested sleeps (F=2, B=4, W=2 ms per chunk) is exact arithmetic;
    # simulated_s adds the measured overshoot of time.sleep, so it is a little larger.
    sim = {r["schedule"]: r["simulated_nominal_s"] for r in res["rows"]}
    assert sim["1f1b"] == pytest.approx(8 * 12e-3 + 1 * 12e-3)  # N (F+B) + (R-1)(F+B), stages of two chunks
    assert all(r["simulated_s"] >= r["simulated_nominal_s"] for r in res["rows"])
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
