"""The local launcher stops a run at its first failure instead of waiting for its deadline.

Before: ``spawn_outcomes`` waited for the whole ``timeout_s`` (600 s behind
``demo``) after one rank had already failed, printing nothing.  Now the other
ranks get ``failure_grace_s`` to report, then are stopped and reported as
stopped because of the first failed rank.

Every test runs under both start methods (``DPK_START_METHOD``): ``spawn``, the default, and ``forkserver``,
which the rest of the suite uses.
"""

from __future__ import annotations

import os
import time

import pytest
from launch_workers import all_fine, env_of, one_dies, one_raises

from dualpipe_kernels.runtime.launch import RanksFailed, spawn, spawn_outcomes, start_method

GRACE_S = 1.0
STUCK_S = 120.0  # what a stuck peer would wait: far beyond what the test accepts


@pytest.fixture(autouse=True, params=["spawn", "forkserver"])
def method(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("DPK_START_METHOD", request.param)
    assert start_method() == request.param
    return str(request.param)


@pytest.mark.parametrize("fn, cause", [(one_raises, "rank 1 failed on purpose"), (one_dies, "exit code 3")])
def test_first_failure_stops_the_run_and_names_the_failed_rank(fn, cause) -> None:
    t0 = time.monotonic()
    outcomes = spawn_outcomes(fn, 3, STUCK_S, timeout_s=300.0, failure_grace_s=GRACE_S)
    took = time.monotonic() - t0
    assert took < 60.0, f"the launcher waited {took:.0f} s after rank 1 failed"
    assert [o.ok for o in outcomes] == [False, False, False]
    assert cause in (outcomes[1].error or "")
    for r in (0, 2):
        assert outcomes[r].error == f"rank {r} was stopped 1 s after rank 1 failed"


def test_spawn_raises_ranks_failed_naming_each_rank() -> None:
    with pytest.raises(RanksFailed) as info:
        spawn(one_raises, 2, STUCK_S, timeout_s=300.0, failure_grace_s=GRACE_S)
    text = str(info.value)
    assert "rank 1 (exit code" in text and "rank 1 failed on purpose" in text
    assert "rank 0 was stopped 1 s after rank 1 failed" in text


def test_a_run_without_failures_returns_every_value() -> None:
    assert spawn(all_fine, 3, 0.0, timeout_s=300.0, failure_grace_s=0.0) == [0, 10, 20]


def test_a_negative_grace_is_refused() -> None:
    with pytest.raises(ValueError, match="failure_grace_s"):
        spawn_outcomes(all_fine, 1, 0.0, failure_grace_s=-1.0)


def test_ranks_see_the_environment_of_the_call_under_either_start_method(
    method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A variable set after the fork server started still reaches the ranks; ``env=`` adds to it."""
    monkeypatch.setenv("DPK_TEST_SET_LATE", f"late-{time.monotonic_ns()}")
    got = spawn(env_of, 2, ("DPK_TEST_SET_LATE", "DPK_TEST_EXTRA"), env={"DPK_TEST_EXTRA": method})
    assert got == [[os.environ["DPK_TEST_SET_LATE"], method]] * 2


def test_an_unknown_start_method_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DPK_START_METHOD", "fork")
    with pytest.raises(ValueError, match="DPK_START_METHOD must be 'spawn' or 'forkserver', got 'fork'"):
        spawn(all_fine, 1, 0.0)
