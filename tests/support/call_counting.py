"""Rank side of tests/process/test_runtime_calls.py: Python calls of one DualPipeV step, by where they go."""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

WARMUP = 3  # steps before the counted one: the repeat path of every message is in place by then


def layer_of(filename: str) -> str:
    """``runtime``: the runtime's own Python (the package less its transport layer); ``transport``:
    transport/ and the peer watch that wraps it (runtime/peer_watch.py); ``other``: torch, the caller."""
    path = filename.replace("\\", "/")
    if "dualpipe_kernels/" not in path:
        return "other"
    if "dualpipe_kernels/transport/" in path or path.endswith("runtime/peer_watch.py"):
        return "transport"
    return "runtime"


def count_step(rank: int, world: int, transport: str, microbatches: int) -> dict[str, Any]:
    """Python function calls (profile ``call`` events, C functions not counted) of this rank's step after
    :data:`WARMUP` steps, by :func:`layer_of`, with the rank's compute actions."""
    import torch.distributed as dist

    from dualpipe_kernels.runtime import Pipeline
    from dualpipe_kernels.schedules.generators import build_schedule

    torch.set_num_threads(1)
    sched = build_schedule("dualpipev", world, microbatches)
    pipe = Pipeline(sched, {s: nn.Linear(8, 8) for s in sched.stages_of_rank(rank)}, transport=transport)
    x, target = torch.randn(microbatches, 8), torch.zeros(microbatches, 8)
    counts = {"runtime": 0, "transport": 0, "other": 0}
    layers: dict[str, str] = {}

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event == "call":
            name = frame.f_code.co_filename
            layer = layers.get(name)
            if layer is None:
                layer = layers[name] = layer_of(name)
            counts[layer] += 1

    try:
        for _ in range(WARMUP):
            pipe.step(x, labels=(target,), criterion=F.mse_loss)
        dist.barrier()
        sys.setprofile(profile)
        try:
            loss = pipe.step(x, labels=(target,), criterion=F.mse_loss).losses
        finally:
            sys.setprofile(None)
        dist.barrier()
    finally:
        pipe.close()
    return {"counts": counts, "compute_actions": len(sched.actions[rank]), "losses": len(loss)}
