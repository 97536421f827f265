"""Measuring a step's communication in the step's own processes: a payload switch and a link timer.

:class:`PayloadSwitch` wraps the transport a :class:`~dualpipe_kernels.runtime.Pipeline`
is given.  With ``tiny`` off it passes every transfer through and records the
bytes of each large receive (what the step moves).  With ``tiny`` on, every
transfer larger than ``KEEP_WHOLE_BYTES + TINY_BYTES`` moves only its first that many
bytes (both ends cut the same way: they hold tensors of the same size), so the
same pipeline runs the same compute and the same bookkeeping with almost no
data to move: that step's time is ``T_compute`` of :mod:`.metrics`.  The
boundary metadata (1 KiB, alone or at the head of a small message's one
transfer) is never cut, so the runtime's protocol is unchanged;
the received data beyond the first bytes is zeros (set when the receive is
posted, a memset charged to ``T_compute``), which only timing runs may use.
Packed sends of real steps go through the inner transport's ``isend_packed``
(the native transport packs into its ring slot); cut ones pack into a buffer.
Gathered small sends (``try_isend_gather``) go through the inner transport's,
cut the same way, so the runtime takes the paths it takes on the bare transport.
Toggle ``tiny`` only between steps, on every rank.

:func:`link_timing` times one-way transfers between ranks 0 and 1 over the
raw transport (ping-pong, median round trip / 2): latency from a tiny message,
bandwidth from one of the activation size.  With it, ``T_comm`` of a step is
the sum over the busiest rank's recorded receives of ``latency + bytes / bandwidth``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from dualpipe_kernels.transport.base import Handle, Transport

if TYPE_CHECKING:
    from dualpipe_kernels.kernels import PackLayout

__all__ = ["PayloadSwitch", "LinkTiming", "link_timing", "TINY_BYTES", "KEEP_WHOLE_BYTES"]

#: bytes a cut transfer still moves
TINY_BYTES = 64
#: transfers up to this size are never cut (the boundary metadata is 1 KiB)
KEEP_WHOLE_BYTES = 1024


#: what a cut transfer keeps: a small message travels as metadata + data in one transfer
#: (runtime/boundary/inline.py), so its first KiB, the metadata, is never cut either
_KEPT = KEEP_WHOLE_BYTES + TINY_BYTES


def _cut(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)[:_KEPT]


class PayloadSwitch(Transport):
    """A transport that forwards to ``inner``, cutting large transfers to ``TINY_BYTES`` while ``tiny`` is on.

    Owns ``inner`` (``close`` closes it).  ``received_bytes`` lists the size of
    every large receive posted while ``tiny`` was off; clear it before a step
    to learn what that step moved to this rank.
    """

    def __init__(self, inner: Transport) -> None:
        super().__init__(inner.timeout_s)
        self.inner = inner
        self.name = f"{inner.name}+switch"
        # what runtime/boundary/transfer.py's wire_device reads: without these the runtime would post host tensors
        # to a device transport (CudaIpcTransport refuses them)
        self.device = getattr(inner, "device", None)
        self.device_native = getattr(inner, "device_native", True)
        self.tiny = False
        self.received_bytes: list[int] = []

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def recv_lookahead(self) -> int:
        return self.inner.recv_lookahead

    @property
    def early_small_receives(self) -> bool:
        return self.inner.early_small_receives

    @property
    def message_inline_bytes(self) -> int:
        return self.inner.message_inline_bytes

    @property
    def host_wire(self) -> bool:
        return self.inner.host_wire

    @property
    def matches_tags(self) -> bool:
        return self.inner.matches_tags

    def in_order(self, channel: int) -> Transport:
        """The inner transport's in-order channel (not switched: an ordered wire carries whole messages)."""
        return self.inner.in_order(channel)

    def host_channel(self) -> Transport:
        return self.inner.host_channel() if not (self.inner.host_wire and self.inner.matches_tags) else self

    def _large(self, tensor: torch.Tensor) -> bool:
        return tensor.numel() * tensor.element_size() > _KEPT

    def isend(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "") -> Handle:
        if self.tiny and self._large(tensor):
            tensor = _cut(tensor)
        return self.inner.isend(tensor, peer, tag, what)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "") -> Handle:
        if self._large(tensor):
            if self.tiny:
                # Zeros beyond the cut, not whatever the allocator left: unpacking costs what it does on
                # data (fp8 dequantisation takes a slower exact route for NaN codes and huge scales).
                tensor.reshape(-1).view(torch.uint8)[_KEPT:].zero_()
                tensor = _cut(tensor)
            else:
                from dualpipe_kernels.runtime.boundary.header import META_LEN, TagSpace

                nbytes = tensor.numel() * tensor.element_size()
                # a small message's one transfer (runtime/boundary/inline.py): its data follows the metadata
                self.received_bytes.append(nbytes - META_LEN * 8 if TagSpace.is_metadata(tag) else nbytes)
        return self.inner.irecv(tensor, peer, tag, what)

    def try_isend_gather(self, pieces: Sequence[tuple[int, torch.Tensor]], nbytes: int, peer: int, tag: int) -> bool:
        """The inner transport's gathered send (the runtime's repeated small messages), cut like ``isend``.

        Without it the runtime would stage every such message in a buffer behind the switch, a slower
        path than the pipeline takes on the bare transport.  A cut message keeps the bytes of its pieces
        that lie in its first ``KEEP_WHOLE_BYTES + TINY_BYTES``; False (the runtime then posts a buffer)
        when the inner transport cannot gather or a piece is not a contiguous CPU tensor.
        """
        gather = getattr(self.inner, "try_isend_gather", None)
        if gather is None:
            return False
        if self.tiny and nbytes > _KEPT:
            if not all(t.is_cpu and t.is_contiguous() for _, t in pieces):
                return False
            pieces = [(off, t.reshape(-1).view(torch.uint8)[: _KEPT - off]) for off, t in pieces if off < _KEPT]
            nbytes = _KEPT
        return bool(gather(pieces, nbytes, peer, tag))

    def isend_packed(
        self, tensors: Sequence[torch.Tensor], layout: PackLayout, peer: int, tag: int, what: str = ""
    ) -> Handle:
        # Real steps pack the inner transport's way (NativeTransport packs into its ring slot); cut
        # steps pack into a buffer (the same packing work) and send its first bytes through isend.
        if self.tiny:
            return super().isend_packed(tensors, layout, peer, tag, what)
        return self.inner.isend_packed(tensors, layout, peer, tag, what)

    def close(self) -> None:
        self.inner.close()


