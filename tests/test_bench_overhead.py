"""bench overhead: the --quick --json contract (rows, per-action cost, ratios, profile)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROW_KEYS = {"impl", "transport", "schedule", "ranks", "microbatches", "step_s", "per_action_us"}


def test_bench_overhead_quick_json(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
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
    prof = res["profile"]
    assert 0 < len(prof) <= 25 and 0 < len(res["profile_self"]) <= 25 and "profile_error" not in res
    assert any("runtime/executor.py" in p["function"] and "(step)" in p["function"] for p in prof)
    cums = [p["cumtime_s"] for p in prof]
    assert cums == sorted(cums, reverse=True) and cums[0] > 0
    md = (tmp_path / "overhead.md").read_text()
    assert "## Profile" in md and "per action (us)" in md and "over floor (us)" in md
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
