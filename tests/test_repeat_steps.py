"""Repeated small messages over 50 real steps (2 spawned ranks, DualPipeV 2 x 8, tiny stages).

The same training run with the repeat path on and with every message forced
through the general protocol: losses and gradients bit-exact; with repeats on,
the pooled receive buffers are allocated in the first steps only, the repeat
tables hold one entry per message key from the second step on, live tensors
are flat and RSS grows < 4 MiB over 40 steps; ``close()`` empties it all.
Native transport (the shared-memory engine) and torch over gloo.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

STEPS = 50


@pytest.fixture(scope="module", params=["native", "torch"])
def runs(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    from repeat_workers import long_run

    from dualpipe_kernels.runtime.launch import spawn

    return spawn(long_run, 2, STEPS, request.param, timeout_s=240.0)


@pytest.mark.timeout(300)
def test_repeats_are_bit_exact_against_the_general_protocol(runs: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(runs):
        assert res["True"]["losses"] == res["False"]["losses"], f"rank {rank}: losses differ"
        for s, grads in res["grads/True"].items():
            for a, b in zip(grads, res["grads/False"][s], strict=True):
                assert torch.equal(a, b), f"rank {rank}, stage {s}: gradients differ"
    assert any(res["True"]["losses"][0] for res in runs), "the loss stage's rank reports losses"


@pytest.mark.timeout(300)
def test_fifty_steps_flat_with_repeats(runs: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(runs):
        run = res["True"]
        assert len(set(run["pool"][2:])) == 1, f"rank {rank}: pooled buffers keep changing: {run['pool']}"
        assert run["pool"][-1][0] > 0, f"rank {rank}: no pooled receive buffer was used"
        sends, recvs = run["entries"][-1]
        assert sends > 0 and recvs > 0, f"rank {rank}: no repeat entries: {run['entries']}"
        assert len(set(run["entries"][1:])) == 1, f"rank {rank}: repeat tables move: {run['entries']}"
        assert len(set(run["tensors"][10:])) == 1, f"rank {rank}: live tensors grow: {run['tensors']}"
        assert run["rss"][-1] - run["rss"][10] < 4 << 20, f"rank {rank}: RSS grew {run['rss'][-1] - run['rss'][10]} B"
        general = res["False"]["entries"][-1]
        assert general == (0, 0), "the forced run kept no entries"
        assert res["closed/True"] == (0, 0, 0), f"rank {rank}: close() left {res['closed/True']}"
