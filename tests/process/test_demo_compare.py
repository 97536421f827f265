"""`dualpipe-kernels demo --compare`: both schedules on the same model and data, measured beside predicted."""

from __future__ import annotations

import json

import pytest

from dualpipe_kernels.cli import main


@pytest.mark.timeout(300)
def test_demo_compare_json(capsys):
    argv = ["demo", "--compare", "1f1b", "--steps", "2", "--microbatches", "4", "--probe-steps", "1"]
    assert main([*argv, "--device", "cpu", "--transport", "torch", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    a, b = out["runs"]
    assert (a["schedule"], b["schedule"]) == ("dualpipev", "1f1b")
    assert a["bit_exact_first_step"] and b["bit_exact_first_step"]
    assert out["speedup"] == pytest.approx(b["step_s"] / a["step_s"])
    assert out["memory_reduction"] == pytest.approx(1 - a["peak_activation_bytes"] / b["peak_activation_bytes"])
    # DualPipeV 2 ranks: 5 of its 4 stages' chunks live (1 layer each); 1F1B: 2 chunks of 2 layers
    assert (a["predicted_peak_layers"], b["predicted_peak_layers"]) == (5.0, 4.0)
    assert a["final_loss"] == pytest.approx(b["final_loss"], rel=0.05)
