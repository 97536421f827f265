"""Checkpoints under the full model's names, moved between a 2-rank DualPipeV pipeline and one process with DCP.

Before the spawn, one process saves a full model (trained one step) with
``torch.distributed.checkpoint``; the 2 ranks load it into their stage modules
(``load_pipeline``), train one step and save (``save_pipeline``); one process
loads that into a fresh full model.  Both directions: parameters ``torch.equal``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from dualpipe_kernels.runtime import Pipeline, build_stage_modules, spawn
from dualpipe_kernels.runtime.checkpoint import load_stage_state_dict, stage_state_dict
from dualpipe_kernels.schedules import build_schedule

LAYERS, DIM = 8, 6


def _layer(i: int, seed: int) -> nn.Module:
    torch.manual_seed(seed * 100 + i)
    return nn.Sequential(nn.Linear(DIM, DIM), nn.LayerNorm(DIM))


def _sgd(params: Any) -> None:
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p -= 0.1 * p.grad
                p.grad = None


def _worker(rank: int, world: int, src: str, dst: str) -> dict[str, Any]:
    from dualpipe_kernels.runtime.checkpoint import load_pipeline, save_pipeline

    sched = build_schedule("dualpipev", world, 4)
    pipe = Pipeline(sched, build_stage_modules(sched, lambda i: _layer(i, seed=2), num_layers=LAYERS), timeout_s=30)
    try:
        load_pipeline(pipe, src)
        loaded = {k: v.clone() for k, v in pipe.model_state_dict().items()}
        torch.manual_seed(5)
        x, t = torch.randn(8, DIM), torch.randn(8, DIM)
        pipe.step(x, labels=(t,), criterion=nn.functional.mse_loss)
        _sgd(pipe.parameters())
        save_pipeline(pipe, dst)
        saved = {k: v.clone() for k, v in pipe.model_state_dict().items()}
    finally:
        pipe.close()
    # DualPipe: both ranks hold every layer (model stage r and a mirror of 1 - r); DCP writes each key once.
    dp = build_schedule("dualpipe", world, 4)
    mirrored = Pipeline(dp, build_stage_modules(dp, lambda i: _layer(i, seed=3), num_layers=LAYERS), timeout_s=30)
    try:
        load_pipeline(mirrored, src)
        save_pipeline(mirrored, dst + "_dualpipe")
        mods = mirrored.stage_modules.values()
        both_copies = [(m.full_name(k), p.detach().clone()) for m in mods for k, p in m.named_parameters()]
    finally:
        mirrored.close()
    return {"loaded": loaded, "saved": saved, "dualpipe": mirrored.model_state_dict(), "copies": both_copies}


@pytest.mark.timeout(300)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the one-process side, on purpose
def test_dcp_round_trip_between_pipeline_and_one_process(tmp_path: Path) -> None:
    full = nn.Sequential(*[_layer(i, seed=1) for i in range(LAYERS)])
    torch.manual_seed(3)
    nn.functional.mse_loss(full(torch.randn(4, DIM)), torch.randn(4, DIM)).backward()
    _sgd(full.parameters())  # not the initial weights any more
    dcp.save(full.state_dict(), checkpoint_id=str(tmp_path / "src"))
    ranks = spawn(_worker, 2, str(tmp_path / "src"), str(tmp_path / "dst"), timeout_s=240)
    loaded = {**ranks[0]["loaded"], **ranks[1]["loaded"]}
    assert sorted(loaded) == sorted(full.state_dict())  # every parameter, under the full model's names
    for k, v in full.state_dict().items():
        assert torch.equal(loaded[k], v), f"one process -> pipeline: {k}"
    fresh = nn.Sequential(*[_layer(i, seed=9) for i in range(LAYERS)])
    sd = fresh.state_dict()
    dcp.load(sd, checkpoint_id=str(tmp_path / "dst"))
    fresh.load_state_dict(sd)
    saved = {**ranks[0]["saved"], **ranks[1]["saved"]}
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, saved[k]), f"pipeline -> one process: {k}"
    assert not torch.equal(saved["0.0.weight"], loaded["0.0.weight"])  # the step changed them
    for r in ranks:  # DualPipe: every layer on both ranks, mirror copies loaded too; its save reads back whole
        assert sorted(r["dualpipe"]) == sorted(full.state_dict())
        assert all(torch.equal(v, full.state_dict()[k]) for k, v in r["dualpipe"].items())
        assert len(r["copies"]) == len(list(full.parameters()))  # 2 stage modules of 4 layers
        assert all(torch.equal(v, full.state_dict()[k]) for k, v in r["copies"])
    back = nn.Sequential(*[_layer(i, seed=9) for i in range(LAYERS)])
    sd = back.state_dict()
    dcp.load(sd, checkpoint_id=str(tmp_path / "dst_dualpipe"))
    assert all(torch.equal(v, full.state_dict()[k]) for k, v in sd.items())


def test_mirror_copies_are_saved_once_and_loaded_into_both() -> None:
    sched = build_schedule("dualpipe", 2, 4)
    layers = [nn.Linear(3, 3) for _ in range(4)]
    mods = {s: m for r in (0, 1) for s, m in build_stage_modules(sched, layers, rank=r).items()}  # one process
    sd = stage_state_dict(sched, mods)
    assert sorted(sd) == sorted(nn.Sequential(*layers).state_dict())  # 4 stage modules, 2 model stages: once each
    new = {k: torch.full_like(v, 7.0) for k, v in sd.items()}
    load_stage_state_dict(sched, mods, new)
    assert all(torch.equal(p, torch.full_like(p, 7.0)) for m in mods.values() for p in m.parameters())
    with pytest.raises(KeyError, match="no"):
        load_stage_state_dict(sched, mods, {})
    with pytest.raises(ValueError, match="full_name"):
        stage_state_dict(sched, {0: nn.Linear(3, 3)})
