"""What ``Pipeline.from_sequential`` and ``Pipeline.from_mesh`` do before they call the constructor: cut a
full model into this rank's stage modules (with the ties found in it) and read a 2-D mesh's groups.

The builders themselves are classmethods of :class:`~dualpipe_kernels.runtime.executor.Pipeline`, beside
its constructor, and take the same option groups (tests/unit/test_builder_signatures.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
import torch.nn as nn

from dualpipe_kernels.runtime.model_options import ModelOptions
from dualpipe_kernels.runtime.options import GradientOptions, LayoutOptions
from dualpipe_kernels.runtime.stages import build_stage_modules
from dualpipe_kernels.runtime.tied import find_ties
from dualpipe_kernels.schedules.ir import Schedule

__all__ = ["mesh_groups", "sequential_stages"]


def sequential_stages(
    schedule: Schedule,
    model: nn.Sequential,
    partition: Sequence[int] | None,
    group: dist.ProcessGroup | None,
    layout: LayoutOptions | None,
    model_options: ModelOptions | None,
) -> tuple[dict[int, nn.Module], ModelOptions]:
    """This rank's stage modules of ``model`` (:func:`build_stage_modules`) and ``model_options`` with the
    parameters ``model`` shares by identity (an embedding tied to the head) as tie groups, found ones first
    (a declared group they already cover is dropped)."""
    mapping = layout.rank_mapping if layout is not None else None
    mods: dict[int, nn.Module] = dict(
        build_stage_modules(schedule, model, partition=partition, group=group, rank_mapping=mapping)
    )
    opts = model_options if model_options is not None else ModelOptions()
    if not isinstance(opts, ModelOptions):
        raise ValueError(f"model_options must be a ModelOptions or None, got {type(opts).__name__}")
    found = find_ties(model)
    taken = {n for g in found for n in g}
    declared = tuple(g for g in opts.tied_parameters if not set(g) <= taken)
    return mods, dataclasses.replace(opts, tied_parameters=found + declared)


def mesh_groups(mesh: Any, gradients: GradientOptions | None) -> tuple[dist.ProcessGroup, GradientOptions]:
    """The pipeline group (the mesh's ``"pp"`` dimension) and ``gradients`` with the mesh's ``"dp"`` group
    as its ``dp_group`` (which the caller must leave unset)."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if "pp" not in names or "dp" not in names:
        raise ValueError(f"from_mesh needs a DeviceMesh with dimensions 'pp' and 'dp', got names {names}")
    gradients = gradients if gradients is not None else GradientOptions()
    if not isinstance(gradients, GradientOptions):
        raise ValueError(f"gradients must be a GradientOptions or None, got {type(gradients).__name__}")
    if gradients.dp_group is not None:
        raise ValueError("from_mesh takes the groups from the mesh; leave GradientOptions.dp_group unset")
    return mesh.get_group("pp"), dataclasses.replace(gradients, dp_group=mesh.get_group("dp"))
