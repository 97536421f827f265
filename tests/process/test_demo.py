"""The demo command: JSON contract and bit-exact first step (shortened run), option errors, and its pieces."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dualpipe_kernels.benchmarks.common import ActivationMeter
from dualpipe_kernels.cli import main
from dualpipe_kernels.demo_data import SyntheticTokens
from dualpipe_kernels.models.gpt import GPTConfig, build_gpt_stages, gpt_loss, layer_split, stage_modules_for
from dualpipe_kernels.schedules.generators import build_schedule

ROOT = Path(__file__).resolve().parents[2]
DEMO_KEYS = (
    "ranks",
    "schedule",
    "steps",
    "losses",
    "step_times_s",
    "bit_exact_first_step",
    "bubble_measured",
    "bubble_simulated",
    "hidden_comm_share",
)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path: gloo processes (the GPU path has its own device check)
    return env


@pytest.mark.timeout(300)
def test_demo_json_contract_and_bit_exact_first_step() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dualpipe_kernels", "demo", "--steps", "2", "--json"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout)  # stdout holds exactly one JSON object; progress went to stderr
    assert "demo:" in proc.stderr
    for k in DEMO_KEYS:
        assert k in res, k
    assert (res["ranks"], res["schedule"], res["steps"], res["stages"]) == (2, "dualpipev", 2, 4)
    assert res["bit_exact_first_step"] is True
    assert res["transport"] in ("native", "torch") and res["transport_requested"] == "auto"  # what "auto" became
    assert res["first_step_grad_tensors"] > 0
    assert len(res["losses"]) == len(res["step_times_s"]) == len(res["bubble_measured"]) == 2
    # Untrained model on 256 tokens: cross-entropy near ln(256).
    assert abs(res["losses"][0] - math.log(256)) < 0.2
    assert all(t > 0 for t in res["step_times_s"])
    assert all(b >= 0 for b in res["bubble_measured"]) and res["bubble_simulated"] >= 0
    # Overlap (docs/architecture.md): measured in the same run; a share within [0, 1] or null (noise), never outside.
    assert len(res["hidden_comm_share"]) == len(res["exposed_comm_s"]) == 2
    assert res["t_comm_s"] > 0 and res["t_compute_s"] > 0 and res["link"]["bandwidth_bps"] > 0
    for k in range(2):
        share, raw = res["hidden_comm_share"][k], res["hidden_comm_share_raw"][k]
        assert share is None or 0.0 <= share <= 1.0
        assert res["hidden_comm_noise"][k] == (not -1e-9 <= raw <= 1.0 + 1e-9)
        assert share == (None if res["hidden_comm_noise"][k] else pytest.approx(raw))
        assert res["exposed_comm_s"][k] == pytest.approx(res["step_times_s"][k] - res["t_compute_s"])
        assert raw == pytest.approx(1 - res["exposed_comm_s"][k] / res["t_comm_s"])
    assert res["simulated_exposed_comm_s"] >= 0
    assert all(p > 0 for p in res["peak_activation_bytes"])


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--ranks", "3", "--schedule", "dualpipe"], "even"),
        (["--ranks", "2", "--microbatches", "2"], "micro-batches"),
        (["--steps", "0"], "--steps"),
        (["--ranks", "0"], "--ranks"),
        (["--layers", "2", "--ranks", "2"], "--layers"),
        (["--boundary-format", "fp4"], "unknown format 'fp4'"),
    ],
)
def test_demo_impossible_options_exit_2_with_one_line(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture
) -> None:
    assert main(["demo", *argv, "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert needle in err


def test_activation_meter_counts_each_saved_storage_once_until_backward_frees_it() -> None:
    w = torch.nn.Parameter(torch.ones(1000))
    x = torch.randn(1000, requires_grad=True)
    meter = ActivationMeter([w])
    with meter.track():
        y = (x * w).exp()  # mul saves x (and w: a parameter, excluded); exp saves its result
        z = y.sin()  # saves y: the same storage as exp's result, counted once
    assert meter.peak == meter.current == 2 * 4000
    z.sum().backward()
    del y, z
    assert meter.current == 0 and meter.peak == 8000


def test_gpt_init_is_independent_of_the_split_and_staged_forward_matches() -> None:
    torch.set_num_threads(1)
    cfg = GPTConfig(n_layers=4)
    whole = build_gpt_stages(cfg, 1, seed=3)
    parts = build_gpt_stages(cfg, 4, seed=3)
    flat = lambda ms: torch.cat([p.detach().flatten() for m in ms for p in m.parameters()])  # noqa: E731
    assert torch.equal(flat(whole), flat(parts))
    assert not torch.equal(flat(whole), flat(build_gpt_stages(cfg, 1, seed=4)))
    ids, tgt = SyntheticTokens(cfg.vocab_size, cfg.seq_len, seed=1).batch(0, 3)
    x = ids
    for m in parts:
        x = m(x)
    assert x.shape == (3, cfg.seq_len, cfg.vocab_size)
    assert torch.equal(x, whole[0](ids))
    assert torch.isfinite(gpt_loss(x, tgt))
    assert layer_split(5, 2) == [[0, 1, 2], [3, 4]]
    with pytest.raises(ValueError, match="at least one block per stage"):
        layer_split(2, 3)


def test_stage_modules_for_dualpipe_copies_are_independent_and_equal() -> None:
    sched = build_schedule("dualpipe", 2, 4)
    mods = stage_modules_for(sched, GPTConfig(), seed=0)
    assert sorted(mods) == [0, 1, 2, 3]
    for s in (2, 3):  # copies of model stages 0 and 1
        a, b = mods[s], mods[sched.model_stage[s]]
        assert a is not b
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=False))
    assert sorted(stage_modules_for(sched, GPTConfig(), seed=0, rank=0)) == list(sched.stages_of_rank(0))


def test_synthetic_tokens_are_deterministic_and_shifted() -> None:
    d = SyntheticTokens(vocab_size=50, seq_len=12, seed=5)
    a, ta = d.batch(2, 4)
    b, tb = SyntheticTokens(vocab_size=50, seq_len=12, seed=5).batch(2, 4)
    assert torch.equal(a, b) and torch.equal(ta, tb)
    assert a.shape == ta.shape == (4, 12) and a.dtype == torch.int64
    assert torch.equal(a[:, 1:], ta[:, :-1])
    # every transition follows the table
    assert all(int(ta[i, t]) in d.successors[int(a[i, t])].tolist() for i in range(4) for t in range(12))
    assert not torch.equal(d.batch(3, 4)[0], a)
    with pytest.raises(ValueError):
        SyntheticTokens(vocab_size=1)
