"""Mistakes fail at Pipeline construction, on every rank, fast and naming the problem.

* A schedule the validator rejects (B before F, a deleted backward, a deadlock)
  never runs: ``Pipeline`` raises ScheduleError on every rank in under 1 s
  (before: it trained with wrong gradients, or hung for the full timeout).
* Ranks built with different micro-batch counts, schedules or transports fail
  together in under 2 s with a 60 s timeout configured, naming the ranks and the
  field (before: a generic transfer timeout after the full timeout).
* A stage on the ``meta`` device fails at construction naming the stage; a
  criterion called without the labels it needs says so (before: torch's raw
  device error at step time; a bare TypeError).
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from rank_fail_fast import CASES, TIMEOUT_S, broken_schedule
from torch import nn

from dualpipe_kernels.runtime import Pipeline
from dualpipe_kernels.runtime.checks import call_criterion
from dualpipe_kernels.runtime.fingerprint import disagreement, fingerprint, schedule_digest
from dualpipe_kernels.schedules.generators import build_schedule
from dualpipe_kernels.schedules.validate import ScheduleError

assert TIMEOUT_S == 60.0  # configured on every pipeline: no case may come near it

# case -> (limit on every rank's time to fail, exception type, regex its message must match)
EXPECT = {
    "b_before_f": (1.0, "ScheduleError", r"rank 1.*1B0"),
    "deleted_backward": (1.0, "ScheduleError", r"rank 1.*stage 1, micro-batch 1"),
    "deadlock": (1.0, "ScheduleError", r"deadlock"),
    "disagree_microbatches": (
        2.0,
        "RanksDisagree",
        r"disagree on microbatches.*group rank 0 .*: 4.*group rank 1 .*: 6",
    ),
    "disagree_schedule": (2.0, "RanksDisagree", r"disagree on schedule.*'1f1b'.*'gpipe'"),
    "disagree_transport": (2.0, "RanksDisagree", r"disagree on transport.*: torch.*: native"),
    # both ends of a message decide alike whether it travels inline (runtime/boundary/inline.py: inline_limit)
    "disagree_inline_limit": (2.0, "RanksDisagree", r"disagree on inline message limit.*: 64512.*: 32768"),
    # a per-stage memory policy is compared stage by stage among the ranks naming the stage
    "disagree_memory_policy": (2.0, "RanksDisagree", r"disagree on memory_policy\[stage 0\]: .*: recompute.*: keep"),
    "meta_stage": (1.0, "ValueError", r"stage \d+: 'weight' is on the meta device"),
}


@pytest.fixture(scope="module")
def results(error_runs):
    return [res["fail_fast"] for res in error_runs]  # spawned once per session (conftest.py)


def test_every_case_has_an_expectation():
    assert set(CASES) == {*EXPECT, "criterion_without_labels"}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(EXPECT))
def test_every_rank_fails_at_construction(case, results):
    limit, kind, pattern = EXPECT[case]
    for rank, res in enumerate(results):
        got = res[case]
        assert got["error"] is not None, f"{case}: rank {rank} did not raise"
        assert got["type"] == kind, f"{case}: rank {rank} raised {got['type']}, want {kind}:\n{got['error']}"
        assert re.search(pattern, got["error"], re.S), f"{case}: rank {rank}: no match for {pattern!r}:\n{got['error']}"
        assert got["elapsed_s"] < limit, f"{case}: rank {rank} took {got['elapsed_s']:.2f} s to fail (limit {limit})"


@pytest.mark.timeout(300)
def test_criterion_without_labels_says_so(results):
    loss_rank = results[1]["criterion_without_labels"]
    assert loss_rank["type"] == "ValueError", loss_rank["error"]
    assert re.search(r"stage 1, micro-batch 0: criterion.*1 output\(s\) and 0 label\(s\)", loss_rank["error"])
    assert "labels=" in loss_rank["error"]
    peer = results[0]["criterion_without_labels"]  # fails at once (the failed rank's close cancels its transfers)
    assert peer["error"] is not None and re.search(r"peer pipeline rank 1", peer["error"]), peer["error"]
    assert peer["elapsed_s"] < 2.0, f"the peer took {peer['elapsed_s']:.1f} s to fail"


@pytest.mark.parametrize("case", ["b_before_f", "deleted_backward", "deadlock"])
def test_broken_schedule_is_refused_before_needing_a_process_group(case):
    with pytest.raises(ScheduleError):
        Pipeline(broken_schedule(case), [nn.Linear(4, 4)])


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0, 0.0, "soon"])
def test_timeout_must_be_finite_and_positive(bad):
    with pytest.raises(ValueError, match=r"timeout_s must be (a number of seconds|a finite number of seconds|> 0)"):
        Pipeline(build_schedule("1f1b", 2, 2), [nn.Linear(4, 4)], timeout_s=bad)


def test_compat_timeout_nan_is_refused():
    from dualpipe_kernels.compat import DualPipeV

    with pytest.raises(ValueError, match=r"timeout_s must be a finite number of seconds, got nan"):
        DualPipeV([nn.Linear(4, 4), nn.Linear(4, 4)], timeout_s=math.nan)


def test_call_criterion_keeps_errors_raised_inside_the_criterion():
    def crit(out, label):
        raise TypeError("inside")

    with pytest.raises(TypeError, match="inside"):
        call_criterion(crit, (torch.ones(1),), (torch.ones(1),), "here")


def test_fingerprints_name_every_differing_field():
    a, b = build_schedule("1f1b", 2, 4), build_schedule("gpipe", 2, 6)
    err = disagreement(
        [fingerprint(a, 0, [0, 1], "torch"), fingerprint(b, 1, [0, 1], "native", extra={"boundary": "fp8"})]
    )
    assert err is not None and err.field == "microbatches"
    assert err.fields == ["microbatches", "schedule", "transport", "boundary"]
    assert err.values == {0: "4", 1: "6"}
    assert disagreement([fingerprint(a, 0, [0, 1], "torch"), fingerprint(a, 1, [0, 1], "torch")]) is None
    assert schedule_digest(a) == schedule_digest(build_schedule("1f1b", 2, 4)) != schedule_digest(b)


@pytest.mark.parametrize("module,cls", [("torch_dist", "TorchDistTransport"), ("native", "NativeTransport")])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_transport_timeout_must_be_finite(module, cls, bad):
    import importlib

    transport = getattr(importlib.import_module(f"dualpipe_kernels.transport.{module}"), cls)
    with pytest.raises(ValueError, match=r"timeout_s must be a finite number of seconds"):
        transport(timeout_s=bad)
