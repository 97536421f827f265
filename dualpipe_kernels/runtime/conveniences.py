"""Pipeline conveniences: a step's chrome trace, the checkpoint state dict and gradient accumulation.

A mixin of :class:`~dualpipe_kernels.runtime.executor.Pipeline`: it reads the few attributes it names below
and owns no state.  The builders (``from_sequential``, ``from_mesh``) and the introspection (what the
pipeline chose) live on ``Pipeline`` itself, the step's loss in :mod:`.loss`, the gradient reductions in
:mod:`.reductions`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from dualpipe_kernels.runtime.reductions import GradientReductions
from dualpipe_kernels.runtime.result import StepResult
from dualpipe_kernels.schedules.ir import Schedule

__all__ = ["PipelineConveniences"]


class PipelineConveniences:
    """Methods of :class:`Pipeline` beyond construction, introspection and the step (see the module docstring)."""

    schedule: Schedule
    stage_modules: dict[int, nn.Module]
    group: Any
    group_rank: int
    record_timeline: bool
    _reductions: GradientReductions

    def write_trace(self, path: str | os.PathLike[str], result: StepResult) -> str | None:
        """Write the measured step ``result`` of every rank as one chrome-trace JSON (open in ui.perfetto.dev).

        Collective over the pipeline group (every rank calls it with its own
        result of the same step); group rank 0 writes ``path`` and returns it,
        the others return None.  Needs ``Pipeline(record_timeline=True)``.
        Each rank's times are relative to its own step start.
        """
        from dualpipe_kernels.schedules.trace import write_chrome_trace

        if not self.record_timeline:
            raise ValueError("write_trace needs a step recorded with Pipeline(record_timeline=True)")
        timelines: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(timelines, list(result.timeline), group=self.group)
        if self.group_rank != 0:
            return None
        merged = [e for t in timelines for e in t]
        write_chrome_trace(path, merged, schedule=self.schedule.name, step_time_s=result.step_time_s)
        return os.fspath(path)

    def model_state_dict(self, full_name: Callable[[int, str], str] | None = None) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers under the full model's names (``runtime.checkpoint``)."""
        from dualpipe_kernels.runtime.checkpoint import stage_state_dict

        reductions = getattr(self, "_reductions", None)
        ties = reductions.ties.canonical() if reductions is not None else None
        return stage_state_dict(self.schedule, self.stage_modules, full_name, ties)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation with a ``dp_group``: steps inside neither reduce over DP nor fold the mirror sum.

        Each reduction sums the whole ``.grad``, so accumulating over several
        steps reduces only at the last one (as with DDP's ``no_sync``).  The
        tied parameters' all-reduce (runtime/tied.py) pauses too; without a
        ``dp_group`` or ties this changes nothing.
        """
        with self._reductions.pause():
            yield
