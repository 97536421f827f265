"""``dualpipe-kernels bench moe``: the JSON contract in quick mode, gradients equal across contenders, the hook.

One quick run (4 CPU processes, two all_to_all sizes) is shared by the tests
of this file.  Timing targets are reported by the suite, never asserted here:
the machine running the tests may be loaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROW_KEYS = ("contender", "a2a_bytes", "step_s", "pair_s", "f_plus_b_s", "exposed_a2a_s", "simulated_s", "ratio_vs_ours")
CONTENDERS = ("ours", "ours-hook-off", "torch.ScheduleDualPipeV", "dropin.ScheduleDualPipeV")


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], float, Path, str]:
    out = tmp_path_factory.mktemp("moe")
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "dualpipe_kernels", "bench", "moe", "--quick", "--json", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    wall = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout), wall, out, proc.stderr


@pytest.mark.timeout(300)
def test_moe_quick_json_contract(quick: tuple[dict[str, Any], float, Path, str]) -> None:
    res, wall, out, _ = quick
    sizes = sorted({r["a2a_bytes"] for r in res["rows"]})
    assert len(sizes) == 2 and sizes[0] < sizes[1]
    assert len(res["rows"]) == len(sizes) * len(CONTENDERS)
    for r in res["rows"]:
        for k in ROW_KEYS:
            assert k in r, k
        assert r["contender"] in CONTENDERS
        assert r["step_s"] > 0 and r["simulated_s"] > 0 and r["pair_s"] > 0 and r["f_plus_b_s"] > 0
        ours = next(o for o in res["rows"] if o["contender"] == "ours" and o["a2a_bytes"] == r["a2a_bytes"])
        assert r["ratio_vs_ours"] == pytest.approx(ours["step_s"] / r["step_s"])
        if r["a2a_bytes"] == sizes[0]:
            assert r["exposed_a2a_s"] == 0.0  # the baseline against itself
    assert res["config"]["processes"] == 4 and "4 CPU processes" in res["layout"]
    assert res["reference"]["skipped"].startswith("reference skipped:")
    assert res["a2a_backend"] == "native"
    if sys.platform == "linux":  # every process lowered its communication threads below its compute thread
        assert len(res["comm_threads_lowered"]) == 4 and min(res["comm_threads_lowered"]) > 0
    assert set(res["targets"]["values"]) == set(res["targets"]["limits"])
    for r in res["rows"]:  # our contenders' simulation uses their own steps' timelines; torch records none
        assert r["simulated_from"] == ("in situ" if r["contender"] in ("ours", "ours-hook-off") else "alone"), r
        assert r["simulated_alone_s"] > 0
        if r["simulated_from"] == "alone":
            assert r["simulated_s"] == r["simulated_alone_s"]
    assert (out / "moe.json").is_file() and (out / "moe.md").is_file() and (out / "moe_step_vs_a2a.png").is_file()
    # CI budget: the whole quick run, process start included (generous on a shared machine).
    assert wall < 120, f"quick mode took {wall:.0f} s"


@pytest.mark.timeout(300)
def test_moe_first_step_gradients_equal(quick: tuple[dict[str, Any], float, Path, str]) -> None:
    """torch.equal on every parameter gradient of every process: integer values make every sum exact."""
    grads = quick[0]["grads"]
    assert grads["equal"], grads["mismatch"]
    assert grads["compared"] >= 4 * 3 * 4 * 2  # processes x other contenders x params per chunk x chunks


@pytest.mark.timeout(300)
def test_moe_hook_runs_only_for_ours(quick: tuple[dict[str, Any], float, Path, str]) -> None:
    """Ours and the drop-in (torch's program on our runtime) run the hook; torch's schedule and hook-off do not."""
    pairs = quick[0]["overlapped_pairs"]
    assert pairs["ours"] > 0 and pairs["dropin.ScheduleDualPipeV"] == pairs["ours"]
    assert pairs["ours-hook-off"] == 0 and pairs["torch.ScheduleDualPipeV"] == 0


def test_moe_bad_options_fail_clearly() -> None:
    import argparse

    from dualpipe_kernels.benchmarks import moe

    p = argparse.ArgumentParser()
    moe.add_arguments(p)
    with pytest.raises(ValueError, match="--rows must be a positive multiple of --ep"):
        moe.MoeConfig.from_args(p.parse_args(["--rows", "7"]))
    with pytest.raises(ValueError, match="0 < W < B"):
        moe.MoeConfig.from_args(p.parse_args(["--w-ms", "30"]))


@pytest.mark.timeout(120)
def test_native_all_to_all_delivers_what_gloo_does() -> None:
    """The suite's default all_to_all (native shared memory) is a true all_to_all: equal to gloo's, bit for bit."""
    import torch
    from moe_workers import native_vs_gloo_all_to_all

    from dualpipe_kernels.runtime.launch import spawn

    # Padded peer blocks of 280 KB: the engine's single-copy path (>= 256 KiB) as well as its ring.
    for r in spawn(native_vs_gloo_all_to_all, 2, 6, 5, 70_000, timeout_s=100.0):
        assert r["backend"] == "native"
        for want, nat, glo in zip(r["expected"], r["native"], r["gloo"], strict=True):
            assert torch.equal(nat, want) and torch.equal(glo, want)


def test_in_situ_simulation_of_a_simulated_step_gives_its_makespan() -> None:
    """Timelines shaped as the runtime records them (here: the simulator's own events for known costs, one
    pipeline per expert rank) fed back through the suite's in-situ costs simulate to the same step."""
    from dualpipe_kernels.benchmarks.moe import _simulated_in_situ
    from dualpipe_kernels.benchmarks.moe_ranks import MoeRun
    from dualpipe_kernels.schedules.costs import CostModel
    from dualpipe_kernels.schedules.generators import build_schedule
    from dualpipe_kernels.schedules.simulator import simulate

    run = MoeRun(
        pp=2, ep=2, microbatches=4, rows=8, cols=16, f_s=0.01, b_s=0.02, w_s=0.01, a2a_bytes=(0,), steps=1,
        warmup=1, cost_repeats=1,
    )  # fmt: skip
    sim = simulate(build_schedule("dualpipev", 2, 4), CostModel(f=0.01, b=0.02, w=0.01, fb=0.025))
    per_rank = []
    for g in range(4):
        p, e = divmod(g, 2)
        # The runtime's shape: an action starts where the previous one ended and waits for its input inside
        # (a RECV entry nested in its span); the rank's step ends with its last action.
        tl, prev = [], 0.0
        for ev in sorted((ev for ev in sim.events if ev.track == "compute" and ev.rank == p), key=lambda x: x.start):
            if ev.start > prev:
                tl.append((p, f"{ev.stage}RECV_F{ev.microbatch}", prev, float(ev.start)))
            tl.append((p, ev.action, prev, float(ev.end)))
            prev = float(ev.end)
        per_rank.append({"p_rank": p, "e_rank": e, "timelines": {"ours": [[(tl, prev)]]}})
    assert _simulated_in_situ(run, per_rank, "ours", 0) == pytest.approx(float(sim.makespan), rel=1e-9)
    assert _simulated_in_situ(run, per_rank, "torch.ScheduleDualPipeV", 0) is None  # no timelines: None
