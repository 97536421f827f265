"""Rank functions of tests/process/test_integrations_transformers.py: a tiny transformers LM (hf_models.py)
split by ``integrations.transformers`` and trained 3 SGD steps on a pipeline; the one-process reference the
test compares with (the model's own forward and loss, the same micro-batches) is :func:`reference_run`."""

from __future__ import annotations

from typing import Any

import torch
from hf_models import batch, make_model

from dualpipe_kernels.integrations.transformers import (
    causal_lm_loss,
    split_causal_lm,
    tied_parameter_names,
    transformers_names,
)
from dualpipe_kernels.runtime import Pipeline, WireOptions, build_stage_modules
from dualpipe_kernels.schedules import build_schedule

LR, STEPS = 0.1, 3


def sgd(params: Any) -> None:
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p -= LR * p.grad
                p.grad = None


def train(rank: int, world: int, family: str, tied: bool, schedule: str, layers: int, n: int, declared: bool) -> Any:
    """This rank's per-step micro-batch losses and its parameters (the model's names) after ``STEPS`` steps.
    ``declared``: stage modules from ``build_stage_modules`` and the tie given as ``tied_parameters=``
    (``tied_parameter_names``) instead of ``Pipeline.from_sequential`` finding it."""
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # 2 or 4 ranks share 2 cores: more threads only contend
    model = make_model(family, tied, layers)
    seq = split_causal_lm(model)
    sched = build_schedule(schedule, world, n)
    if declared:
        mods = build_stage_modules(sched, seq)
        pipe = Pipeline(sched, mods, tied_parameters=tied_parameter_names(seq), timeout_s=60)
    else:
        pipe = Pipeline.from_sequential(sched, seq, wire=WireOptions(timeout_s=60))
    names = transformers_names(model, seq)
    params = {name for name, _ in model.named_parameters()}
    try:
        losses = []
        for step in range(STEPS):
            ids, mask, labels = batch(step, 2 * n)
            res = pipe.step(ids, mask, labels=(labels,), criterion=causal_lm_loss)
            losses.append({m: v.clone() for m, v in res.losses.items()})
            sgd(pipe.parameters())
        state = {names[k]: v.clone() for k, v in pipe.model_state_dict().items() if names[k] in params}
        return {"losses": losses, "params": state}
    finally:
        pipe.close()


def reference_run(family: str, tied: bool, layers: int, n: int) -> dict[str, Any]:
    """One process, the model itself: per step each micro-batch's ``model(..., labels=).loss / n`` backward, SGD
    (on one thread, as each rank runs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference(family, tied, layers, n)
    finally:
        torch.set_num_threads(threads)


def _reference(family: str, tied: bool, layers: int, n: int) -> dict[str, Any]:
    model = make_model(family, tied, layers)
    losses = []
    for step in range(STEPS):
        ids, mask, labels = batch(step, 2 * n)
        step_losses = {}
        for m, (i, a, lab) in enumerate(zip(ids.chunk(n), mask.chunk(n), labels.chunk(n), strict=True)):
            loss = model(i, attention_mask=a, labels=lab).loss
            (loss / n).backward()
            step_losses[m] = loss.detach()
        losses.append(step_losses)
        sgd(model.parameters())
    return {"losses": losses, "params": {k: p.detach().clone() for k, p in model.named_parameters()}}
