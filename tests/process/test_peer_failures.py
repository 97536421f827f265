"""Failures spread: a rank whose step raised tells its peers at once, and a killed rank is named by all.

Before: a rank whose step raised while its process lived on left its peers
waiting for their whole timeout (here 60 s), and with 4 ranks and one killed,
rank 0 named its neighbour, not the dead rank.
"""

from __future__ import annotations

import pytest
from peer_failure_workers import WAIT_S, one_killed, raise_and_live_on

from dualpipe_kernels.runtime.launch import spawn_outcomes


@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport", ["torch", "native"])
def test_a_failed_step_reaches_every_peer_within_seconds_naming_rank_and_error(transport: str) -> None:
    outs = spawn_outcomes(raise_and_live_on, 3, transport, timeout_s=200.0, failure_grace_s=30.0)
    assert all(o.ok for o in outs), [o.error for o in outs]
    res = [o.value for o in outs]
    assert "stage failed on purpose" in res[1]["error"]
    for r in (0, 2):
        err = res[r]["error"]
        assert err is not None and err.startswith("PeerFailed: "), err
        assert f"pipeline rank {r}: pipeline rank 1 failed: RuntimeError: stage failed on purpose" in err
        assert res[r]["after_s"] < WAIT_S / 4, res[r]  # the failure, not a timeout, ended the wait


@pytest.mark.timeout(240)
def test_a_killed_rank_is_named_by_every_other_rank() -> None:
    outs = spawn_outcomes(one_killed, 4, "torch", timeout_s=200.0, failure_grace_s=60.0)
    assert not outs[2].ok and outs[2].exitcode == -9
    for r in (0, 1, 3):
        assert outs[r].ok, outs[r].error
        err = outs[r].value["error"]
        assert err is not None and "pipeline rank 2 failed" in err, (r, err)
        assert outs[r].value["after_s"] < WAIT_S / 2, outs[r].value


@pytest.mark.timeout(240)
def test_a_reduce_loss_that_only_some_ranks_ask_for_is_named_on_both() -> None:
    from peer_failure_workers import reduce_loss_mismatch

    outs = spawn_outcomes(reduce_loss_mismatch, 2, timeout_s=200.0, failure_grace_s=30.0)
    assert all(o.ok for o in outs), [o.error for o in outs]
    e0, e1 = outs[0].value["error"], outs[1].value["error"]
    assert e0 is not None and "Every rank must pass the same reduce_loss to step()" in e0, e0
    assert e1 is not None and "pipeline rank 0 failed" in e1 and "reduce_loss" in e1, e1
