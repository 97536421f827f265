"""A peer's failure reaches a rank blocked in a wait from inside its transport (``fail_all``), on every transport
a CPU machine has: within 1 s of its watch seeing the failure, and with no ``is_completed`` probe per wait.

Before: the watch woke a blocked wait only at the end of a slice of ``poll_s``, and every wait first probed
``is_completed`` (over gloo that hands the transfer to a waiter thread: about 120 us per action).
"""

from __future__ import annotations

import pytest
from fail_all_workers import blocked_wait_meets_a_failure

from dualpipe_kernels.runtime.launch import spawn_outcomes


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", ["native", "native-raw", "torch"])
def test_a_failure_ends_a_blocked_wait_within_a_second_of_the_watch_seeing_it(transport: str) -> None:
    outs = spawn_outcomes(blocked_wait_meets_a_failure, 2, transport, timeout_s=150.0, failure_grace_s=30.0)
    assert all(o.ok for o in outs), [o.error for o in outs]
    r0, r1 = outs[0].value, outs[1].value
    assert r0["fails_waits"] and r1["fails_waits"]
    assert r0["probes"] == 0 and r1["probes"] == 0, (r0, r1)  # 40 waits each, not one is_completed
    assert r0["error"] == "PeerFailed: pipeline rank 0: pipeline rank 1 failed: RuntimeError: stage 1 failed on purpose"
    assert r0["after_seen_s"] is not None and r0["after_seen_s"] < 1.0, r0
    assert r0["waited_s"] < 10.0, r0  # the failure, not the wait's own 60 s, ended it
    assert r0["later_post"] is not None and "pipeline rank 1 failed" in r0["later_post"], r0
    if transport == "native-raw":  # a bare engine request: the same errors as a handle's wait
        assert r0["raw_timeout"].startswith("TransportTimeout: ") and "a receive never sent" in r0["raw_timeout"], r0
        assert r0["raw_after_close"] is None and r1["raw_after_close"] is None
