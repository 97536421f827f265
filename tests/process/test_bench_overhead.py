"""bench overhead: the --quick --json contract (rows, per-action cost, ratios, profile)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROW_KEYS = {"impl", "transport", "schedule", "ranks", "microbatches", "step_s", "per_action_us"}


def test_bench_overhead_quick_json(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    cmd = [
        sys.executable,
        "-m",
        "dualpipe_kernels",
        "bench",
        "overhead",
        "--quick",
        "--json",
        "--no-plots",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(proc.stdout)
    rows = res["rows"]
    assert {(r["impl"], r["transport"], r["schedule"]) for r in rows} >= {
        ("ours", "native", "dualpipev"),
        ("ours", "native-prev", "dualpipev"),
        ("ours", "torch", "dualpipev"),
        ("ours", "native", "1f1b"),
        ("ours", "torch", "zb1p"),
        ("torch", "torch", "dualpipev"),
        ("torch", "torch", "1f1b"),
        ("floor", "none", "dualpipev"),
        ("floor", "none", "1f1b"),
    }
    for r in rows:
        assert ROW_KEYS <= r.keys(), r
        assert "error" not in r, r
        assert r["ranks"] == 2 and r["microbatches"] == 8
        assert r["step_s"] > 0 and r["per_action_us"] > 0
        assert abs(r["per_action_us"] - r["step_s"] / r["compute_actions"] * 1e6) < 1e-6 * r["per_action_us"]
    gloo_dpv = next(
        r for r in rows if r["impl"] == "ours" and r["transport"] == "torch" and r["schedule"] == "dualpipev"
    )
    torch_dpv = next(r for r in rows if r["impl"] == "torch" and r["schedule"] == "dualpipev")
    assert gloo_dpv["ratio_to_torch"] == gloo_dpv["step_s"] / torch_dpv["step_s"]
    native_dpv, prev_dpv = (
        next(r for r in rows if r["impl"] == "ours" and r["transport"] == t and r["schedule"] == "dualpipev")
        for t in ("native", "native-prev")
    )
    assert native_dpv["ratio_to_prev"] == native_dpv["step_s"] / prev_dpv["step_s"]
    assert "ratio_to_prev" not in prev_dpv and "ratio_to_prev" not in gloo_dpv
    floor_dpv = next(r for r in rows if r["impl"] == "floor" and r["schedule"] == "dualpipev")
    # the floor is torch's own work with nothing around it: below ours, and what over_floor subtracts
    assert native_dpv["floor_us"] == floor_dpv["per_action_us"] < native_dpv["per_action_us"]
    assert native_dpv["over_floor_us"] == native_dpv["per_action_us"] - floor_dpv["per_action_us"]
    assert "floor_us" not in floor_dpv and "floor_us" not in torch_dpv
    # the bound: the schedule simulated with the ops' own torch time and the transport's latency, no runtime
    bounds = {(r["transport"], r["schedule"]): r for r in rows if r["impl"] == "bound"}
    assert set(bounds) == {(t, s) for t in ("native", "torch") for s in ("dualpipev", "1f1b", "zb1p")}
    for (t, s), b in bounds.items():
        ours = next(r for r in rows if r["impl"] == "ours" and r["transport"] == t and r["schedule"] == s)
        assert b["latency_us"] > 0 and b["compute_actions"] == ours["compute_actions"]
        assert ours["bound_us"] == b["per_action_us"] and ours["ratio_to_bound"] == ours["step_s"] / b["step_s"]
        assert b["per_action_us"] < ours["per_action_us"], (b, ours)  # ours pays for itself; the bound does not
    assert bounds[("torch", "dualpipev")]["latency_us"] > bounds[("native", "dualpipev")]["latency_us"]
    assert "bound_us" not in prev_dpv
    prof = res["profile"]
    assert 0 < len(prof) <= 25 and 0 < len(res["profile_self"]) <= 25 and "profile_error" not in res
    assert any("runtime/step.py" in p["function"] and "(step)" in p["function"] for p in prof)
    cums = [p["cumtime_s"] for p in prof]
    assert cums == sorted(cums, reverse=True) and cums[0] > 0
    md = (tmp_path / "overhead.md").read_text()
    assert "## Profile" in md and "per action (us)" in md and "over floor (us)" in md and "ours/bound" in md
    assert json.loads((tmp_path / "overhead.json").read_text())["rows"] == rows


def test_launches_combine_to_medians_with_the_ratio_range_and_keep_an_error() -> None:
    from dualpipe_kernels.benchmarks.overhead_report import combine_launches as _combine

    def row(step: float, ratio: float | None = None, **kw: object) -> dict[str, object]:
        r: dict[str, object] = {"impl": "ours", "step_s": step, "step_min_s": step - 1, "step_max_s": step + 1,
                                "compute_actions": 10, "per_action_us": step / 10 * 1e6, **kw}  # fmt: skip
        if ratio is not None:
            r["ratio_to_torch"] = ratio
        return r

    launches = [[row(3.0, 0.9), row(1.0)], [row(1.0, 0.7), row(2.0, error="boom")], [row(2.0, 0.8), row(3.0)]]
    ours, failed = _combine(launches)
    assert ours["step_s"] == 2.0 and ours["per_action_us"] == 2.0 / 10 * 1e6 and ours["launches"] == 3
    assert (ours["step_min_s"], ours["step_max_s"]) == (0.0, 4.0)
    assert (ours["ratio_to_torch"], ours["ratio_min"], ours["ratio_max"]) == (0.8, 0.7, 0.9)
    assert failed["error"] == "boom"


def test_floor_rows_are_cases_unless_turned_off_and_subtract_per_schedule() -> None:
    """--no-floor drops the floor cases; add_floor puts each schedule's floor (and our cost above it) on our
    rows of that schedule only, and leaves rows without a floor of their schedule alone."""
    import argparse

    from dualpipe_kernels.benchmarks.overhead import OverheadConfig, add_arguments
    from dualpipe_kernels.benchmarks.overhead_report import add_floor

    p = argparse.ArgumentParser()
    add_arguments(p)
    on = OverheadConfig.from_args(p.parse_args(["--schedules", "1f1b,gpipe", "--no-torch"]))
    off = OverheadConfig.from_args(p.parse_args(["--schedules", "1f1b,gpipe", "--no-torch", "--no-floor"]))
    assert [c for c in on.cases() if c[0] == "floor"] == [("floor", "none", "1f1b"), ("floor", "none", "gpipe")]
    assert not [c for c in off.cases() if c[0] == "floor"] and len(on.cases()) == len(off.cases()) + 2

    rows = [
        {"impl": "ours", "transport": "native", "schedule": "1f1b", "per_action_us": 130.0},
        {"impl": "ours", "transport": "torch", "schedule": "1f1b", "per_action_us": 600.0},
        {"impl": "ours", "transport": "native", "schedule": "gpipe", "per_action_us": 110.0},
        {"impl": "torch", "transport": "torch", "schedule": "1f1b", "per_action_us": 400.0},
        {"impl": "floor", "transport": "none", "schedule": "1f1b", "per_action_us": 75.0},
    ]
    add_floor(rows)
    assert (rows[0]["floor_us"], rows[0]["over_floor_us"]) == (75.0, 55.0)
    assert (rows[1]["floor_us"], rows[1]["over_floor_us"]) == (75.0, 525.0)
    assert "floor_us" not in rows[2] and "floor_us" not in rows[3] and "floor_us" not in rows[4]


def test_floor_step_runs_each_compute_action_of_the_rank_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The floor of a rank: one forward per F (a pair's F half included), one autograd.backward per B or I,
    nothing for a W; no process group needed."""
    import torch

    from dualpipe_kernels.benchmarks import overhead as ov
    from dualpipe_kernels.schedules.generators import build_schedule
    from dualpipe_kernels.schedules.ir import T_B, T_F, T_I

    cfg = ov.OverheadConfig(("dualpipev",), ("native",), 4, 1, 0, False, "dualpipev", 1)
    halves = [c for a in build_schedule("dualpipev", 2, 4).actions[0] for c in a.computes()]
    calls = {"backward": 0}
    real = torch.autograd.backward

    def counting(*args: object, **kw: object) -> None:
        calls["backward"] += 1
        real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.autograd, "backward", counting)
    step = ov._floor_step(0, cfg, "dualpipev")
    step()
    assert calls["backward"] == sum(1 for a in halves if a.type in (T_B, T_I))
    assert sum(1 for a in halves if a.type is T_F) == 2 * 4  # two stage chunks x 4 micro-batches


