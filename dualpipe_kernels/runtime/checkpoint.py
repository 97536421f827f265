"""Checkpoints of a pipeline under the full model's parameter names.

A rank's stage modules hold pieces of one model.  :func:`stage_state_dict`
names every parameter and buffer as the full model does (``"7.weight"``, not
stage 3's ``"1.weight"``), taking a model stage once per rank however many
copies of it the rank holds (DualPipe's mirror copies are equal after
``sync_mirror_grads`` and identical optimizer steps).  With those names
``torch.distributed.checkpoint`` (DCP) moves a checkpoint between layouts:
save from a 2-rank pipeline, load into one process's full model, and back.
Across ranks DCP writes a key held by two ranks (a mirrored stage) once.

Names: a :class:`~dualpipe_kernels.runtime.stages.StageLayers` (what
``build_stage_modules`` and ``Pipeline.from_sequential`` build) knows its
first layer; any other stage module needs ``full_name(stage, local_name)``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn as nn

from dualpipe_kernels.runtime.stages import StageLayers
from dualpipe_kernels.schedules.ir import Schedule

__all__ = ["stage_state_dict", "load_stage_state_dict", "save_pipeline", "load_pipeline"]

NameMap = Callable[[int, str], str]


def _namer(modules: Mapping[int, nn.Module], full_name: NameMap | None) -> NameMap:
    if full_name is not None:
        return full_name
    bad = [s for s, m in modules.items() if not isinstance(m, StageLayers)]
    if bad:
        raise ValueError(
            f"stage modules {bad} are not StageLayers (build_stage_modules / Pipeline.from_sequential): "
            "pass full_name(stage, local_name) -> the full model's name"
        )
    return lambda s, local: modules[s].full_name(local)  # type: ignore[operator]


def _copies(schedule: Schedule, modules: Mapping[int, nn.Module]) -> dict[int, list[int]]:
    """Model stage -> this rank's stages holding a copy of it (lowest stage first: the one saved)."""
    out: dict[int, list[int]] = {}
    for s in sorted(modules):
        out.setdefault(schedule.model_stage[s], []).append(s)
    return out


def stage_state_dict(
    schedule: Schedule, modules: Mapping[int, nn.Module], full_name: NameMap | None = None
) -> dict[str, torch.Tensor]:
    """``{full model name: tensor}`` of this rank's stage modules; tensors share the modules' storage."""
    name = _namer(modules, full_name)
    out: dict[str, torch.Tensor] = {}
    for stages in _copies(schedule, modules).values():
        s = stages[0]
        for local, t in modules[s].state_dict(keep_vars=False).items():
            key = name(s, local)
            if key in out:
                raise ValueError(f"full name {key!r} given to two tensors (stage {s} {local!r})")
            out[key] = t
    return out


def load_stage_state_dict(
    schedule: Schedule,
    modules: Mapping[int, nn.Module],
    state_dict: Mapping[str, torch.Tensor],
    full_name: NameMap | None = None,
) -> None:
    """Copy ``state_dict`` (full model names) into every stage module this rank holds, mirror copies included.

    Keys of other ranks' stages are ignored; a key this rank needs and
    ``state_dict`` lacks is an error naming it.
    """
    name = _namer(modules, full_name)
    for s, m in modules.items():
        mine = m.state_dict()
        missing = [name(s, k) for k in mine if name(s, k) not in state_dict]
        if missing:
            raise KeyError(f"stage {s}: the state dict has no {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        with torch.no_grad():
            for k, t in mine.items():
                t.copy_(state_dict[name(s, k)])


def save_pipeline(pipe: Any, checkpoint_id: str | os.PathLike[str], full_name: NameMap | None = None) -> None:
    """Save ``pipe``'s stage modules with DCP under the full model's names (collective over ``pipe.group``)."""
    import torch.distributed.checkpoint as dcp

    sd = stage_state_dict(pipe.schedule, pipe.stage_modules, full_name)
    dcp.save(sd, checkpoint_id=checkpoint_id, process_group=pipe.group)


def load_pipeline(pipe: Any, checkpoint_id: str | os.PathLike[str], full_name: NameMap | None = None) -> None:
    """Load a DCP checkpoint with the full model's names into ``pipe``'s stage modules (collective)."""
    import torch.distributed.checkpoint as dcp

    sd = stage_state_dict(pipe.schedule, pipe.stage_modules, full_name)
    dcp.load(sd, checkpoint_id=checkpoint_id, process_group=pipe.group)  # in place: the tensors are the modules'
    load_stage_state_dict(pipe.schedule, pipe.stage_modules, sd, full_name)  # second copies of a model stage
