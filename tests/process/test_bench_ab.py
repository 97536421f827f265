"""bench/ab_pipelines.py: two pipeline settings taking turns in the same rank processes (a quick run)."""

from __future__ import annotations

import os
import sys

import pytest

BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")


@pytest.mark.timeout(180)
def test_ab_pipelines_reports_both_settings_and_their_paired_difference(capsys: pytest.CaptureFixture[str]) -> None:
    if BENCH_DIR not in sys.path:
        sys.path.insert(0, BENCH_DIR)  # the spawned ranks import the script by name (spawn passes sys.path on)
    import ab_pipelines

    argv = [
        "--a",
        '{"wire": {"inline_limit_bytes": 32768, "early_small_receives": false}}',
        "--b",
        '{"wire": {"inline_limit_bytes": 40000, "early_small_receives": true}}',
    ]
    out = ab_pipelines.main([*argv, "--ranks", "2", "--microbatches", "4", "--rounds", "3", "--warmup", "1"])
    for name in ("A", "B"):
        r = out[name]
        # two ranks' chunks: 2 stages x 4 micro-batches x (F 1 ms + B 2 ms) at least
        assert r["median_s"] >= 2 * 4 * 0.003 and r["q1_s"] <= r["median_s"] <= r["q3_s"]
        assert 0 < r["busiest_cpu_s"]
    applied = {
        "A": {"inline_limit_bytes": 32768, "early_small_receives": False},
        "B": {"inline_limit_bytes": 40000, "early_small_receives": True},
    }
    assert out["applied"] == [applied] * 2, "as asked"
    assert abs(out["a_minus_b_s"]) < max(out["A"]["median_s"], out["B"]["median_s"]), "a difference of two steps"
    text = capsys.readouterr().out
    assert "step median" in text and "paired difference" in text


@pytest.mark.timeout(60)
def test_ab_pipelines_refuses_an_unknown_wire_option() -> None:
    if BENCH_DIR not in sys.path:
        sys.path.insert(0, BENCH_DIR)
    import ab_pipelines

    from dualpipe_kernels.runtime.launch import RanksFailed

    with pytest.raises(RanksFailed, match="setting B: .*'sends_first'"):
        ab_pipelines.main(["--b", '{"wire": {"sends_first": false}}', "--ranks", "2", "--rounds", "1"])