def test_baseline_tree_measures_another_source_tree_side_by_side(tmp_path: Path) -> None:
    """--baseline-tree: the same cases of another tree (here this one, in its own child processes), new/old
    per pair of launches; a path that is no source tree is a clear error before anything runs."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    base = [sys.executable, "-m", "dualpipe_kernels", "bench", "overhead", "--quick", "--json", "--no-plots"]
    quick = ["--schedules", "dualpipev", "--transports", "native", "--no-torch", "--no-floor", "--steps", "2"]
    bad = subprocess.run(
        [*base, "--out", str(tmp_path / "bad"), "--baseline-tree", str(tmp_path)],
        capture_output=True, text=True, timeout=60, env=env, check=False,
    )  # fmt: skip
    assert bad.returncode != 0 and f"--baseline-tree {tmp_path}: no dualpipe_kernels/__init__.py" in bad.stderr
    proc = subprocess.run(
        [*base, *quick, "--out", str(tmp_path / "ok"), "--baseline-tree", str(root)],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(proc.stdout)
    assert res["baseline_tree"] == str(root)
    (row,) = res["rows"]
    assert row["baseline_pairs"] == 1 and row["baseline_step_s"] > 0
    # one pair of launches: the median is that pair's ratio
    assert row["ratio_to_baseline"] == row["step_s"] / row["baseline_step_s"] == row["ratio_to_baseline_min"]
    assert abs(row["baseline_per_action_us"] - row["baseline_step_s"] / row["compute_actions"] * 1e6) < 1e-6
    md = (tmp_path / "ok" / "overhead.md").read_text()
    assert "new/old" in md and str(root) in md


def test_bound_rows_simulate_the_measured_costs_and_latency() -> None:
    """bound_rows: the simulator's makespan of each schedule with the ranks' per-stage op costs and rank 0's
    latency (more latency, a longer bound; never less than a rank's own work); a rank's error is every bound
    row's; add_bound puts each bound on our rows of its schedule and transport (ordered: gloo's)."""
    from dualpipe_kernels.benchmarks.overhead import OverheadConfig
    from dualpipe_kernels.benchmarks.overhead_bound import add_bound, bound_rows
    from dualpipe_kernels.schedules.costs import CommModel, CostModel
    from dualpipe_kernels.schedules.generators import build_schedule
    from dualpipe_kernels.schedules.simulator import simulate

    cfg = OverheadConfig(("1f1b", "dualpipev"), ("native", "native-prev", "ordered"), 4, 1, 0, False, "dualpipev", 1)
    costs = {
        "1f1b": [{0: (1e-5, 3e-5)}, {1: (2e-5, 4e-5)}],
        "dualpipev": [{0: (1e-5, 2e-5), 3: (3e-5, 5e-5)}, {1: (1e-5, 2e-5), 2: (1e-5, 2e-5)}],
    }

    def per_rank(lat: float) -> list[dict[str, object]]:
        return [
            {
                **{f"floor/none/{n}": {"times": [1.0], "actions": None, "ops": costs[n][r]} for n in costs},
                "bound": {"latency": {"native": lat, "torch": 2 * lat}},
            }
            for r in range(2)
        ]

    rows = bound_rows(cfg, per_rank(1e-5))
    assert [(r["transport"], r["schedule"]) for r in rows] == [
        ("native", "1f1b"),
        ("torch", "1f1b"),
        ("native", "dualpipev"),
        ("torch", "dualpipev"),
    ]
    sched = build_schedule("1f1b", 2, 4)
    want = simulate(sched, CostModel(f=[1e-5, 2e-5], b=[3e-5, 4e-5], w=[3e-14, 4e-14]), CommModel(latency=1e-5))
    assert rows[0]["step_s"] == float(want.makespan) and rows[0]["latency_us"] == 1e-5 * 1e6
    assert rows[0]["step_s"] >= 4 * (2e-5 + 4e-5)  # rank 1's own work
    assert rows[1]["step_s"] > rows[0]["step_s"]  # twice the latency
    assert rows[0]["per_action_us"] == rows[0]["step_s"] / rows[0]["compute_actions"] * 1e6
    failed = per_rank(1e-5)
    failed[1]["floor/none/1f1b"] = "RuntimeError: boom"  # the floor case failed on a rank: its schedule's bounds
    got = bound_rows(cfg, failed)
    assert [r.get("error") for r in got] == ["RuntimeError: boom", "RuntimeError: boom", None, None]

    ours = [
        {"impl": "ours", "transport": t, "schedule": "1f1b", "step_s": 1e-3}
        for t in ("native", "native-prev", "ordered")
    ]
    add_bound(ours + rows)
    assert ours[0]["ratio_to_bound"] == 1e-3 / rows[0]["step_s"] and ours[0]["bound_us"] == rows[0]["per_action_us"]
    assert "bound_us" not in ours[1]  # native-prev: not bounded
    assert ours[2]["bound_us"] == rows[1]["per_action_us"]  # ordered is gloo: the torch latency


def test_floor_step_times_each_op_of_the_rank_for_the_bound() -> None:
    """The floor case's step keeps each call's per-op times (``rounds``); op_costs_from makes them an (F, B)
    in seconds for exactly this rank's stages: per op the median over the rounds, per stage the mean."""
    from dualpipe_kernels.benchmarks import overhead as ov
    from dualpipe_kernels.benchmarks.overhead_bound import op_costs_from

    cfg = ov.OverheadConfig(("dualpipev",), ("native",), 4, 1, 0, False, "dualpipev", 1)
    step = ov._floor_step(1, cfg, "dualpipev")
    for _ in range(3):
        step()
    assert len(step.rounds) == 3 and all(len(r) == 2 * 2 * 4 for r in step.rounds)  # 2 stages x 4 mb x F, B
    got = op_costs_from(step.rounds)
    assert set(got) == {1, 2}
    assert all(0 < f < 0.1 and 0 < b < 0.1 for f, b in got.values())
    fake = [[((1, 0, True), 1.0), ((1, 0, False), 4.0), ((1, 1, True), 3.0)], [((1, 0, True), 2.0)]]
    assert op_costs_from(fake) == {1: ((1.5 + 3.0) / 2, 4.0)}
