"""Cutting a model into this rank's stage modules, for any schedule.

How many stage modules a rank holds, and which layers each runs, depends on
the schedule: one for 1F1B / ZB1P, two in a V for DualPipeV (stages ``r`` and
``2R-1-r``), two for DualPipe (model stage ``r`` and a mirror copy of model
stage ``R-1-r``), ``k`` for an interleaved schedule.  The schedule already says
it (``stages_of_rank``, ``model_stage``); :func:`build_stage_modules` reads it
from there so user code never spells out a placement.

The layers ``L`` of the model are cut into ``M`` model stages (``partition``:
layers per model stage, default as even as possible, earlier stages one more).
Each stage module is a :class:`StageLayers`, an ``nn.Sequential`` that knows
the index of its first layer, so parameter names map back to the full
``nn.Sequential``'s (``"3.weight"`` of a stage starting at layer 4 is
``"7.weight"``): see :mod:`dualpipe_kernels.runtime.checkpoint`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist
import torch.nn as nn

from dualpipe_kernels.runtime.stage_io import run_layers
from dualpipe_kernels.schedules.ir import Schedule

__all__ = ["StageLayers", "build_stage_modules", "layer_partition", "pipeline_rank"]

LayerFactory = Callable[[int], nn.Module]


class StageLayers(nn.Sequential):
    """One stage module: layers ``first_layer .. first_layer + len(self) - 1`` of the full model, in order.

    Each layer's output is the next layer's arguments (runtime/stage_io.py): a tensor is one
    positional argument, a tuple its members, a dict keyword arguments; so a block taking
    ``(hidden, attention_mask)`` returns that pair and the next block receives both.
    ``StageLayers(list(model), 0)(*inputs)`` runs a whole model this way in one process.
    """

    def __init__(self, layers: Sequence[nn.Module], first_layer: int) -> None:
        super().__init__(*layers)
        self.first_layer = first_layer

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the layers in order, each taking the previous one's output as its arguments."""
        return run_layers(self, args, kwargs)

    def full_name(self, local_name: str) -> str:
        """The full model's name of this module's parameter/buffer ``local_name`` (``"0.weight"`` -> ``"4.weight"``)."""
        head, _, rest = local_name.partition(".")
        return f"{self.first_layer + int(head)}.{rest}" if rest else str(self.first_layer + int(head))


def layer_partition(schedule: Schedule, num_layers: int, partition: Sequence[int] | None = None) -> list[range]:
    """Layer indices of each model stage of ``schedule`` (``partition[m]`` layers for model stage ``m``)."""
    num_model = max(schedule.model_stage) + 1
    if partition is None:
        if num_layers < num_model:
            raise ValueError(f"model has {num_layers} layers, fewer than the {num_model} model stages")
        base, extra = divmod(num_layers, num_model)
        partition = [base + (1 if m < extra else 0) for m in range(num_model)]
    partition = list(partition)
    if len(partition) != num_model or any(n < 1 for n in partition) or sum(partition) != num_layers:
        raise ValueError(
            f"partition {partition} must give >= 1 layer to each of {num_model} model stages of schedule "
            f"{schedule.name!r} and sum to {num_layers} layers"
        )
    starts = [sum(partition[:m]) for m in range(num_model)]
    return [range(starts[m], starts[m] + partition[m]) for m in range(num_model)]


def pipeline_rank(
    schedule: Schedule, group: dist.ProcessGroup | None = None, rank_mapping: Sequence[int] | None = None
) -> int:
    """This process's pipeline rank in ``group`` (default group) under ``rank_mapping`` (as ``Pipeline``)."""
    from dualpipe_kernels.runtime.construction import check_mapping

    if not dist.is_initialized():
        raise ValueError("pass rank= or initialise torch.distributed first")
    g = group if group is not None else dist.group.WORLD
    size = dist.get_world_size(g)
    if size != schedule.num_ranks:
        raise ValueError(f"schedule {schedule.name!r} has {schedule.num_ranks} ranks but the process group has {size}")
    return check_mapping(rank_mapping, size)[dist.get_rank(g)]


def build_stage_modules(
    schedule: Schedule,
    layers: nn.Sequential | Sequence[nn.Module] | LayerFactory,
    num_layers: int | None = None,
    partition: Sequence[int] | None = None,
    rank: int | None = None,
    group: dist.ProcessGroup | None = None,
    rank_mapping: Sequence[int] | None = None,
) -> dict[int, StageLayers]:
    """``{stage: StageLayers}`` for pipeline rank ``rank``'s stages of ``schedule``, ready for ``Pipeline``.

    ``layers``: the full model's layers (an ``nn.Sequential`` or a list; the
    stage modules share them), or a factory ``layers(i) -> nn.Module`` called
    only for the layers this rank runs (``num_layers`` then required).  A
    factory must give layer ``i`` the same initial weights on every rank (seed
    it by ``i``): DualPipe's mirror copies live on two ranks.  A model stage
    this rank holds twice gets a deep copy for its second stage module.
    ``partition``: layers per model stage (the form of ``plan --json``'s
    ``best.partition``); default as even as possible, earlier stages one more.
    ``rank``: default this process's pipeline rank in ``group`` / ``rank_mapping``.
    """
    if not isinstance(layers, nn.Module) and callable(layers):
        if num_layers is None:
            raise ValueError("build_stage_modules: a layer factory needs num_layers")
        factory: LayerFactory = layers
    else:
        given = list(layers.children()) if isinstance(layers, nn.Module) else list(layers)
        if num_layers is not None and num_layers != len(given):
            raise ValueError(f"num_layers={num_layers} but {len(given)} layers given")
        num_layers = len(given)
        factory = given.__getitem__
    ranges = layer_partition(schedule, num_layers, partition)
    if rank is None:
        rank = pipeline_rank(schedule, group, rank_mapping)
    if not 0 <= rank < schedule.num_ranks:
        raise ValueError(f"rank {rank} out of range for schedule {schedule.name!r} with {schedule.num_ranks} ranks")
    modules: dict[int, StageLayers] = {}
    built: dict[int, StageLayers] = {}
    for s in schedule.stages_of_rank(rank):
        m = schedule.model_stage[s]
        if m in built:
            modules[s] = copy.deepcopy(built[m])
            continue
        built[m] = modules[s] = StageLayers([factory(i) for i in ranges[m]], ranges[m].start)
    return modules
