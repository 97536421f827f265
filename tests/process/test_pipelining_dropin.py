"""torch.distributed.pipelining's own example run with the drop-in (dualpipe_kernels.integrations.pipelining).

The program of tests/support/pipelining_workers.py (torch's documented PipelineStage + schedule example,
float64, 2 SGD steps on 2 processes over gloo) runs once with torch's ``ScheduleDualPipeV``,
``Schedule1F1B``, ``ScheduleZBVZeroBubble``, ``ScheduleInterleaved1F1B``, ``ScheduleGPipe`` and once with
ours, the import the only change.  What user code sees must be the same:

* the gradients of both steps (the second from the updated weights) bit for bit (``torch.equal``): each stage
  accumulates its micro-batches' gradients in the same micro-batch order under both runtimes, and the 1/N of
  ``scale_grads=True`` is a power of two here (N = 4), so seeding each loss with 1/N (ours) and dividing the
  sum by N (torch) round alike; with another N they would differ in the last bit;
* the ``losses`` list on the last stage's rank, the return value of ``step`` there (the merged outputs) and
  None on the other rank, for ``scale_grads`` True and False.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from pipelining_workers import CASES, OURS, STEPS, TORCH, both, stage_indices

from dualpipe_kernels.runtime import spawn


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return spawn(both, 2, timeout_s=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("schedule", "scale"), CASES, ids=[f"{s}-scale_grads={v}" for s, v in CASES])
def test_the_example_sees_what_it_sees_under_torch(runs: list[dict[str, Any]], schedule: str, scale: bool) -> None:
    last_rank = next(r for r in range(2) if 2 * len(stage_indices(schedule, 0, 2)) - 1 in stage_indices(schedule, r, 2))
    for r in runs:
        theirs, ours = r[f"{schedule}/{scale}/{TORCH}"]["steps"], r[f"{schedule}/{scale}/{OURS}"]["steps"]
        assert len(theirs) == len(ours) == STEPS
        for step, (t, o) in enumerate(zip(theirs, ours, strict=True)):
            where = f"{schedule} scale_grads={scale} rank {r['rank']} step {step}"
            assert t["grads"].keys() == o["grads"].keys(), where
            for name, g in t["grads"].items():
                assert torch.equal(g, o["grads"][name]), f"{where}: {name}"
            assert t["losses"] == o["losses"], where
            if r["rank"] == last_rank:
                assert len(o["losses"]) == 4 and o["result"] is not None and torch.equal(t["result"], o["result"])
            else:
                assert t["result"] is None and o["result"] is None and o["losses"] is None, where


@pytest.mark.parametrize("schedule", ["ScheduleDualPipeV", "Schedule1F1B"])
def test_keyword_inputs_reach_every_stage_as_under_torch(runs: list[dict[str, Any]], schedule: str) -> None:
    """``step(x, shift=s)``: torch gives every stage its micro-batch's slice of ``shift``; ours with
    ``keyword_inputs=True`` the same (the micro-batch index rides along the boundaries): bit for bit."""
    for r in runs:
        t, o = r[f"keywords/{schedule}/{TORCH}"], r[f"keywords/{schedule}/{OURS}"]
        for name, g in t["grads"].items():
            assert torch.equal(g, o["grads"][name]), f"rank {r['rank']}: {name}"
        assert t["losses"] == o["losses"]
        assert (t["result"] is None and o["result"] is None) or torch.equal(t["result"], o["result"])


def test_what_the_drop_in_refuses_is_named(runs: list[dict[str, Any]]) -> None:
    for r in runs:
        err = r["errors"]
        assert f"rank {r['rank']} holds stages" in err["placement"] and "got stages" in err["placement"], err
        assert "keyword stage inputs ['mask'] need the schedule built with keyword_inputs=True" in err["kwargs"], err


@pytest.mark.timeout(300)
def test_torchtitans_calls_pick_and_run_ours() -> None:
    """torchtitan's selection by name (``use_dualpipe_kernels``), its V placement test, its constructor call
    and its train step's call with a keyword input for every stage, as torchtitan passes ``positions``
    (tests/support/pipelining_workers.titan, as torchtitan 0.3.0 makes them; the package itself is not a test
    dependency): our class is built, on the V, and its gradients and summed loss
    equal torch's ScheduleDualPipeV's bit for bit (scale_grads=False: the same sums in the same order)."""
    from pipelining_workers import titan

    for r in spawn(titan, 2, False, timeout_s=240):
        assert r["torch"]["class"] == "torch.distributed.pipelining.schedules.ScheduleDualPipeV"
        assert r["ours"]["class"] == "dualpipe_kernels.integrations.pipelining.ScheduleDualPipeV"
        assert r["ours"]["stages"] == r["torch"]["stages"] and len(r["ours"]["stages"]) == 2
        assert r["ours"]["loss"] == r["torch"]["loss"]
        for name, g in r["torch"]["grads"].items():
            assert torch.equal(g, r["ours"]["grads"][name]), name
        assert r["restored"]


def test_eval_runs_forwards_only(runs: list[dict[str, Any]]) -> None:
    """eval(): rank 0 (the V's last stage) gets the model's outputs and per-micro-batch losses bit for bit as
    one process computes them (the same ops in the same order, float64); no rank gets gradients."""
    import torch.nn.functional as F
    from pipelining_workers import N, batch, layer

    x, target = batch()
    with torch.no_grad():
        y = x
        for i in range(4):
            y = layer(i)(y)
    want = [float(F.mse_loss(a, b)) for a, b in zip(y.chunk(N), target.chunk(N), strict=True)]
    ev0, ev1 = runs[0]["eval"], runs[1]["eval"]
    assert torch.equal(ev0["result"], y) and ev0["losses"] == want
    assert ev1["result"] is None and ev1["losses"] == []
    assert ev0["no_grads"] and ev1["no_grads"] and ev0["after"] is None and ev1["after"] is None
