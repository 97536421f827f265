"""Rank functions of tests/process/test_launch_failures.py (module level: spawned ranks import them by name)."""

from __future__ import annotations

import os
import time


def one_raises(rank: int, world: int, sleep_s: float) -> int:
    """Rank 1 raises at once; every other rank works for ``sleep_s`` seconds (a peer stuck in a long wait)."""
    if rank == 1:
        raise RuntimeError("rank 1 failed on purpose")
    time.sleep(sleep_s)
    return rank


def one_dies(rank: int, world: int, sleep_s: float) -> int:
    """Rank 1 dies without a word (as a kill -9 would); the others work for ``sleep_s`` seconds."""
    if rank == 1:
        os._exit(3)
    time.sleep(sleep_s)
    return rank


def all_fine(rank: int, world: int, sleep_s: float) -> int:
    time.sleep(sleep_s)
    return rank * 10


def env_of(rank: int, world: int, names: tuple[str, ...]) -> list[str | None]:
    """The values of the environment variables ``names`` in this rank."""
    return [os.environ.get(n) for n in names]
