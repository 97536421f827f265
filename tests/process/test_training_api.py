"""What a training loop needs from the API: gradient scale, the step's loss on every rank, stage modules.

One 2-rank spawn runs a DualPipeV pipeline built with ``build_stage_modules``
from a layer factory and checks:

* ``scale_grads=True`` (default): gradients bit-equal the single-process
  reference seeded the same way (``run_reference``), and equal the full-batch
  gradients of the same model with a mean loss within a relative error of 1e-6
  (not bit-exact: the full batch reduces each weight gradient over all rows in
  one matmul, the pipeline over each micro-batch's rows then across micro-batches,
  a different summation order);
* ``scale_grads=False``: exactly N x those gradients (N = 4, a power of two);
* ``StepResult.loss``: this rank's mean, and with ``reduce_loss=True`` the
  step's mean loss on both ranks (equal to the full-batch mean loss);
* under ``torch.profiler`` one ``record_function`` range per executed action,
  named as the action; ``Pipeline.write_trace`` writes both ranks' measured
  step as one chrome trace; the ``dualpipe_kernels`` logger's debug line.
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn as nn
from toy_models import make_tensors, mse_criterion, seeded_layer

from dualpipe_kernels.runtime import Pipeline, build_stage_modules, run_reference, spawn
from dualpipe_kernels.schedules.generators import build_schedule

LAYERS, ROWS, N = 8, 16, 4  # layers of toy_models.DIM features


def _layer(i: int) -> nn.Module:
    return seeded_layer(100 + i)  # seeded by index: every rank builds the same layer i


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    (x,), (t,) = make_tensors("toy", ROWS, seed=7)
    return x, t


def _named_grads(mods: dict[int, Any]) -> dict[str, torch.Tensor]:
    return {m.full_name(n): p.grad.clone() for m in mods.values() for n, p in m.named_parameters()}


def _worker(rank: int, world: int) -> dict[str, Any]:
    torch.use_deterministic_algorithms(True)
    sched = build_schedule("dualpipev", world, N)
    x, t = _batch()
    mods = build_stage_modules(sched, _layer, num_layers=LAYERS)
    out: dict[str, Any] = {"stages": {s: (m.first_layer, len(m)) for s, m in mods.items()}}
    pipe = Pipeline(sched, mods, timeout_s=30.0)
    res = pipe.step(x, labels=(t,), criterion=mse_criterion, reduce_loss=True)
    out["reduced_loss"], out["losses"] = res.loss, res.losses
    out["scaled"] = _named_grads(mods)
    pipe.zero_grad(set_to_none=True)
    local = pipe.step(x, labels=(t,), criterion=mse_criterion)
    out["local_loss"] = local.loss
    pipe.close()
    pipe.zero_grad(set_to_none=True)
    summed = Pipeline(sched, mods, timeout_s=30.0, scale_grads=False)
    summed.step(x, labels=(t,), criterion=mse_criterion)
    summed.close()
    out["summed"] = _named_grads(mods)
    out.update(_observability(rank, sched, mods))
    out["dualpipe"] = _dualpipe(x, t)
    if rank == 0:  # the single-process reference, same threads and kernels as the ranks
        every = {**build_stage_modules(sched, _layer, num_layers=LAYERS, rank=0)}
        every.update(build_stage_modules(sched, _layer, num_layers=LAYERS, rank=1))
        run_reference(every, sched, (x,), (t,), mse_criterion)
        out["reference"] = _named_grads(every)
        full = nn.Sequential(*[_layer(i) for i in range(LAYERS)])
        loss = mse_criterion(full(x), t)
        loss.backward()
        out["full_loss"] = loss.detach()
        out["full"] = {n: p.grad.clone() for n, p in full.named_parameters()}
    return out


def _dualpipe(x: torch.Tensor, t: torch.Tensor) -> dict[str, Any]:
    """DualPipe: both ranks hold loss stages; mirror copies summed by the runtime."""
    sched = build_schedule("dualpipe", 2, N)
    mods = build_stage_modules(sched, _layer, num_layers=LAYERS)
    pipe = Pipeline(sched, mods, timeout_s=30.0)
    try:
        res = pipe.step(x, labels=(t,), criterion=mse_criterion, reduce_loss=True)
    finally:
        pipe.close()
    first = {m.full_name(k): p.grad.clone() for s, m in sorted(mods.items())[:1] for k, p in m.named_parameters()}
    second = {m.full_name(k): p.grad.clone() for s, m in sorted(mods.items())[1:] for k, p in m.named_parameters()}
    return {"loss": res.loss, "losses": res.losses, "grads": {**first, **second}}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _observability(rank: int, sched: Any, mods: dict[int, Any]) -> dict[str, Any]:
    """Profiler ranges, the written trace and the debug log of one step."""
    x, t = _batch()
    logger, lines = logging.getLogger("dualpipe_kernels"), _Lines()
    logger.addHandler(lines)
    logger.setLevel(logging.DEBUG)
    try:
        pipe = Pipeline(sched, mods, timeout_s=30.0, record_timeline=True, transport="torch")
        probe = Pipeline(sched, mods, timeout_s=30.0)  # "auto": native on one host, with its per-peer details
        probe.close()
    finally:
        logger.removeHandler(lines)
        logger.setLevel(logging.NOTSET)
    try:
        labels = [str(a) for a in pipe.schedule.actions[rank]]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            res = pipe.step(x, labels=(t,), criterion=mse_criterion)
        path = f"{tempfile.gettempdir()}/dpk_trace_{id(pipe)}.json"
        # The exported trace, not prof.events(): FunctionEvent names are demangled ("2F0" reads as "F0").
        prof.export_chrome_trace(path)
        events = json.load(open(path))["traceEvents"]  # noqa: SIM115
        ranges = Counter(
            e["name"] for e in events if e.get("cat") == "user_annotation" and e["name"][0] in "(0123456789"
        )
        written = pipe.write_trace(path, res)
        trace = json.load(open(path)) if written else None  # noqa: SIM115
    finally:
        pipe.close()
    return {"labels": labels, "ranges": dict(ranges), "log": lines.lines, "trace": trace, "timeline": res.timeline}


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return spawn(_worker, 2, timeout_s=240)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.timeout(300)
def test_stage_modules_from_a_factory(runs: list[dict[str, Any]]) -> None:
    assert runs[0]["stages"] == {0: (0, 2), 3: (6, 2)}  # the V: rank 0 runs layers 0-1 and 6-7
    assert runs[1]["stages"] == {1: (2, 2), 2: (4, 2)}


@pytest.mark.timeout(300)
def test_scaled_grads_match_the_full_batch_mean_loss(runs: list[dict[str, Any]]) -> None:
    scaled = {**runs[0]["scaled"], **runs[1]["scaled"]}
    ref, full = runs[0]["reference"], runs[0]["full"]
    assert sorted(scaled) == sorted(full)
    for name, g in scaled.items():
        assert torch.equal(g, ref[name]), f"{name}: pipeline != run_reference (same order, must be bit-exact)"
        assert _rel(g, full[name]) <= 1e-6, f"{name}: rel error {_rel(g, full[name]):.2e} vs the full batch"


@pytest.mark.timeout(300)
def test_unscaled_grads_are_the_micro_batch_sum(runs: list[dict[str, Any]]) -> None:
    for r in runs:
        for name, g in r["summed"].items():
            assert torch.equal(g, N * r["scaled"][name]), name


@pytest.mark.timeout(300)
def test_step_loss_on_every_rank(runs: list[dict[str, Any]]) -> None:
    r0, r1 = runs
    mean0 = torch.stack([v.double() for v in r0["losses"].values()]).mean().float()
    assert len(r0["losses"]) == N and not r1["losses"]  # DualPipeV: rank 0 holds the loss stage
    assert r0["reduced_loss"].dtype == torch.float32 and r0["reduced_loss"].dim() == 0
    assert torch.equal(r0["reduced_loss"], mean0) and torch.equal(r1["reduced_loss"], mean0)
    assert torch.equal(r0["local_loss"], mean0) and r1["local_loss"] is None
    assert _rel(mean0, r0["full_loss"]) <= 1e-6


def test_build_stage_modules_places_every_schedule() -> None:
    layers = [nn.Linear(2, 2) for _ in range(6)]
    dp = build_schedule("dualpipe", 2, 4)  # two model stages, each on both ranks (mirror copies)
    r0, r1 = (build_stage_modules(dp, layers, rank=r) for r in (0, 1))
    assert {s: m.first_layer for s, m in r0.items()} == {0: 0, 3: 3}
    assert {s: m.first_layer for s, m in r1.items()} == {1: 3, 2: 0}
    assert r0[0][0] is layers[0] and r1[2][0] is layers[0]  # shared with the model given
    il = build_schedule("interleaved1f1b", 2, 4, stages_per_rank=3)
    mods = build_stage_modules(il, layers, rank=1)
    assert [(s, m.first_layer, len(m)) for s, m in mods.items()] == [(1, 1, 1), (3, 3, 1), (5, 5, 1)]
    assert mods[3].full_name("0.weight") == "3.weight"
    with pytest.raises(ValueError, match="partition"):
        build_stage_modules(dp, layers, rank=0, partition=[1, 1])
    with pytest.raises(ValueError, match="num_layers"):
        build_stage_modules(dp, lambda i: nn.Linear(2, 2), rank=0)


@pytest.mark.timeout(300)
def test_dualpipe_loss_and_mirrored_grads(runs: list[dict[str, Any]]) -> None:
    """Losses on both ranks, reduced to one mean; each model stage's synced copies give the full-batch gradient."""
    d0, d1 = runs[0]["dualpipe"], runs[1]["dualpipe"]
    every = {**d0["losses"], **d1["losses"]}
    assert sorted(every) == list(range(N)) and d0["losses"] and d1["losses"]
    mean = torch.stack([every[m].double() for m in sorted(every)]).sum() / N
    assert torch.equal(d0["loss"], d1["loss"]) and abs(float(d0["loss"]) - float(mean)) <= 1e-6 * float(mean)
    full = runs[0]["full"]
    for grads in (d0["grads"], d1["grads"]):
        assert sorted(grads) == sorted(full)  # rank r holds model stages r and 1 - r: every layer
        for name, g in grads.items():
            assert _rel(g, full[name]) <= 1e-6, f"{name}: {_rel(g, full[name]):.2e}"


