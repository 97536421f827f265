"""The demo's text output: every figure labelled, the bubble read against the simulator, noise explained.

In-process: the printer is fed a result of the shape ``run_demo`` returns (the JSON contract), so no
ranks are spawned; tests/process/test_demo.py runs the real thing.
"""

from __future__ import annotations

import re

import pytest

from dualpipe_kernels.commands.demo import _print_table


def _result(shares: list[float | None], raws: list[float | None], t_comm_s: float) -> dict:
    steps = len(shares)
    return {
        "schedule": "dualpipev",
        "ranks": 2,
        "device": "cpu",
        "stages": 4,
        "microbatches": 8,
        "batch_size": 4,
        "model": {"seq_len": 32},
        "transport": "native",
        "boundary_format": "none",
        "steps": steps,
        "losses": [5.5 - 0.1 * k for k in range(steps)],
        "step_times_s": [0.1] * steps,
        "bubble_measured": [0.0388] * steps,
        "bubble_simulated": 0.02,
        "hidden_comm_share": shares,
        "hidden_comm_share_raw": raws,
        "exposed_comm_s": [0.001] * steps,
        "peak_activation_bytes": [3 * 2**20] * steps,
        "bit_exact_first_step": True,
        "first_step_losses_equal": True,
        "first_step_max_abs_grad_diff": 0.0,
        "t_compute_s": 0.05,
        "t_comm_s": t_comm_s,
        "simulated_exposed_comm_s": 0.0004,
        "wall_s": 7.5,
    }


def test_noise_is_explained_in_one_phrase_and_raw_values_are_not_shown(capsys: pytest.CaptureFixture) -> None:
    _print_table(_result([None, 0.5], [-406.9, 0.5], 0.00015))
    out = capsys.readouterr().out
    assert "raw" not in out and "-406" not in out
    lines = out.splitlines()
    rows = [ln for ln in lines if re.match(r"^[12] ", ln)]
    assert len(rows) == 2 and "noise*" in rows[0] and " 0.50 " in rows[1]
    (note,) = [ln for ln in lines if ln.startswith("* noise:")]
    assert "0.15 ms" in note and "bench overlap" in note  # what the noise is, and where to measure instead


def test_the_bubble_is_read_against_the_simulator(capsys: pytest.CaptureFixture) -> None:
    _print_table(_result([0.25], [0.25], 0.01))
    out = capsys.readouterr().out
    header = next(ln for ln in out.splitlines() if ln.startswith("step"))
    for label in ("loss", "step (ms)", "measured", "simulator", "measured/sim", "comm hidden", "peak saved"):
        assert label in header, label
    row = next(ln for ln in out.splitlines() if ln.startswith("1 "))
    assert "1.94x" in row and "38.80" in row and "20.00" in row and "3.00 MiB" in row and "100.0" in row
    assert "* noise" not in out  # nothing to explain when every share was measured
    assert "bubble: the longest time a rank sat idle" in out
    assert "T_compute = 50.0 ms" in out and "T_comm = 10.00 ms" in out


def test_nothing_moved_is_said_so(capsys: pytest.CaptureFixture) -> None:
    _print_table(_result([None], [None], 0.0))
    out = capsys.readouterr().out
    assert "nothing moved between processes" in out and "noise" not in out
