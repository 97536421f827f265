"""Single-process reference: the same stage modules, the same micro-batches, no pipeline.

For each micro-batch in order: forward through its path of stages, loss,
backward (seeded with 1/N, as ``Pipeline(scale_grads=True)``, unless
``scale_grads=False``).  Gradients accumulate in the given modules.  This is what the
multi-process runtime must reproduce bit for bit (losses, outputs, and the
gradients of every stage whose micro-batches are summed in the same order).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from dualpipe_kernels.runtime.microbatch import split_microbatches
from dualpipe_kernels.schedules.ir import Schedule

__all__ = ["run_reference"]


def run_reference(
    stage_modules_by_stage: Mapping[int, nn.Module],
    schedule: Schedule,
    inputs: Sequence[Any],
    labels: Sequence[Any],
    criterion: Callable[..., torch.Tensor] | None,
    batch_dim: int = 0,
    forward_only: bool = False,
    outputs: dict[int, tuple[torch.Tensor, ...]] | None = None,
    scale_grads: bool = True,
) -> dict[int, torch.Tensor]:
    """Run every micro-batch of ``schedule`` through its path of stages in one process.

    ``stage_modules_by_stage[s]``: the module of stage ``s`` (for DualPipe the
    two copies of a model stage may be the same object or two modules).
    Returns ``{micro-batch: detached loss}`` (empty without a criterion).  When
    ``outputs`` is a dict, the last stage's detached outputs are stored in it.
    ``scale_grads``: as ``Pipeline``'s, seed each loss's backward with ``1/N``
    (N micro-batches); ``False`` sums the micro-batch gradients.
    """
    missing = [s for s in range(schedule.num_stages) if s not in stage_modules_by_stage]
    if missing:
        raise ValueError(f"run_reference needs a module for every stage; missing {missing}")
    n = schedule.num_microbatches
    mb_inputs = split_microbatches(tuple(inputs), n, batch_dim)
    mb_labels = split_microbatches(tuple(labels), n, batch_dim) if labels else [()] * n
    losses: dict[int, torch.Tensor] = {}
    for m in range(n):
        with torch.set_grad_enabled(not forward_only and torch.is_grad_enabled()):
            x: tuple[Any, ...] = tuple(mb_inputs[m])
            for s in schedule.path(m):
                y = stage_modules_by_stage[s](*x)
                x = (y,) if isinstance(y, torch.Tensor) else tuple(y)
            if outputs is not None:
                outputs[m] = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in x)
            if criterion is None:
                continue
            loss = criterion(*x, *mb_labels[m])
            if loss.requires_grad:
                loss.backward(torch.full_like(loss, 1.0 / n) if scale_grads else None)
            losses[m] = loss.detach()
    return losses
