"""The bare pipeline of ``bench schedules``' short-chunk row (benchmarks/compute_floor.py: bare_pipeline).

Four spawned ranks run DualPipeV 4 x 8 with chunks that log their forwards, over a transport that logs every
send post, receive post and receive wait: first a real pipeline (its fourth step, where every message is one
transfer), then the bare pipeline.  Checked: each bare step is exactly the runtime's step's events in the same
order (receives posted as the runtime's window posts them and waited by the compute half that reads them, an
F&B pair's forward send between its halves, every other send at its SEND).
"""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    from bare_workers import bare_run

    from dualpipe_kernels.runtime.launch import spawn

    return spawn(bare_run, 4, 8, timeout_s=120.0)


@pytest.mark.timeout(180)
def test_each_step_waits_and_sends_where_the_runtime_does(runs: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(runs):
        want = [tuple(e) for e in res["runtime"]]
        log = [tuple(e) for e in res["bare"]]
        assert want and len(log) == 2 * len(want), f"rank {rank}: {len(log)} events in two steps, {len(want)} a step"
        assert log[: len(want)] == want and log[len(want) :] == want, f"rank {rank}: not the runtime's order"
        assert sum(e[0] == "wait" for e in want) == sum(e[0] == "post" for e in want) > 0
        assert sum(e[0] == "F" for e in want) == 2 * 8, "every forward of the rank's two stages, once"
    assert all(r["pairs"] for r in runs), "DualPipeV 4 x 8 has F&B pairs on every rank"
    steps = [[tuple(e) for e in r["runtime"]] for r in runs]
    # what makes the order worth checking: a pair's B half waits after its F half (a forward, then a wait),
    # its forward send goes out between the halves (a send, then the B half's wait), and receives are posted
    # ahead of the compute that reads them (a post that is not followed by its own wait)
    pairs = [(a, b) for w in steps for a, b in zip(w, w[1:], strict=False)]
    assert any(a[0] == "F" and b[0] == "wait" for a, b in pairs)
    assert any(a[0] == "send" and b[0] == "wait" for a, b in pairs)
    assert any(a[0] == "post" and b != ("wait", a[1]) for a, b in pairs)


@pytest.mark.timeout(180)
def test_the_timed_step_is_reported(runs: list[dict[str, Any]]) -> None:
    for res in runs:
        assert len(res["times"]) == 1 and res["times"][0] > 0
