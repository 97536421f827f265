"""Pipeline construction: checking what the caller gives (cutting a model into stages: ``stages.py``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

__all__ = ["check_mapping", "check_modules", "module_device", "presplit"]


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
