"""Transports: how tensors move between pipeline ranks (see base.py for the interface)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dualpipe_kernels.transport.base import (
    DEFAULT_TIMEOUT_S,
    Handle,
    Transport,
    TransportError,
    TransportTimeout,
)

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

__all__ = [
    "CUDA_IPC_ENV",
    "DEFAULT_TIMEOUT_S",
    "Handle",
    "Transport",
    "TransportError",
    "TransportTimeout",
    "TRANSPORT_NAMES",
    "auto_kind",
    "cuda_ipc_auto",
    "make_transport",
    "native_available",
]

TRANSPORT_NAMES = ("auto", "torch", "native")

#: environment variable that lets ``"auto"`` pick the CUDA IPC engine on GPUs (see :func:`cuda_ipc_auto`)
CUDA_IPC_ENV = "DUALPIPE_KERNELS_CUDA_IPC"


def cuda_ipc_auto() -> bool:
    """Whether ``transport="auto"`` may use the CUDA IPC engine on GPUs: only with ``DUALPIPE_KERNELS_CUDA_IPC=1``.

    The engine has not yet passed its whole suite on a GPU: on the H200 (2026-11-30) its data paths and the
    demo ran bit-exact after three fixes, but an error path (a mismatched message) still crashed the process
    in run 6, before the fix now in csrc/common/msg.h could run there (docs/history.md, "GPU runs").  A crash
    cannot fall back, so until a GPU run passes, ``"auto"`` on CUDA uses the torch transport;
    ``transport="native"`` or this variable asks for the engine.
    """
    import os

    return os.environ.get(CUDA_IPC_ENV, "") == "1"


def auto_kind(device: torch.device | str | None = None) -> str:
    """What ``"auto"`` asks for on ``device``: ``"native"`` where the compiled engine serves it (on GPUs only
    with :func:`cuda_ipc_auto`), else ``"torch"``.  On a GPU, "native" may still fall back to "torch" when a
    CUDA IPC step fails (see :func:`make_transport`)."""
    import torch

    dev = torch.device(device) if device is not None else torch.device("cpu")
    if not native_available(dev) or (dev.type == "cuda" and not cuda_ipc_auto()):
        return "torch"
    return "native"


def make_transport(
    kind: str | Transport,
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Transport:
    """Build the transport named ``kind`` for ``group`` (default: the default group).

    ``"auto"`` (the runtime's default): what transport/auto.py's rule picks from the
    group's host ids (exchanged here), built: on CPU ``"native"`` when the compiled
    engine is built (peers on other hosts through torch.distributed inside it), else ``"torch"``.  On CUDA, "auto" is
    ``"torch"`` unless :func:`cuda_ipc_auto` (``DUALPIPE_KERNELS_CUDA_IPC=1``):
    then it uses CUDA IPC (to same-host peers, beside torch for the others) only if
    every step of it works on every rank of ``group`` (exporting buffers and events,
    opening the peers'), and otherwise warns which step failed on which rank and
    returns ``"torch"`` (see fallback.py).
    ``"torch"``: torch.distributed point-to-point over a gloo group (CUDA tensors
    are staged through host memory; over an NCCL group transfers are sequenced per pair, see ordered.py).
    ``"native"``: the compiled engine (shared memory between CPU processes, CUDA
    IPC between GPU processes on one host); peers on other hosts (host ids:
    transport/hosts.py) go through torch.distributed, chosen per peer (CPU:
    inside NativeTransport; GPU: per_peer.RoutedTransport, CUDA IPC to
    same-host peers and the torch transport, NCCL or gloo, to the others).
    An instance is returned as is.  Construction is collective: every rank of
    ``group`` must call it with the same ``kind``.
    """
    if isinstance(kind, Transport):
        return kind
    import torch

    dev = torch.device(device) if device is not None else torch.device("cpu")
    if kind == "auto":
        return _make_auto(group, dev, timeout_s)
    return _make(kind, group, dev, timeout_s)


def _make(kind: str, group: dist.ProcessGroup | None, dev: torch.device, timeout_s: float) -> Transport:
    """The transport named ``kind`` (``"torch"`` or ``"native"``)."""
    if kind == "native" and dev.type == "cuda" and native_available(dev):
        routed = _routed_by_host(kind, group, dev, timeout_s)
        if routed is not None:
            return routed
    if kind == "torch":
        from dualpipe_kernels.transport.torch_dist import TorchDistTransport

        return TorchDistTransport(group, device=dev, timeout_s=timeout_s)
    if kind == "native":
        if dev.type == "cuda":
            from dualpipe_kernels.transport.cuda_ipc import CudaIpcTransport

            return CudaIpcTransport(group, device=dev, timeout_s=timeout_s)
        from dualpipe_kernels.transport.native import NativeTransport

        return NativeTransport(group, timeout_s=timeout_s)
    raise ValueError(
        f"unknown transport {kind!r}; expected one of {', '.join(TRANSPORT_NAMES)} or a Transport instance"
    )


def _make_auto(group: dist.ProcessGroup | None, dev: torch.device, timeout_s: float) -> Transport:
    """What auto.py's rule picks from the group's host ids (exchanged here: collective), built; the debug line
    per peer says what each got and why (after a failed CUDA IPC vote: torch, as built)."""
    import warnings

    import torch.distributed as dist

    from dualpipe_kernels.transport import auto
    from dualpipe_kernels.transport.hosts import host_id
    from dualpipe_kernels.transport.per_peer import exchange_hosts

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    hosts = exchange_hosts(group, rank, world, host_id(), timeout_s)
    native, allowed, backend = native_available(dev), cuda_ipc_auto(), str(dist.get_backend(group))
    pick, routes = auto.auto_transport(hosts, rank, dev.type, backend, native_built=native, cuda_ipc_allowed=allowed)
    built: Transport | None = None
    if pick == "routed":
        built = _routed_by_host("auto", group, dev, timeout_s, hosts=hosts)
    elif pick == "cuda_ipc":
        from dualpipe_kernels.transport.fallback import cuda_ipc_or_none

        built = cuda_ipc_or_none(group, dev, timeout_s)  # None (warned): CUDA IPC failed on some rank
    elif pick in ("native", "torch"):
        built = _make(pick, group, dev, timeout_s)
    else:
        raise ValueError(f"transport/auto.py picked {pick!r}; make_transport builds one of {auto.AUTO_BUILDS}")
    if built is None:
        built = _make("torch", group, dev, timeout_s)
    ipc_failed = pick in ("cuda_ipc", "routed") and "cuda_ipc" not in {
        built.name,
        *getattr(built, "routes", {}).values(),
    }
    if ipc_failed:  # what was built: torch where CUDA IPC would have been
        routes = auto.auto_routes(hosts, rank, dev.type, backend, native_built=native, cuda_ipc_allowed=False)
    auto.log_routes(rank, routes)
    if dev.type == "cuda" and native and not allowed and any(hosts[p] == hosts[rank] for p in routes):
        warnings.warn(f"rank {rank}: {auto.CUDA_IPC_OFF_REASON}", stacklevel=3)
    return built


def _routed_by_host(
    kind: str,
    group: dist.ProcessGroup | None,
    dev: torch.device,
    timeout_s: float,
    hosts: list[str] | None = None,
) -> Transport | None:
    """GPUs on several hosts: CUDA IPC to same-host peers, torch to the others; None when all share one host.
    ``hosts``: the group's host ids when already exchanged (else exchanged here: collective)."""
    import torch.distributed as dist

    from dualpipe_kernels.transport.hosts import host_id
    from dualpipe_kernels.transport.per_peer import RoutedTransport, exchange_hosts, peer_routes
    from dualpipe_kernels.transport.torch_dist import TorchDistTransport

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if hosts is None:
        hosts = exchange_hosts(group, rank, world, host_id(), timeout_s)
    if len(set(hosts)) == 1:
        return None
    routes = peer_routes(hosts, rank, "cuda")
    local = [p for p, k in routes.items() if k == "cuda_ipc"]
    transports: dict[str, Transport] = {"torch": TorchDistTransport(group, device=dev, timeout_s=timeout_s)}
    if kind == "auto":  # every rank votes, also those without a same-host peer (the vote is collective)
        from dualpipe_kernels.transport.fallback import cuda_ipc_or_none

        ipc = cuda_ipc_or_none(group, dev, timeout_s, peers=local)
    else:
        from dualpipe_kernels.transport.cuda_ipc import CudaIpcTransport

        ipc = CudaIpcTransport(group, device=dev, timeout_s=timeout_s, peers=local)
    if ipc is None:  # CUDA IPC failed somewhere: every peer through torch (cuda_ipc_or_none warned)
        routes = {p: "torch" for p in routes}
    else:
        transports["cuda_ipc"] = ipc
    return RoutedTransport(rank, routes, transports, timeout_s)


def native_available(device: torch.device | str | None = None) -> bool:
    """Whether ``transport="native"`` can serve tensors on ``device`` in this build."""
    import torch

    dev = torch.device(device) if device is not None else torch.device("cpu")
    try:
        from dualpipe_kernels import _C
    except ImportError:
        return False
    if dev.type == "cuda":
        return bool(_C.has_cuda())
    return dev.type == "cpu"
