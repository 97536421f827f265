"""Small boundary messages as one transfer: the metadata and the data of a repeated layout together.

Why: a stage boundary of a small micro-batch is a few KiB, and its cost is the
per-message cost of the transport (a gloo message is ~100 us of CPU on both
ends), not its bytes.  The general protocol (transfer.py) sends the fixed-size
metadata and then one transfer per tensor (or one packed buffer): two or more
messages per boundary.  When both ends remember the message's layout from
the previous step (layout_memory.py's layout memory, which both ends keep in
agreement) and its data is at most :data:`INLINE_MAX_BYTES`, the receiver
posts *one* receive of ``META_BYTES + plan.nbytes`` bytes and the sender
sends one buffer of that size::

    [metadata (META_LEN int64) | data]

``data``: under ``none`` each tensor's bytes at a 16-byte aligned offset
(bit for bit, so a copy out is a view and a clone), under a packed format
the packed buffer itself (packed in place, one pass).  A sender whose layout
changed sends the metadata (flag "not speculative") with zeros after it in
that one buffer, and the real data to the fresh tags, as in the general
protocol.  Only transports whose buffers live in host memory use it (the
metadata is read on the host; a device transport would need a sync).

The limit is higher on a transport that takes a whole larger message as one
copy on each side, the same on every rank (``Transport.message_inline_bytes``,
:func:`inline_limit`; the native transport where ranks share CPUs: a ring slot):
there a repeated message of a 256 KiB activation is one transfer too, gathered
into the ring slot by the sender and, from ``HANDOVER_MIN_BYTES`` of data on,
handed over by the receiver (repeat.py).

The receiver's buffers come from a :class:`~dualpipe_kernels.runtime.boundary.pool.BufferPool` (reused across steps:
the data is copied out of them, so they are free again as soon as the
message is read; no fresh allocation or page faults per message).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dualpipe_kernels.kernels import PackLayout, pack_as
from dualpipe_kernels.runtime.boundary.codec import MessageCodec
from dualpipe_kernels.runtime.boundary.header import META_LEN, Layout

if TYPE_CHECKING:
    from dualpipe_kernels.transport.base import Transport

__all__ = ["INLINE_MAX_BYTES", "META_BYTES", "inline_limit", "InlinePlan", "inline_plan", "build", "read", "data_views"]

#: data bytes (after the metadata) up to which a message with a remembered layout travels as one transfer
INLINE_MAX_BYTES = 32 * 1024
META_BYTES = META_LEN * 8
_ALIGN = 16
_HOST = torch.device("cpu")


@dataclass(frozen=True)
class InlinePlan:
    """Where a layout's data sits after the metadata.

    ``offsets[i]``: byte offset of tensor ``i``'s bits (``none``; None: no
    bytes); ``pack``: the packed buffer's layout (packed formats).
    """

    nbytes: int
    offsets: tuple[int | None, ...]
    pack: PackLayout | None


def inline_plan(codec: MessageCodec, layout: Layout) -> InlinePlan:
    """The inline plan of a message of ``layout`` in ``codec``'s format."""
    if codec.packed:
        pl = codec.pack_layout(layout)
        return InlinePlan(pl.nbytes if pl is not None else 0, (), pl)
    offsets: list[int | None] = []
    pos = 0
    for e in layout:
        n = 0 if e is None else _nbytes(e[0], e[1])
        if n == 0:
            offsets.append(None)
            continue
        pos = -(-pos // _ALIGN) * _ALIGN  # each tensor starts aligned (its bits are viewed in place)
        offsets.append(pos)
        pos += n
    return InlinePlan(pos, tuple(offsets), None)


def inline_limit(transport: Transport) -> int:
    """The data bytes up to which a repeated message travels inline on ``transport``: :data:`INLINE_MAX_BYTES`,
    or more where the transport takes a larger message as one copy on each side, the same on every rank
    (``Transport.message_inline_bytes``, less the metadata header)."""
    return max(INLINE_MAX_BYTES, transport.message_inline_bytes - META_BYTES)


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def build(
    meta: torch.Tensor,
    tensors: Sequence[torch.Tensor | None],
    codec: MessageCodec,
    layout: Layout | None,
    plan: InlinePlan,
) -> torch.Tensor:
    """The one uint8 buffer of a message: ``meta``, then the data of ``tensors`` (``layout``) per ``plan``.

    ``layout`` None: zeros after the metadata (the receiver's posted buffer of
    a layout the sender no longer has; the data goes to the fresh tags).
    """
    if layout is not None and plan.pack is None and len(tensors) == 1 and plan.offsets == (0,):
        t = tensors[0]
        assert t is not None
        if t.is_cpu:  # the common message, one tensor: one concatenation
            return torch.cat((meta.view(torch.uint8), t.detach().reshape(-1).view(torch.uint8)))
    buf = torch.empty(META_BYTES + plan.nbytes, dtype=torch.uint8, device=_HOST)
    buf[:META_BYTES].copy_(meta.view(torch.uint8))
    data = buf[META_BYTES:]
    if layout is None:
        data.zero_()
    elif plan.pack is not None:
        pack_as(codec.pack_inputs(tensors, layout, torch.device("cpu")), plan.pack, data, "inline message")
    else:
        for t, off in zip(tensors, plan.offsets, strict=True):
            if off is not None:
                assert t is not None
                src = t.detach().reshape(-1).view(torch.uint8)
                data[off : off + src.numel()].copy_(src)
    return buf


def read(
    buf: torch.Tensor, codec: MessageCodec, layout: Layout, plan: InlinePlan, device: torch.device
) -> list[torch.Tensor | None]:
    """The message's tensors, new on ``device`` (copied out of ``buf``, which is free again afterwards)."""
    if plan.pack is not None:
        data = buf[META_BYTES : META_BYTES + plan.nbytes]
        tensors: list[torch.Tensor | None] = [
            None if e is None else torch.empty(e[1], dtype=e[0], device=_HOST) for e in layout
        ]
        codec.unpack_into(tensors, layout, data)
        return tensors if device.type == "cpu" else [None if t is None else t.to(device) for t in tensors]
    out: list[torch.Tensor | None] = []
    for e, view in zip(layout, data_views(buf, layout, plan), strict=True):
        if e is None:
            out.append(None)
        elif view is None:  # no bytes (zero-size)
            out.append(torch.empty(e[1], dtype=e[0], device=device))
        else:
            out.append(view.clone() if device.type == "cpu" else view.to(device))
    return out


def data_views(buf: torch.Tensor, layout: Layout, plan: InlinePlan) -> list[torch.Tensor | None]:
    """Each tensor's typed view into the inline buffer ``buf`` (unpacked plans; None: no tensor or no bytes)."""
    views: list[torch.Tensor | None] = []
    for e, off in zip(layout, plan.offsets, strict=True):
        if e is None or off is None:
            views.append(None)
        else:
            start = META_BYTES + off
            views.append(buf[start : start + _nbytes(e[0], e[1])].view(e[0]).view(e[1]))
    return views
