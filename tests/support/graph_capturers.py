"""Capture backends for the graph tests on a machine without a GPU (runtime/graph_capture.Capturer).

``RerunCapture``: a "graph" that runs its captured function again at each replay, on the slot's static
buffers, so the runtime's whole graph path (static inputs, slots, the replay's autograd node, the
weight gradients deferred to the W) computes real results on CPU tensors.  Under capture it refuses
what a CUDA stream capture refuses (a host read of a tensor: ``.item()``, ``.tolist()``), raising the
error torch raises then, so a stage that reads the host fails its capture the way it would on a GPU.

``ClaimsCuda``: a capturer that says CUDA capture is available, for the check of stages whose tensors
are on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: the ops a stream capture cannot run: they copy a device value to the host and wait for it
HOST_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default}


class _NoHostReads(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in HOST_READS:
            raise RuntimeError(f"CUDA error: operation not permitted when stream is capturing ({func})")
        return func(*args, **(kwargs or {}))


class _Rerun:
    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        with torch.enable_grad():  # captured with autograd on (the replay node's forward runs without)
            self.fn()


class RerunCapture:
    device_type = "cpu"

    def __init__(self) -> None:
        self.captures = 0
        self.warmups = 0
        self.pools: list[object] = []

    def unavailable(self) -> str | None:
        return None

    def new_pool(self) -> Any:
        self.pools.append(object())
        return self.pools[-1]

    def warm_up(self, fn: Callable[[], None], iters: int) -> None:
        for _ in range(iters):
            fn()
            self.warmups += 1

    def capture(self, fn: Callable[[], None], pool: Any) -> _Rerun:
        with torch.enable_grad(), _NoHostReads():
            fn()
        self.captures += 1
        return _Rerun(fn)


class ClaimsCuda(RerunCapture):
    device_type = "cuda"
