"""bench memory_gpu: its logic on CPU ranks (the GPU run is bench/device_check.sh's)."""

from __future__ import annotations

import argparse

import pytest
import torch

from dualpipe_kernels.benchmarks import memory_gpu


def _args(**kw: object) -> argparse.Namespace:
    # rows x cols x 4 B = 2 KiB per block: above offload's 1 KiB min_bytes, so offload moves every block
    base = dict(quick=True, microbatches=4, rows=32, cols=16, depth=3, steps=2, policies=None, transport="auto",
                device="cpu", timeout=120.0)  # fmt: skip
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.mark.timeout(180)
def test_every_policy_gets_a_row_lossless_ones_match_keep_bit_for_bit_and_recompute_saves_less() -> None:
    res = memory_gpu.run(_args())
    rows = {r["policy"]: r for r in res["rows"]}
    assert list(rows) == ["keep", "offload", "recompute", "compress:fp8"]
    assert rows["keep"]["share_of_keep"] == 1 and rows["keep"]["step_over_keep"] == 1
    for name in ("keep", "offload", "recompute"):
        assert rows[name]["bit_exact"] is True, name
    assert rows["compress:fp8"]["bit_exact"] is None  # lossy: compared by its loss only
    assert rows["compress:fp8"]["loss_rel_diff"] < 0.05
    # recompute keeps each chunk's input only: 1 of the depth + 1 blocks a chunk saves under keep
    assert 0 < rows["recompute"]["peak_saved_bytes"] < rows["keep"]["peak_saved_bytes"]
    for r in rows.values():
        assert r["step_s_min"] <= r["step_s"] <= r["step_s_max"] and r["device"] == "cpu"
    # the simulator's peaks, from the measured per-stage bytes: keep and recompute exactly; offload within 10%
    # (0.94 here: on the V's turn a chunk's input is the previous chunk's saved output, which offload counts
    # with the input when the previous chunk's tensors left, and the model takes the larger of the two cases)
    for name in ("keep", "recompute"):
        assert rows[name]["measured_over_predicted_peak"] == pytest.approx(1.0, abs=1e-9), rows[name]
    assert rows["offload"]["measured_over_predicted_peak"] == pytest.approx(1.0, abs=0.1), rows["offload"]
    assert rows["offload"]["peak_saved_bytes"] < rows["keep"]["peak_saved_bytes"]
    assert "| recompute |" in memory_gpu.to_markdown(res)


def test_bad_policy_names_the_choices_and_no_gpu_is_a_skip_reason() -> None:
    with pytest.raises(ValueError, match="even number of ranks"):
        memory_gpu.GpuMemoryConfig.from_args(_args(ranks=3))
    with pytest.raises(ValueError, match="microbatches >= 2 x ranks"):
        memory_gpu.GpuMemoryConfig.from_args(_args(ranks=4, microbatches=6))
    with pytest.raises(ValueError, match="unknown policy.*choose from keep"):
        memory_gpu.GpuMemoryConfig.from_args(_args(policies="keep,swap"))
    if not torch.cuda.is_available():
        assert "needs CUDA" in (memory_gpu.unavailable() or "")
