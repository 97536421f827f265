"""Pipeline construction: checking what the caller gives and cutting a model into stage modules."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from dualpipe_kernels.schedules.ir import Schedule

__all__ = ["check_mapping", "check_modules", "module_device", "sequential_stages", "presplit"]


def check_mapping(rank_mapping: Sequence[int] | None, size: int) -> list[int]:
    """``rank_mapping[group_rank]`` = pipeline rank; identity when None; a permutation otherwise."""
    if rank_mapping is None:
        return list(range(size))
    mapping = list(rank_mapping)
    if sorted(mapping) != list(range(size)):
        raise ValueError(f"rank_mapping must be a permutation of 0..{size - 1}, got {mapping}")
    return mapping


def check_modules(
    modules: Mapping[int, nn.Module] | Sequence[nn.Module], stages: tuple[int, ...], rank: int, name: str
) -> dict[int, nn.Module]:
    """``{stage: module}`` for this rank's ``stages`` from a mapping, a sequence or one module."""
    # One module: the stage module of a one-stage rank.  An nn.Sequential is the
    # stage module itself on a one-stage rank and a sequence of stage modules
    # otherwise (the reference passes nn.Sequential(module0, module1)).
    if isinstance(modules, nn.Module) and not isinstance(modules, nn.ModuleList):
        if not isinstance(modules, nn.Sequential) or len(stages) == 1:
            modules = [modules]
    if isinstance(modules, Mapping):
        got = dict(modules)
        if sorted(got) != sorted(stages):
            raise ValueError(
                f"pipeline rank {rank} holds stages {list(stages)} of schedule {name!r}; modules given for "
                f"stages {sorted(got)}"
            )
    else:
        seq = list(modules)
        if len(seq) != len(stages):
            raise ValueError(
                f"pipeline rank {rank} holds {len(stages)} stage(s) {list(stages)} of schedule {name!r}; "
                f"got {len(seq)} module(s)"
            )
        got = dict(zip(stages, seq, strict=False))
    for s, m in got.items():
        if not isinstance(m, nn.Module):
            raise ValueError(f"stage {s}: expected an nn.Module, got {type(m).__name__}")
    return got


def module_device(modules: Mapping[int, nn.Module]) -> torch.device:
    """The device of the first parameter found (CPU when the modules have none)."""
    for m in modules.values():
        for p in m.parameters():
            return p.device
    return torch.device("cpu")


def sequential_stages(
    schedule: Schedule, model: nn.Sequential, partition: Sequence[int] | None, kw: Mapping[str, Any]
) -> dict[int, nn.Module]:
    """This rank's stage modules cut from ``model`` (see ``Pipeline.from_sequential``)."""
    num_model = max(schedule.model_stage) + 1
    layers = list(model)
    if partition is None:
        if len(layers) < num_model:
            raise ValueError(f"model has {len(layers)} layers, fewer than the {num_model} model stages")
        base, extra = divmod(len(layers), num_model)
        partition = [base + (1 if m < extra else 0) for m in range(num_model)]
    partition = list(partition)
    if len(partition) != num_model or any(n < 1 for n in partition) or sum(partition) != len(layers):
        raise ValueError(
            f"partition {partition} must give >= 1 layer to each of {num_model} model stages and sum to "
            f"{len(layers)} layers"
        )
    starts = [sum(partition[:m]) for m in range(num_model)]
    group = kw.get("group")
    g = group if group is not None else dist.group.WORLD
    mapping = check_mapping(kw.get("rank_mapping"), dist.get_world_size(g))
    rank = mapping[dist.get_rank(g)]
    modules: dict[int, nn.Module] = {}
    seen: set[int] = set()
    for s in schedule.stages_of_rank(rank):
        m = schedule.model_stage[s]
        piece = nn.Sequential(*layers[starts[m] : starts[m] + partition[m]])
        modules[s] = copy.deepcopy(piece) if m in seen else piece
        seen.add(m)
    return modules


def presplit(
    given: Sequence[Sequence[Any]] | None, n: int, name: str, full: tuple[Any, ...]
) -> list[tuple[Any, ...]] | None:
    """Check pre-split micro-batches (``given``): ``n`` tuples, and not together with the full batch."""
    if given is None:
        return None
    if full:
        raise ValueError(f"pass either the full batch or {name}=, not both")
    out = [tuple(mb) if isinstance(mb, (tuple, list)) else (mb,) for mb in given]
    if len(out) != n:
        raise ValueError(f"{name} must hold one entry per micro-batch: {n} expected, got {len(out)}")
    return out
