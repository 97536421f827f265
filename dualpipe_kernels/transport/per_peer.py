"""One transport per peer: same-host peers through the native engine, peers on other hosts through torch.distributed.

On CPU, :class:`~.native.NativeTransport` routes per peer itself (shared memory
on one host, a torch fallback for the others).  On GPUs the same choice is
made here: peers with this rank's host id (:mod:`.hosts`) get CUDA IPC
(:class:`~.cuda_ipc.CudaIpcTransport`, built for those peers only), the others
the torch transport over the group's backend (NCCL: transfers sequenced per
pair, see ordered.py; gloo: device tensors staged through the host).
:func:`peer_routes` is the rule, a pure function of the host ids;
:class:`RoutedTransport` applies it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from dualpipe_kernels.transport.base import Handle, Transport, group_store, wait_store_key

__all__ = ["LOCAL_KINDS", "RoutedTransport", "exchange_hosts", "peer_routes"]

#: the same-host transport per device type
LOCAL_KINDS = {"cpu": "native", "cuda": "cuda_ipc"}


def peer_routes(hosts: Sequence[str], rank: int, device_type: str, native: bool = True) -> dict[int, str]:
    """Per peer group rank: ``LOCAL_KINDS[device_type]`` for peers with this rank's host id, else ``"torch"``.

    ``hosts[r]``: group rank ``r``'s host id.  ``native``: whether the
    compiled engine serves ``device_type`` in this build (when not, every
    peer goes through torch).
    """
    if not 0 <= rank < len(hosts):
        raise ValueError(f"rank {rank} is not in a group of {len(hosts)} host ids")
    if device_type not in LOCAL_KINDS:
        raise ValueError(f"no same-host transport for device type {device_type!r}; expected one of {list(LOCAL_KINDS)}")
    local = LOCAL_KINDS[device_type] if native else "torch"
    return {p: local if hosts[p] == hosts[rank] else "torch" for p in range(len(hosts)) if p != rank}


def exchange_hosts(group: object, rank: int, world: int, host: str, timeout_s: float) -> list[str]:
    """Every group rank's host id, through the group's store (collective: every rank calls it once per build)."""
    store = group_store(group)
    generation = store.add(f"dpk/hosts/generation/{rank}", 1)  # ranks build transports in the same order
    prefix = f"dpk/hosts/{generation}"
    store.set(f"{prefix}/{rank}", host)
    out = []
    for p in range(world):
        wait_store_key(store, f"{prefix}/{p}", timeout_s, f"rank {rank}: host id exchange", f"rank {p}'s host id")
        out.append(store.get(f"{prefix}/{p}").decode())
    return out


class RoutedTransport(Transport):
    """Posts each transfer to its peer's transport (``routes[peer]`` names a key of ``transports``).

    ``local_peers``: the peers not routed to ``"torch"`` (what the pipeline's
    description reports); ``name``: the same-host transport's name (the remote
    one's when no peer is local).  Owns the transports: ``close`` closes them.
    """

    def __init__(
        self, rank: int, routes: Mapping[int, str], transports: Mapping[str, Transport], timeout_s: float
    ) -> None:
        super().__init__(timeout_s)
        missing = sorted({k for k in routes.values() if k not in transports})
        if missing:
            raise ValueError(f"rank {rank}: routes name transports {missing} that were not built")
        self._rank, self.routes, self.transports = rank, dict(routes), dict(transports)
        self._owns = True  # close() closes the transports (False for an in-order view of them)
        self.local_peers = tuple(sorted(p for p, k in self.routes.items() if k != "torch"))
        first = next((k for k in self.routes.values() if k != "torch"), "torch")
        inner = self.transports.get(first) or next(iter(self.transports.values()))
        self.name = str(getattr(inner, "name", first))
        # Every tensor goes to the runtime's device; the torch transport stages CUDA tensors itself if it must.
        self.device = getattr(inner, "device", torch.device("cpu"))
        self.device_native = True

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def recv_lookahead(self) -> int:
        """The largest of its transports' (one window for all peers: the one that needs it longest)."""
        return max(t.recv_lookahead for t in self.transports.values())

    @property
    def early_small_receives(self) -> bool:
        """When any of its transports wants them (posting early elsewhere costs little: native 0.98-1.06)."""
        return any(t.early_small_receives for t in self.transports.values())

    @property
    def host_wire(self) -> bool:
        return all(t.host_wire for t in self.transports.values())

    @property
    def matches_tags(self) -> bool:
        return all(t.matches_tags for t in self.transports.values())

    def in_order(self, channel: int) -> Transport:
        """Per peer: its transport's in-order channel where it pairs transfers in posting order (NCCL), else
        the transport itself (a tag-matched one takes the program's order as well as any)."""
        inner = {k: t if t.matches_tags else t.in_order(channel) for k, t in self.transports.items()}
        routed = RoutedTransport(self._rank, self.routes, inner, self.timeout_s)
        routed._owns = False  # a view: the transports are this one's
        return routed

    def host_channel(self) -> Transport:
        """The torch transport's (a gloo group of every rank of the group: it reaches every peer)."""
        torch_t = self.transports.get("torch")
        if torch_t is not None:
            return torch_t.host_channel()
        return next(iter(self.transports.values())).host_channel()

    def _route(self, peer: int, what: str) -> Transport:
        kind = self.routes.get(peer)
        if kind is None:
            raise ValueError(f"rank {self._rank}: peer {peer} is not in this group ({what})")
        return self.transports[kind]

    def isend(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "") -> Handle:
        return self._route(peer, what).isend(tensor, peer, tag, what)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "") -> Handle:
        return self._route(peer, what).irecv(tensor, peer, tag, what)

    @property
    def fails_waits(self) -> bool:
        return all(t.fails_waits for t in self.transports.values())

    def fail_all(self, error: BaseException) -> None:
        """Every one of its transports' (a view's too: they are the same transports)."""
        for t in self.transports.values():
            t.fail_all(error)

    def close(self) -> None:
        if self._owns:
            for t in self.transports.values():
                t.close()