@dataclass(frozen=True)
class LinkTiming:
    """One-way transfer times between ranks 0 and 1 (seconds; bandwidth in bytes/s)."""

    latency_s: float
    nbytes: int
    one_way_s: float
    bandwidth_bps: float

    def transfer_s(self, nbytes: int) -> float:
        """Modelled one-way time of a transfer of ``nbytes`` on this link."""
        return self.latency_s + nbytes / self.bandwidth_bps


def _one_way(transport: Transport, rank: int, nbytes: int, repeats: int, device: torch.device) -> float:
    import torch.distributed as dist

    buf = torch.zeros(max(1, nbytes), dtype=torch.uint8, device=device)
    peer = 1 - rank
    times = []
    for _ in range(repeats + 1):  # the first round trip carries connection set-up
        t0 = time.perf_counter()
        if rank == 0:
            transport.isend(buf, peer, tag=7, what="link timing").wait()
            transport.irecv(buf, peer, tag=8, what="link timing").wait()
        else:
            transport.irecv(buf, peer, tag=7, what="link timing").wait()
            transport.isend(buf, peer, tag=8, what="link timing").wait()
        times.append((time.perf_counter() - t0) / 2)
    dist.barrier()
    return float(statistics.median(times[1:]))


def link_timing(
    transport: Transport, rank: int, world: int, nbytes: int, repeats: int = 10, device: Any = "cpu"
) -> LinkTiming | None:
    """Ping-pong between ranks 0 and 1 (collective: every rank calls it); None with one rank.

    The tags used (7, 8) must not be in flight in a pipeline on the same transport: call between steps.
    """
    import torch.distributed as dist

    if world < 2:
        return None
    dev = torch.device(device)
    dist.barrier()
    if rank > 1:  # the others wait at the two barriers inside _one_way's callers
        dist.barrier()
        dist.barrier()
        return None
    lat = _one_way(transport, rank, 1, repeats, dev)
    full = _one_way(transport, rank, nbytes, repeats, dev)
    # Bandwidth from the size-dependent part; a link too fast to tell apart from its latency gets the plain ratio.
    bw = nbytes / (full - lat) if full > lat else nbytes / max(full, 1e-9)
    return LinkTiming(latency_s=lat, nbytes=int(nbytes), one_way_s=full, bandwidth_bps=bw)
