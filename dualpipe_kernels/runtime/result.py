"""What one pipeline step returns: :class:`StepResult`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dualpipe_kernels.runtime.data_parallel import ReductionSpan
from dualpipe_kernels.runtime.timeline import TimelineEntry

__all__ = ["StepResult"]


@dataclass
class StepResult:
    """What one step returns on this rank.

    ``losses``: micro-batch -> detached scalar loss, for the micro-batches whose
    loss stage this rank holds.  ``loss``: the mean of those losses as a 0-d
    float32 tensor (summed in float64), None when this rank has none; with
    ``step(..., reduce_loss=True)`` the mean over all the step's micro-batches,
    the same value on every rank of the pipeline group.  ``outputs``: micro-batch -> detached outputs of
    the loss stage when ``return_outputs`` (else None).  ``timeline``:
    ``(pipeline rank, action, start_s, end_s)`` relative to the step start when
    ``record_timeline``.  ``step_time_s``: wall time of the step on this rank.
    ``dp_reductions``: ``(stage, start_s, end_s)`` of each data-parallel
    reduction (posted after the stage's last gradient action, waited for at the
    end), relative to the step start; empty without a ``dp_group``.
    """

    losses: dict[int, torch.Tensor]
    outputs: dict[int, tuple[torch.Tensor, ...]] | None
    timeline: list[TimelineEntry]
    step_time_s: float
    dp_reductions: list[ReductionSpan] = field(default_factory=list)
    loss: torch.Tensor | None = None
