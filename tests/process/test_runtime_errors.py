"""Bad input and a dead peer: a clear error on every rank, and every rank exits (no hang).

Bad input: every case of ``CASES`` runs on 2 spawned ranks (one spawn shared
with tests/process/test_fail_fast.py, conftest's ``error_runs``; a fresh process group
per case) with a short pipeline timeout (``TIMEOUT_S``, every wait).  The rank
that holds the mistake raises a ValueError naming the constraint; the other
rank raises too, naming the culprit as its peer (or repeating the constraint
when it made the same mistake), within the timeout.

Dead peer: one rank's stage calls ``os._exit(3)`` on its third forward (mid
step); the survivor raises within the timeout, naming the dead peer.
"""

from __future__ import annotations

import re
import time

import pytest
from rank_lifecycle import BAD_INPUT_CASES, BAD_INPUT_TIMEOUT_S, kill_mid_step

from dualpipe_kernels.runtime.launch import spawn_outcomes
from dualpipe_kernels.schedules.generators import build_schedule

TIMEOUT_S = BAD_INPUT_TIMEOUT_S  # every wait inside a step
SPAWN_LIMIT_S = 240.0  # the launcher kills ranks still running after this: reaching it is a hang
SLACK_S = 5.0  # allowed on top of TIMEOUT_S for one case

# case -> (rank holding the mistake (None: every rank), regex the culprit's error must match)
CASES = {
    "compat_few_microbatches": (None, r"ValueError.*num_chunks >= 2 \* ranks"),
    "compat_wrong_module_count": (0, r"ValueError.*exactly two"),
    "batch_smaller_than_microbatches": (0, r"ValueError.*smaller than .*micro-batches"),
    "wrong_module_count": (0, r"ValueError.*(?i:stage|module)"),
    "no_criterion": (0, r"ValueError.*criterion"),
    "view_output": (1, r"ValueError.*view"),
}


def _names_peer(err: str, peer: int) -> bool:
    return re.search(rf"(?i)peer\D{{0,24}}{peer}\b", err) is not None


@pytest.fixture(scope="module")
def bad_input_results(error_runs):
    return [res["bad_inputs"] for res in error_runs]  # spawned once per session (conftest.py)


def test_every_bad_input_case_runs_and_has_an_expectation():
    assert set(BAD_INPUT_CASES) == set(CASES)


def test_too_few_microbatches_is_rejected_by_the_schedule():
    with pytest.raises(ValueError, match=r"(?i)micro"):
        build_schedule("dualpipev", 2, 3)
    with pytest.raises(ValueError, match=r"(?i)micro|even"):
        build_schedule("dualpipe", 4, 6)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_raises_on_every_rank(case, bad_input_results):
    culprit, pattern = CASES[case]
    for rank, res in enumerate(bad_input_results):
        got = res[case]
        err = got["error"]
        assert err is not None, f"{case}: rank {rank} did not raise"
        assert got["elapsed_s"] < TIMEOUT_S + SLACK_S, f"{case}: rank {rank} took {got['elapsed_s']:.1f} s to fail"
        if culprit is None or rank == culprit:
            assert re.search(pattern, err, re.S), f"{case}: rank {rank} error does not match {pattern!r}:\n{err}"
        else:
            assert _names_peer(err, culprit) or re.search(pattern, err, re.S), (
                f"{case}: rank {rank} error names neither its peer {culprit} nor the cause:\n{err}"
            )


@pytest.mark.timeout(300)
def test_killed_rank_is_named_by_the_survivor():
    victim, timeout_s = 1, 10.0
    t0 = time.monotonic()
    outcomes = spawn_outcomes(kill_mid_step, 2, victim, 3, timeout_s, timeout_s=SPAWN_LIMIT_S, pg_timeout_s=60)
    elapsed = time.monotonic() - t0
    dead = outcomes[victim]
    assert not dead.ok and dead.exitcode == 3, f"victim: {dead}"
    survivor = outcomes[1 - victim]
    assert not survivor.ok, f"survivor returned {survivor.value!r} although its peer died mid-step"
    err = survivor.error or ""
    assert "timed out after" not in err.splitlines()[0], f"survivor hung and was killed:\n{err}"
    assert _names_peer(err, victim), f"survivor's error does not name peer {victim}:\n{err}"
    # process start (seconds) + the survivor's wait, bounded by the pipeline timeout
    assert elapsed < timeout_s + 60, f"took {elapsed:.1f} s"


def test_a_rank_that_cannot_start_raises_its_own_error():
    """A function spawn cannot pickle (a lambda) fails in ``Process.start``: that error reaches the caller, not
    an AssertionError from joining the processes that never started."""
    import pickle

    # (pickle says PicklingError or AttributeError depending on where the lambda lives)
    with pytest.raises((pickle.PicklingError, AttributeError), match="pickle"):
        spawn_outcomes(lambda rank, world: rank, 2, timeout_s=10)
