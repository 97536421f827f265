"""Rank functions of tests/process/test_transformers_ranks.py: a tiny transformers LM (hf_models.py)
split by ``integrations.transformers`` and trained 3 SGD steps on a pipeline; the one-process reference the
test compares with (the model's own forward and loss, the same micro-batches) is :func:`reference_run`."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
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


#: a case: (family, tied, schedule, decoder layers, micro-batches, declared tie)
Case = tuple[str, bool, str, int, int, bool]


def train(rank: int, world: int, family: str, tied: bool, schedule: str, layers: int, n: int, declared: bool) -> Any:
    """:func:`train_on` over every rank of the default group."""
    return train_on(None, world, (family, tied, schedule, layers, n, declared))


def train_on_pairs(rank: int, world: int, pairs: tuple[dict[str, Case], ...]) -> dict[str, Any]:
    """Ranks ``2k, 2k + 1`` train ``pairs[k]``'s cases on a 2-rank pipeline of their own, every pair at once
    (one spawned group runs the 2-rank and the 4-rank cases): ``{case name: this rank's result}``."""
    torch.set_num_threads(1)
    groups = [dist.new_group([2 * k, 2 * k + 1]) for k in range(world // 2)]  # every rank creates each
    mine = pairs[rank // 2] if rank // 2 < len(pairs) else {}
    return {name: train_on(groups[rank // 2], 2, case) for name, case in mine.items()}


def train_on(group: Any, ranks: int, case: Case) -> Any:
    """This rank's per-step micro-batch losses and its parameters (the model's names) after ``STEPS`` steps of
    ``case`` on a ``ranks``-rank pipeline over ``group``.  A declared tie: stage modules from
    ``build_stage_modules`` and ``tied_parameters=tied_parameter_names(...)`` instead of
    ``Pipeline.from_sequential`` finding it."""
    family, tied, schedule, layers, n, declared = case
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # the ranks share 2 cores: more threads only contend
    model = make_model(family, tied, layers)
    seq = split_causal_lm(model)
    sched = build_schedule(schedule, ranks, n)
    if declared:
        mods = build_stage_modules(sched, seq, group=group)
        pipe = Pipeline(sched, mods, group, tied_parameters=tied_parameter_names(seq), timeout_s=60)
    else:
        pipe = Pipeline.from_sequential(sched, seq, group=group, wire=WireOptions(timeout_s=60))
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
