"""A rank process's footprint between steps, for the tests that check memory stays flat over many steps."""

from __future__ import annotations

import gc
import os

import torch


def live_tensors_and_rss() -> tuple[int, int]:
    """(tensors alive after a full collection, resident set size in bytes) of this process."""
    gc.collect()
    tensors = sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))
    with open(f"/proc/{os.getpid()}/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return tensors, rss
