"""What ``transport="auto"`` gives each peer, and why: the rule as a pure function, and the log line.

Per peer (group rank), from the host ids of the group's ranks (hosts.py), the device kind, the group's
backend and what this build and this machine allow:

* CPU: a peer on this host through the native engine (shared memory) when it is built, else torch over
  gloo; a peer on another host through torch over gloo.
* CUDA, a peer on this host: the CUDA IPC engine once it is allowed (``cuda_ipc_allowed``: the GPU check
  has shown its error paths pass, ``DUALPIPE_KERNELS_CUDA_IPC=1``); until then NCCL in the program's order
  when the group's backend is NCCL.
* CUDA, a peer on another host: NCCL in the program's order when the group's backend is NCCL.
* CUDA over a gloo group: torch over gloo, the tensors staged through pinned host memory; that path is
  slow and "auto" says so (an NCCL group gives the fast path).

:func:`auto_routes` is the rule per peer; :func:`auto_transport` reads off it what ``make_transport("auto")``
builds (transport/__init__.py builds exactly that); :func:`log_routes` writes one debug line per peer (logger
``dualpipe_kernels.transport``) with the transport it got and why.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["AUTO_BUILDS", "CUDA_IPC_OFF_REASON", "PeerRoute", "auto_routes", "auto_transport", "log_routes"]

#: what ``make_transport("auto")`` builds: the native engine (CPU; it sends other-host peers through torch
#: itself), torch.distributed, the CUDA IPC engine to every peer, or a RoutedTransport (CUDA IPC to
#: same-host peers, torch to the others)
AUTO_BUILDS = ("native", "torch", "cuda_ipc", "routed")

_log = logging.getLogger("dualpipe_kernels.transport")

#: why "auto" does not use the CUDA IPC engine yet (the warning and the log line say it)
CUDA_IPC_OFF_REASON = (
    "the CUDA IPC engine is off under transport='auto' until the GPU check (bench/device_check.sh) shows its "
    "error paths pass: a crash there cannot fall back (set DUALPIPE_KERNELS_CUDA_IPC=1 or pass "
    "transport='native' to use it)"
)


@dataclass(frozen=True)
class PeerRoute:
    """The transport one peer gets (``native``, ``cuda_ipc``, ``nccl``, ``gloo`` or ``gloo_staged``) and why."""

    kind: str
    reason: str


def auto_routes(
    hosts: Sequence[str],
    rank: int,
    device_type: str,
    backend: str,
    *,
    native_built: bool,
    cuda_ipc_allowed: bool,
) -> dict[int, PeerRoute]:
    """Per peer group rank, what ``"auto"`` gives it (see the module docstring).

    ``hosts[r]``: group rank ``r``'s host id; ``device_type``: "cpu" or "cuda"; ``backend``: the group's
    (e.g. "gloo", "nccl"); ``native_built``: the compiled engine serves ``device_type`` in this build.
    """
    if not 0 <= rank < len(hosts):
        raise ValueError(f"rank {rank} is not in a group of {len(hosts)} host ids")
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"transport='auto' serves cpu and cuda devices, got {device_type!r}")
    nccl = "nccl" in backend.lower()
    out: dict[int, PeerRoute] = {}
    for peer, host in enumerate(hosts):
        if peer == rank:
            continue
        local = host == hosts[rank]
        where = "same host" if local else f"another host ({host})"
        if device_type == "cpu":
            if local and native_built:
                out[peer] = PeerRoute("native", f"{where}: the native engine over shared memory")
            elif local:
                out[peer] = PeerRoute("gloo", f"{where}, but the native engine is not built: torch over gloo")
            else:
                out[peer] = PeerRoute("gloo", f"{where}: torch over gloo")
            continue
        if local and native_built and cuda_ipc_allowed:
            out[peer] = PeerRoute("cuda_ipc", f"{where}: the CUDA IPC engine")
            continue
        why = f"{where}" if not local else f"{where}, but {CUDA_IPC_OFF_REASON if native_built else 'no CUDA engine'}"
        if nccl:
            out[peer] = PeerRoute("nccl", f"{why}: NCCL, transfers posted in the program's order")
        else:
            out[peer] = PeerRoute(
                "gloo_staged",
                f"{why}: the group's backend is {backend}, so torch over gloo through pinned host buffers "
                "(slow; an NCCL group gives the fast path)",
            )
    return out


def auto_transport(
    hosts: Sequence[str],
    rank: int,
    device_type: str,
    backend: str,
    *,
    native_built: bool,
    cuda_ipc_allowed: bool,
) -> tuple[str, dict[int, PeerRoute]]:
    """``(what make_transport("auto") builds, one of AUTO_BUILDS; the per-peer routes)``, from the rule.

    The transport is one object for every peer, so it is read off the routes of the whole group (every rank
    has every host id, so all ranks decide alike, as the engines' collective set-up needs): on CPU the
    native engine whenever it is built (it sends the peers the rule gives ``gloo``, those on other hosts,
    through torch.distributed itself), else torch; on CUDA, the CUDA IPC engine when the rule gives it to
    some peer (to every peer when all share one host, else routed beside torch), else torch.
    """
    routes = auto_routes(
        hosts, rank, device_type, backend, native_built=native_built, cuda_ipc_allowed=cuda_ipc_allowed
    )
    if device_type == "cpu":
        return ("native" if native_built else "torch"), routes
    shared_host = len(set(hosts)) < len(hosts) or len(hosts) == 1
    if not (native_built and cuda_ipc_allowed and shared_host):
        return "torch", routes
    return ("cuda_ipc" if len(set(hosts)) == 1 else "routed"), routes


def log_routes(rank: int, routes: dict[int, PeerRoute]) -> None:
    """One debug line per peer: the transport it got and why."""
    if _log.isEnabledFor(logging.DEBUG):
        for peer, route in sorted(routes.items()):
            _log.debug("rank %d -> peer rank %d: %s (%s)", rank, peer, route.kind, route.reason)
