"""The further process groups of a :class:`~dualpipe_kernels.transport.torch_dist.TorchDistTransport` over its
group's ranks: the second gloo group of a pair's downward direction, the gloo side channel's group, and the NCCL
communicators of in-order channels.  Each rendezvouses under the group's own store."""

from __future__ import annotations

import atexit
import weakref
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from dualpipe_kernels.transport.base import group_store

__all__ = ["DOWN_PREFIX", "NCCL_PREFIX", "SIDE_PREFIX", "direction_group", "nccl_backend"]

#: id(group) -> (the group, its second gloo backend): one per group and process, shared by its transports.
_DOWN_GROUPS: dict[tuple[int, str], tuple[weakref.ReferenceType[dist.ProcessGroup], Any]] = {}
DOWN_PREFIX = "dualpipe_kernels_p2p_down/"
SIDE_PREFIX = "dualpipe_kernels_p2p_side/"
NCCL_PREFIX = "dualpipe_kernels_p2p_nccl/"


def direction_group(group: dist.ProcessGroup, timeout_s: float, prefix: str = DOWN_PREFIX) -> Any:
    """The second gloo group of ``group``'s ranks, numbered as in ``group``: a gloo backend of its own
    (its own pairs and TCP loop thread) that rendezvouses under ``group``'s store, so only the members take
    part and no group name or count of torch's changes.  Made once per group in this process and shared
    by every transport on ``group`` (as ``group`` itself is); dropped at exit."""
    hit = _DOWN_GROUPS.get((id(group), prefix))
    if hit is not None and hit[0]() is group:
        return hit[1]
    name = getattr(group, "group_name", "") or "world"
    store = dist.PrefixStore(f"{prefix}{name}/", group_store(group))
    down = dist.ProcessGroupGloo(
        store, dist.get_rank(group), dist.get_world_size(group), timedelta(seconds=max(timeout_s, 30.0))
    )
    if not _DOWN_GROUPS:
        atexit.register(_DOWN_GROUPS.clear)  # gloo's threads stop while the interpreter still runs
    _DOWN_GROUPS[(id(group), prefix)] = (weakref.ref(group), down)
    return down


def nccl_backend(group: dist.ProcessGroup, name: str, timeout_s: float) -> Any:
    """A further NCCL communicator over ``group``'s ranks (numbered as in ``group``), rendezvousing under
    ``group``'s store."""
    gname = getattr(group, "group_name", "") or "world"
    store = dist.PrefixStore(f"{NCCL_PREFIX}{gname}/{name}/", group_store(group))
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timedelta(seconds=max(timeout_s, 30.0))
    return dist.ProcessGroupNCCL(store, dist.get_rank(group), dist.get_world_size(group), options)
