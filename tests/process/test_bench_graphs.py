"""bench graphs: its logic on a CPU process (the GPU figures are bench/device_check.sh's).

Without a GPU the graphs-on case falls back to eager: the row names the reason and carries no timing
(it would time eager twice), and the two cases train bit for bit alike.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from dualpipe_kernels.benchmarks import graphs


def _args(**over: object) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    graphs.add_arguments(p)
    ns = p.parse_args([])
    ns.quick = True
    for k, v in over.items():
        setattr(ns, k, v)
    return ns


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback row")
def test_on_cpu_the_row_reports_the_fallback_reason_instead_of_a_number():
    res = graphs.run(_args(steps=3, microbatches=4, layers=2, width=8))
    off, on = res["rows"]
    assert off["graphs"] == "off" and on["graphs"] == "on"
    assert off["step_s_min"] <= off["step_s"] <= off["step_s_max"] and off["per_action_us"] > 0
    assert on["step_s"] is None and on["per_action_us"] is None and on["on_over_off"] is None
    assert on["fallback"] == "; ".join(
        f"stage {s}: no CUDA device (torch.cuda.is_available() is False)" for s in (0, 1)
    )
    assert on["bit_exact"] is True and on["graphs_captured"] == 0
    assert "no CUDA device" in graphs.to_markdown(res)


def test_bad_warmup_is_refused():
    with pytest.raises(ValueError, match="--warmup must be >= 2"):
        graphs.run(_args(warmup=1))