@pytest.mark.timeout(300)
def test_profiler_range_per_action(runs: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(runs):
        assert r["ranges"] == dict(Counter(r["labels"])), f"rank {rank}: ranges differ from the action list"
        assert all(n == 1 for n in r["ranges"].values())
        assert any("OVERLAP_F_B" in k for k in r["ranges"]) and any("SEND_F" in k for k in r["ranges"])


@pytest.mark.timeout(300)
def test_write_trace_holds_every_rank(runs: list[dict[str, Any]]) -> None:
    assert runs[1]["trace"] is None  # group rank 0 writes
    spans = [e for e in runs[0]["trace"]["traceEvents"] if e.get("ph") == "X"]
    assert len(spans) == len(runs[0]["timeline"]) + len(runs[1]["timeline"])
    assert runs[0]["trace"]["otherData"]["schedule"] == "dualpipev"


@pytest.mark.timeout(300)
def test_debug_log_says_what_was_chosen(runs: list[dict[str, Any]]) -> None:
    # the pipelines' own lines (the transport layer logs its per-peer choice too, under dualpipe_kernels.transport)
    line, auto = [m for m in runs[1]["log"] if m.startswith("pipeline rank")]
    assert "pipeline rank 1" in line and "transport per peer {0: torch}" in line and "scale_grads=True" in line
    assert "transport per peer {0: native" in auto
