"""``transport="auto"`` on GPUs: CUDA IPC where every step of it works on every rank, else the torch transport.

CUDA IPC can work only partly (sandboxed GPU machines, containers without a
shared IPC namespace): exporting a buffer (``cudaIpcGetMemHandle``), exporting
an interprocess event (``cudaIpcGetEventHandle``) or opening the peer's
handles (``cudaIpcOpenMemHandle``) may fail on its own.  The ranks of a group
must all end up with the same transport, so each step's outcome is voted on
through the group's store:

1. *probe*: every rank exports a small device buffer and an event the way
   ``torch.multiprocessing`` does; any failure and no rank tries CUDA IPC
   (no rendezvous is started, so nobody waits for a peer that gave up);
2. *build*: every rank builds its ``CudaIpcTransport`` (the rendezvous opens
   the peers' handles) with a bounded rendezvous timeout; any failure and
   every rank closes what it built.

On failure the caller gets ``None`` and a warning naming the rank, the step
and the error, and uses the torch transport (CUDA tensors staged through host
memory) instead.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

from dualpipe_kernels.transport.base import Transport, wait_store_key

__all__ = ["failed_step", "agree", "negotiate", "probe_cuda_ipc"]

#: the longest the CUDA IPC rendezvous of "auto" may take before it counts as failed (seconds)
AUTO_RENDEZVOUS_S = 60.0
#: the time close() of a transport built on a rank whose peers failed may wait for them (seconds)
_ABANDON_CLOSE_S = 1.0
_VOTE_MARGIN_S = 30.0

_STEPS = (
    ("cudaIpcGetMemHandle", "get memory handle (cudaIpcGetMemHandle)"),
    ("cudaIpcGetEventHandle", "get event handle (cudaIpcGetEventHandle)"),
    ("cudaIpcOpenMemHandle", "peer open (cudaIpcOpenMemHandle)"),
    ("cudaIpcOpenEventHandle", "peer event open (cudaIpcOpenEventHandle)"),
    ("attach", "peer open (attaching to the peer's channel)"),
    ("timed out", "rendezvous (a peer did not answer)"),
)


def failed_step(phase: str, message: str) -> str:
    """The CUDA IPC step an error message is about (by the CUDA call it names), else ``phase``."""
    for needle, step in _STEPS:
        if needle.lower() in message.lower():
            return step
    return phase


def probe_cuda_ipc(device: Any) -> None:
    """Export a 2 MiB device buffer and an interprocess event (as torch.multiprocessing does); raise on failure."""
    import torch

    buf = torch.empty(2 << 20, dtype=torch.uint8, device=device)  # its own allocator block
    buf.untyped_storage()._share_cuda_()  # cudaIpcGetMemHandle + an interprocess event's cudaIpcGetEventHandle


def agree(store: Any, prefix: str, rank: int, world: int, error: str, timeout_s: float) -> dict[int, str]:
    """Publish this rank's outcome (``error``, "" for success), wait for every rank's; return ``{rank: error}``."""
    store.set(f"{prefix}/{rank}", "fail " + error if error else "ok")
    failures: dict[int, str] = {}
    for r in range(world):
        key = f"{prefix}/{r}"
        wait_store_key(store, key, timeout_s, f"rank {rank}: transport 'auto'", f"rank {r}'s CUDA IPC outcome")
        value = store.get(key).decode()
        if value != "ok":
            failures[r] = value.removeprefix("fail ")
    return failures


def negotiate(
    store: Any,
    prefix: str,
    rank: int,
    world: int,
    probe: Callable[[], None],
    build: Callable[[], Transport],
    timeout_s: float,
) -> tuple[Transport | None, str]:
    """``(transport, "")`` when every rank's probe and build succeeded, else ``(None, reason)`` on every rank."""
    phases: tuple[tuple[str, Callable[[], Any]], ...] = (("probe", probe), ("build", build))
    built: Transport | None = None
    for phase, fn in phases:
        error = ""
        try:
            out = fn()
            if phase == "build":
                built = out
        except Exception as exc:  # noqa: BLE001 - any failure of CUDA IPC means: fall back, on every rank
            error = f"{type(exc).__name__}: {exc}"
        # A peer may still be inside its own (bounded) rendezvous when this rank already failed.
        failures = agree(store, f"{prefix}/{phase}", rank, world, error, timeout_s + _VOTE_MARGIN_S)
        if failures:
            if built is not None:
                built.timeout_s = _ABANDON_CLOSE_S
                built.close()
            r, msg = min(failures.items())
            return None, f"{failed_step(phase, msg)} failed on rank {r}: {msg}"
    return built, ""


def cuda_ipc_or_none(group: Any, device: Any, timeout_s: float, peers: list[int] | None = None) -> Transport | None:
    """A CudaIpcTransport for ``group`` on ``device`` if CUDA IPC fully works on every rank; else warn, None.

    ``peers``: the group ranks to open channels with (default: all others; per_peer.py passes the same-host ones).
    """
    import torch.distributed as dist

    from dualpipe_kernels.transport.cuda_ipc import CudaIpcTransport

    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    name = getattr(group, "group_name", "default") if group is not None else "default"
    generation = store.add(f"dpk/auto/{name}/generation/{rank}", 1)  # collective: the counts agree
    prefix = f"dpk/auto/{name}/{generation}"

    def build() -> Transport:
        bounded = min(timeout_s, AUTO_RENDEZVOUS_S)
        if peers is None:  # every other rank of the group
            t = CudaIpcTransport(group, device=device, timeout_s=bounded)
        else:
            t = CudaIpcTransport(group, device=device, timeout_s=bounded, peers=peers)
        t.timeout_s = timeout_s  # the rendezvous is bounded; every later wait gets the caller's timeout
        return t

    transport, reason = negotiate(store, prefix, rank, world, lambda: probe_cuda_ipc(device), build, timeout_s)
    if transport is None:
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
        # expandable segments are VMM memory, which the legacy IPC handles cannot export
        note = f"; PYTORCH_CUDA_ALLOC_CONF={conf}" if conf else ""
        warnings.warn(
            f"rank {rank}: CUDA IPC is not usable here ({reason}{note}); transport 'auto' uses the torch "
            "transport instead (CUDA tensors staged through host memory)",
            RuntimeWarning,
            stacklevel=3,
        )
    return transport
