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
    assert list(rows) == list(memory_gpu.POLICIES)
    assert rows["keep"]["share_of_keep"] == 1 and rows["keep"]["step_over_keep"] == 1
    for name in ("keep", "offload", "offload@mapped", "recompute"):
        assert rows[name]["bit_exact"] is True, name
    for name in ("compress:fp8", "offload:fp8", "offload:fp8@mapped"):
        assert rows[name]["bit_exact"] is None  # lossy: compared by its loss only
        assert rows[name]["loss_rel_diff"] < 0.05
    # host bytes per step: none without offload, the fp8 cast about a quarter of offload's, as the model says
    assert rows["keep"]["host_bytes"] == rows["recompute"]["host_bytes"] == 0
    assert 0 < rows["offload:fp8"]["host_bytes"] <= 0.3 * rows["offload"]["host_bytes"]
    for name in ("offload", "offload:fp8"):
        assert rows[name]["host_bytes"] == pytest.approx(rows[name]["predicted_host_bytes"], rel=0.1), rows[name]
        assert rows[name]["offload_path"] == "staging" and rows[f"{name}@mapped"]["offload_path"] == "mapped"
    for r in rows.values():  # every figure has its prediction beside it
        for what in ("peak_saved_bytes", "peak_alloc_bytes", "peak_reserved_bytes", "peak_active_bytes", "step_s"):
            assert r[f"predicted_{what}"] is not None, (r["policy"], what)
    # recompute keeps each chunk's input only: 1 of the depth + 1 blocks a chunk saves under keep
    assert 0 < rows["recompute"]["peak_saved_bytes"] < rows["keep"]["peak_saved_bytes"]
    for r in rows.values():
        assert r["step_s_min"] <= r["step_s"] <= r["step_s_max"] and r["device"] == "cpu"
    # the simulator's peaks, from the measured per-stage bytes: keep and recompute exactly; offload within 10%
    # (0.94 here: on the V's turn a chunk's input is the previous chunk's saved output, which offload counts
    # with the input when the previous chunk's tensors left, and the model takes the larger of the two cases)
    for name in ("keep", "recompute"):
        assert rows[name]["measured_over_predicted_peak"] == pytest.approx(1.0, abs=1e-9), rows[name]
    for name in ("offload", "offload:fp8", "offload@mapped"):
        assert rows[name]["measured_over_predicted_peak"] == pytest.approx(1.0, abs=0.1), rows[name]
    assert rows["offload"]["peak_saved_bytes"] < rows["keep"]["peak_saved_bytes"]
    assert "| recompute |" in memory_gpu.to_markdown(res)


def test_bad_policy_names_the_choices_and_no_gpu_is_a_skip_reason() -> None:
    with pytest.raises(ValueError, match="even number of ranks"):
        memory_gpu.GpuMemoryConfig.from_args(_args(ranks=3))
    with pytest.raises(ValueError, match="microbatches >= 2 x ranks"):
        memory_gpu.GpuMemoryConfig.from_args(_args(ranks=4, microbatches=6))
    with pytest.raises(ValueError, match="unknown policy.*choose from keep"):
        memory_gpu.GpuMemoryConfig.from_args(_args(policies="keep,swap"))
    with pytest.raises(ValueError, match="unknown policy.*choose from keep"):
        memory_gpu.GpuMemoryConfig.from_args(_args(policies="keep,recompute@mapped"))
    assert memory_gpu.memory_policy("offload:fp8@mapped").offload_path == "mapped"
    with pytest.raises(ValueError, match="only an offload policy takes a path"):
        memory_gpu.memory_policy("recompute@mapped")
    if not torch.cuda.is_available():
        assert "needs CUDA" in (memory_gpu.unavailable() or "")
