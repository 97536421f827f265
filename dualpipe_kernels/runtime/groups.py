"""Process groups of a ``pp x ep`` layout: pipeline replicas crossed with expert-parallel groups."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["pipeline_expert_groups"]


def pipeline_expert_groups(pp: int, ep: int) -> tuple[Any, Any, Any]:
    """(pipeline group, forward expert group, backward expert group) of this process.

    Process ``g`` is pipeline rank ``g // ep`` and expert rank ``g % ep``: a
    pipeline group holds the processes of one expert rank, an expert group
    those of one pipeline rank.  Forward and backward all_to_alls get separate
    expert groups so an overlap hook's two threads never share one.  Every
    process must call this (``new_group`` is collective) and creates all the
    groups in the same order.
    """
    me = dist.get_rank()
    mine: dict[str, Any] = {}
    for e in range(ep):
        g = dist.new_group([p * ep + e for p in range(pp)])
        if me % ep == e:
            mine["pp"] = g
    for kind in ("f", "b"):
        for p in range(pp):
            g = dist.new_group([p * ep + e for e in range(ep)])
            if me // ep == p:
                mine[kind] = g
    return mine["pp"], mine["f"], mine["b"]
