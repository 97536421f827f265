"""Boundaries beyond one float tensor, and two pipelines in one process.

Rich stages (``toy_models.RichStage``): an uneven batch (``tensor_split``
semantics: the last micro-batches are one row smaller), three tensors per
stage boundary, an int64 side input that passes through every stage without
grad, and an output the next stage ignores (its gradient is None, its weights
keep ``grad is None``).  Same bit-exact checks as test_runtime_exact, outputs
also returned by the training step.

Two pipelines (a native DualPipeV and a compat DualPipeV whose model defers
weight gradients through WeightGradStore) over the same group, stepped
alternately with SGD updates in between, give bit-identical losses and
gradients to each run alone.
"""

from __future__ import annotations

import pytest
import torch
from runtime_checks import check_config
from toy_models import configs_for_world

CONFIGS = [c for world in (2, 4) for c in configs_for_world(world) if c.model == "rich"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.key)
def test_rich_boundaries_bit_exact(cfg, spawned_runs):
    errors = check_config(cfg, spawned_runs(cfg))
    assert not errors, f"{cfg.key}:\n" + "\n".join(errors)


def _equal(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.timeout(600)
def test_two_pipelines_in_one_process_do_not_interfere(lifecycle_run):
    for rank, res in enumerate(lifecycle_run):
        res = res["two_pipelines"]
        for i, name in enumerate(("native DualPipeV", "compat DualPipeV + WeightGradStore")):
            alone, together = res["alone"][i], res["together"][i]
            assert len(alone) == len(together) == 3
            for step, (a, t) in enumerate(zip(alone, together, strict=True)):
                assert _equal(a[0], t[0]), f"rank {rank} {name} step {step}: losses differ alone vs interleaved"
                assert _equal(a[1], t[1]), f"rank {rank} {name} step {step}: grads differ alone vs interleaved"
    # the losses are real: rank 0 holds DualPipeV's loss stage
    first = lifecycle_run[0]["two_pipelines"]["alone"]
    assert len(first[0][0][0]) > 0 and first[1][0][0] is not None
