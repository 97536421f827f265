"""What one pipeline step returns: :class:`StepResult`."""

from __future__ import annotations

from collections.abc import Callable
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
    the same value on every rank of the pipeline group.  Without ``reduce_loss`` the mean is worked
    out the first time ``loss`` is read (a step whose caller never reads it spends no tensor ops on
    it).  ``outputs``: micro-batch -> detached outputs of the loss stage when ``return_outputs`` (else
    None).  ``timeline``:
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
    loss_of: Callable[[], torch.Tensor | None] | None = field(default=None, repr=False, compare=False)
    """Works out :attr:`loss` on its first read (None: :attr:`loss` is None)."""
    _loss: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def loss(self) -> torch.Tensor | None:
        """The mean loss (see the class docstring), worked out once, on the first read."""
        if self.loss_of is not None:
            self._loss, self.loss_of = self.loss_of(), None
        return self._loss
