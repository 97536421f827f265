"""The views of a :class:`~dualpipe_kernels.transport.torch_dist.TorchDistTransport` that a pipeline posts to
besides the transport itself: an in-order channel (posting straight to the backend in call order, as NCCL pairs
transfers) and the tag-matched gloo side channel for host tensors.  ``owner`` is that transport (typed loosely:
it imports this module); its ``check_peer`` / ``stage_send`` / ``stage_recv`` are the checks and host staging
every post goes through."""

from __future__ import annotations

from typing import Any

import torch

from dualpipe_kernels.transport.base import Handle, Transport, TransportError
from dualpipe_kernels.transport.torch_groups import SIDE_PREFIX, direction_group, nccl_backend
from dualpipe_kernels.transport.torch_handles import NcclHandle, WorkHandle

__all__ = ["InOrderChannel", "SideChannel"]


class InOrderChannel(Transport):
    """One in-order channel of an ordered :class:`TorchDistTransport` (see its ``in_order``)."""

    name = "torch-in-order"

    def __init__(self, owner: Any, channel: int) -> None:
        super().__init__(owner.timeout_s)
        self._owner = owner
        self.channel = channel
        self.device = owner.device
        self.device_native = owner.device_native
        self._tag = channel + 1  # gloo: the channel's own tag (0 is the sequencing layer's)
        self._backends: dict[bool, Any] = {}

    @property
    def rank(self) -> int:
        return self._owner.rank

    @property
    def matches_tags(self) -> bool:
        return False

    def host_channel(self) -> Transport:
        return self._owner.host_channel()

    def _backend(self, up: bool) -> Any:
        """NCCL: the communicator of this channel and direction (``up``: to the higher rank of a pair)."""
        backend = self._backends.get(up)
        if backend is None:
            if up and self.channel == min(self._owner._in_order):
                backend = self._owner.group  # the first channel made on this transport: the group itself
            else:
                backend = nccl_backend(self._owner.group, f"c{self.channel}/{'up' if up else 'down'}",
                                        self._owner.timeout_s)  # fmt: skip
            self._backends[up] = backend
        return backend

    def isend(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "") -> Handle:
        o = self._owner
        o.check_peer(peer, what)
        if o._nccl:
            group = self._backend(peer > o.rank)
            return NcclHandle(group.send([tensor], peer, 0), o, peer, what)
        buf, keep = o.stage_send(tensor)
        group = o.group if o._down is None or peer > o.rank else o._down
        try:
            work = group.send([buf], peer, self._tag)
        except RuntimeError as exc:
            raise TransportError(f"rank {o.rank} -> peer rank {peer}: posting {what} failed: {exc}") from exc
        return WorkHandle(work, o, peer, what, keep=keep)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "") -> Handle:
        o = self._owner
        o.check_peer(peer, what)
        if o._nccl:
            group = self._backend(peer < o.rank)  # the sender's direction: to the higher rank of the pair
            return NcclHandle(group.recv([tensor], peer, 0), o, peer, what)
        buf, finish = o.stage_recv(tensor)
        group = o.group if o._down is None or peer < o.rank else o._down
        try:
            work = group.recv([buf], peer, self._tag)
        except RuntimeError as exc:
            raise TransportError(f"rank {o.rank} <- peer rank {peer}: posting {what} failed: {exc}") from exc
        return WorkHandle(work, o, peer, what, finish)


class SideChannel(Transport):
    """A tag-matched gloo group of an ordered or device transport's ranks, for host tensors (message headers;
    device tensors, rarely sent here, are staged through the host)."""

    name = "torch-side"

    def __init__(self, owner: Any) -> None:
        super().__init__(owner.timeout_s)
        self._owner = owner
        self.backend = direction_group(owner.group, owner.timeout_s, SIDE_PREFIX)

    @property
    def rank(self) -> int:
        return self._owner.rank

    def isend(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "") -> Handle:
        o = self._owner
        o.check_peer(peer, what)
        buf = tensor if tensor.device.type == "cpu" else tensor.to("cpu")
        try:
            work = self.backend.send([buf], peer, tag)
        except RuntimeError as exc:
            raise TransportError(f"rank {o.rank} -> peer rank {peer}: posting {what} failed: {exc}") from exc
        return WorkHandle(work, o, peer, what, keep=None if buf is tensor else buf)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "") -> Handle:
        o = self._owner
        o.check_peer(peer, what)
        staged = tensor.device.type != "cpu"
        buf = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu") if staged else tensor
        try:
            work = self.backend.recv([buf], peer, tag)
        except RuntimeError as exc:
            raise TransportError(f"rank {o.rank} <- peer rank {peer}: posting {what} failed: {exc}") from exc

        def finish() -> None:
            tensor.copy_(buf)

        return WorkHandle(work, o, peer, what, finish if staged else None)
