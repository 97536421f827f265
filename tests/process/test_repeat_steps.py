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
from repeat_workers import FOOTPRINT_FROM

STEPS = 50


#: a native transport that takes messages up to 64 KiB (its default on a core per rank) or a whole ring slot
#: (the default when ranks share CPUs), with 48 KiB activations (more than the pipeline's own inline limit of
#: 32 KiB) and 128 KiB ones (handed over: repeat.HANDOVER_MIN_BYTES)
SETUPS = {
    "native": ("native", 8, None),
    "torch": ("torch", 8, None),
    "native-48k": ("native", 12 * 1024, 64 * 1024),
    "native-128k-handover": ("native", 32 * 1024, 260 * 1024),
}


@pytest.fixture(scope="module")
def all_runs() -> list[dict[str, Any]]:
    """Every setup's run, one after another in one spawned pair (``spawn_checks``: the start is paid once)."""
    from repeat_workers import long_run
    from spawn_checks import run_checks

    from dualpipe_kernels.runtime.launch import spawn

    checks = tuple((name, long_run, (STEPS, *setup)) for name, setup in SETUPS.items())
    return spawn(run_checks, 2, checks, timeout_s=240.0 * len(SETUPS))


@pytest.fixture(scope="module", params=list(SETUPS))
def runs(request: pytest.FixtureRequest, all_runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from spawn_checks import results

    out = results(all_runs, request.param)
    for res in out:
        res["setup"] = request.param
    return out


@pytest.mark.timeout(600)  # the first test to ask for the runs: its setup runs all of them
def test_repeats_are_bit_exact_against_the_general_protocol(runs: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(runs):
        assert res["True"]["losses"] == res["False"]["losses"], f"rank {rank}: losses differ"
        for s, grads in res["grads/True"].items():
            for a, b in zip(grads, res["grads/False"][s], strict=True):
                assert torch.equal(a, b), f"rank {rank}, stage {s}: gradients differ"
        # the last step's, bit for bit (by then received gradients are repeats too, large ones handed over)
        assert res["grads_last/True"] == res["grads_last/False"], f"rank {rank}: last step's gradients differ"
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
        # taken after each step from FOOTPRINT_FROM on
        assert len(run["tensors"]) == STEPS - FOOTPRINT_FROM and len(set(run["tensors"])) == 1, (
            f"rank {rank}: live tensors grow: {run['tensors']}"
        )
        assert run["rss"][-1] - run["rss"][0] < 4 << 20, f"rank {rank}: RSS grew {run['rss'][-1] - run['rss'][0]} B"
        general = res["False"]["entries"][-1]
        assert general == (0, 0), "the forced run kept no entries"
        assert res["closed/True"] == (0, 0, 0), f"rank {rank}: close() left {res['closed/True']}"


@pytest.mark.timeout(300)
def test_large_messages_repeat_inline_up_to_what_the_transport_takes(runs: list[dict[str, Any]]) -> None:
    """A native transport that takes whole messages of N bytes raises the pipeline's inline limit to N less
    the 1 KiB header; 128 KiB messages are then handed over (every received message of a step once all
    repeat), smaller ones not."""
    from dualpipe_kernels.runtime.boundary.inline import INLINE_MAX_BYTES, META_BYTES

    setup = runs[0]["setup"]
    _, width, inline = SETUPS[setup]
    for rank, res in enumerate(runs):
        want = max(INLINE_MAX_BYTES, inline - META_BYTES) if inline is not None else None
        if want is not None:
            assert res["inline_limit"] == want, f"rank {rank}: inline limit {res['inline_limit']}, want {want}"
        run = res["True"]
        _, recvs = run["entries"][-1]
        assert recvs > 0, f"rank {rank}: messages of {4 * width} B do not repeat inline"
        handed = run["handovers"][-1]
        assert handed == (recvs if 4 * width >= 64 * 1024 else 0), f"rank {rank}: {handed} of {recvs} handed over"
