"""``Pipeline(boundary_format=...)`` on spawned CPU processes (gloo + the native shm engine).

* ``packed`` is bit-exact against ``none`` (losses and every gradient, two
  steps with changing shapes and micro-batches of different sizes, three
  tensors per boundary: float with grad, int64, float without grad) on every
  schedule, over the torch and the native transport;
* ``bf16`` and ``fp8``: the demo's small GPT trained 50 steps ends within 2%
  of the loss of the uncompressed run, and the bytes per boundary message
  measured by the runtime are fp8 <= 0.52 x bf16 and <= 0.26 x fp32 (scales
  included), in both directions;
* the compat DualPipeV takes the same option (``packed`` bit-exact against ``none``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from boundary_format_runs import all_runs

from dualpipe_kernels.runtime.launch import spawn
from dualpipe_kernels.schedules import SCHEDULE_NAMES
from dualpipe_kernels.transport import native_available

TIMEOUT_S = 30.0
TRANSPORTS = ("torch", "native") if native_available() else ("torch",)
GPT_STEPS = 50


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    """Every rank's results of both parts, from one group of spawned processes."""
    return spawn(all_runs, 2, SCHEDULE_NAMES, TRANSPORTS, GPT_STEPS, TIMEOUT_S, timeout_s=300.0)


@pytest.fixture(scope="module")
def packed_runs(runs) -> list[dict[tuple[str, str, str], dict[str, Any]]]:
    return [r["packed"] for r in runs]


@pytest.fixture(scope="module")
def gpt_runs(runs) -> list[dict[str, dict[str, Any]]]:
    return [r["gpt"] for r in runs]


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.timeout(600)
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
def test_packed_is_bit_exact_against_none(packed_runs, schedule: str, transport: str) -> None:
    for rank, res in enumerate(packed_runs):
        none, packed = res[(schedule, transport, "none")], res[(schedule, transport, "packed")]
        assert packed["format"] == "packed" and none["format"] == "none"
        assert _equal(packed["losses"], none["losses"]), f"rank {rank}: losses differ"
        assert _equal(packed["grads"], none["grads"]), f"rank {rank}: gradients differ"
        # one message per boundary per micro-batch either way; packing adds at most ALIGN padding per tensor
        for d in ("activations", "gradients"):
            (n_none, b_none), (n_packed, b_packed) = none["sent"][d], packed["sent"][d]
            assert n_none == n_packed
            assert b_none <= b_packed <= b_none + 3 * 16 * n_packed
    assert any(res[(schedule, transport, "none")]["losses"][0] for res in packed_runs), "no rank computed a loss"


@pytest.mark.timeout(600)
def test_lossy_formats_train_like_uncompressed(gpt_runs) -> None:
    loss_rank = next(r for r in gpt_runs if r["none"]["losses"])
    base = loss_rank["none"]["losses"]
    assert len(base) == GPT_STEPS and base[-1] < 0.8 * base[0], f"the model did not learn: {base[0]} -> {base[-1]}"
    for fmt in ("bf16", "fp8"):
        final = loss_rank[fmt]["losses"][-1]
        assert abs(final - base[-1]) <= 0.02 * base[-1], f"{fmt}: final loss {final} vs {base[-1]} uncompressed"


@pytest.mark.timeout(600)
def test_fp8_wire_bytes_per_boundary(gpt_runs) -> None:
    for rank, res in enumerate(gpt_runs):
        for d in ("activations", "gradients"):
            per = {}
            for fmt in ("none", "bf16", "fp8"):
                n, nbytes = res[fmt]["sent"][d]
                assert n > 0, f"rank {rank} sent no {d}"
                per[fmt] = nbytes / n
            assert per["fp8"] <= 0.52 * per["bf16"], f"rank {rank} {d}: {per}"
            assert per["fp8"] <= 0.26 * per["none"], f"rank {rank} {d}: {per}"


def test_compat_takes_the_option(runs) -> None:
    for rank, res in enumerate(r["compat"] for r in runs):
        none, packed = res["none"], res["packed"]
        assert (none["format"], packed["format"]) == ("none", "packed")
        assert _equal(packed["loss"], none["loss"]) and _equal(packed["grads"], none["grads"]), f"rank {rank}"
    assert runs[0]["compat"]["none"]["loss"] is not None
