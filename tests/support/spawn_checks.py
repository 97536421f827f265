"""Several checks run by one spawned group, one after another: the group's start (a torch import per rank, seconds)
is paid once instead of once per check.

:func:`run_checks` is the rank function (``spawn(run_checks, world, checks)``): ``checks`` is a tuple of
``(name, worker, extra args)``, each ``worker(rank, world, *args)`` a module-level function (picklable by name);
the ranks meet on a barrier of the default group before each check after the first, so a check starts when
every rank is done with the one before.  A check that raises is recorded with its traceback and the next one
runs.  :func:`results` gives a test one check's per-rank results, failing with the rank's traceback.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

Check = tuple[str, Callable[..., Any], tuple[Any, ...]]


def run_checks(rank: int, world: int, checks: tuple[Check, ...]) -> dict[str, tuple[str, Any]]:
    """Each of ``checks`` on this rank, in order: ``{name: ("ok", result) or ("error", traceback)}``."""
    import torch.distributed as dist

    out: dict[str, tuple[str, Any]] = {}
    for k, (name, worker, args) in enumerate(checks):
        if k and world > 1:
            dist.barrier()  # every rank done with the check before (its transfers all finished) first
        try:
            out[name] = ("ok", worker(rank, world, *args))
        except Exception:
            out[name] = ("error", traceback.format_exc())
    return out


def results(per_rank: list[dict[str, tuple[str, Any]]], name: str) -> list[Any]:
    """Check ``name``'s result on every rank; a rank's error fails the calling test with its traceback."""
    for rank, got in enumerate(per_rank):
        status, value = got[name]
        assert status == "ok", f"rank {rank}, {name}: {value}"
    return [got[name][1] for got in per_rank]
