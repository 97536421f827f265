"""Repeated small messages: a boundary message whose layout did not change since the last step.

A training loop sends the same shapes every step, so after the first step
nearly every small boundary message travels inline (inline.py) in the layout
both ends remember.  The general protocol (transfer.py) still works out, for every
message, all that this layout implies: the codec and the layout tuple, the
cached metadata, the inline plan; and the receiver decodes the metadata
header, rebuilds the layout from it and compares it with the remembered one.
With stages of a few microseconds of compute that bookkeeping is most of a
message's cost (the runtime's own overhead per action).

So each end keeps, per message key, what the last such message was
(:class:`~dualpipe_kernels.runtime.boundary.layout_memory.LayoutMemory`'s
``repeat_send`` / ``repeat_recv``):

* the sender: the message's signature (dtype, shape and grad flag of each
  tensor), its encoded metadata and inline plan.  A message with the same
  signature is built and posted at once (:meth:`RepeatSend.post`).
* the receiver: the header bytes it received and the layout they stand for.
  It posts the inline receive at once (:func:`post_repeat`) and, when the
  buffer that arrives starts with the same header bytes, reads the tensors
  without decoding anything (:meth:`RepeatRecvOp.tensors`).  A different
  header (the sender's layout changed) goes to the general protocol with the
  buffer that arrived (``BoundaryRecv(..., posted=...)``), which reads it as
  if it had posted it itself.

A large message (:data:`HANDOVER_MIN_BYTES` of data or more in one tensor,
read on the host, unpacked) is not cloned out of a pooled buffer: it arrives
in a new buffer, and its tensor is made on that buffer's storage (a clone would
copy it once more), a tensor of its own, not a view (the storage's only holder
once read; it keeps the 1 KiB header too).

Both entries are dropped whenever a message of their key takes the general
path and are made again from it, so they always describe the layout that
both ends' layout memories hold.  The bytes on the wire are the same as on
the general path, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dualpipe_kernels.runtime.boundary.codec import MessageCodec
from dualpipe_kernels.runtime.boundary.header import Layout
from dualpipe_kernels.runtime.boundary.inline import META_BYTES, InlinePlan, build, data_views, read
from dualpipe_kernels.runtime.boundary.layout_memory import LayoutMemory
from dualpipe_kernels.transport.base import Handle, Transport

__all__ = [
    "RepeatSend",
    "RepeatRecv",
    "RepeatRecvOp",
    "SmallSend",
    "SENT",
    "signature",
    "same_signature",
    "header_bytes",
    "handover",
    "HANDOVER_MIN_BYTES",
    "post_repeat",
]

#: pooled buffers whose views are remembered per layout: as many as the pool keeps free per size (every receive
#: of a step may be in flight at once when repeats are posted at its start: gloo's early_small)
_MAX_VIEWS = 64

#: data bytes from which a repeated one-tensor message received on the host is handed over: the tensor is
#: made on the storage of the buffer it arrived in, a new one per message, instead of cloned out of a pooled
#: buffer (a clone of a large message costs a copy of it; a new buffer, an allocation)
HANDOVER_MIN_BYTES = 64 * 1024

Signature = tuple[tuple[torch.dtype, torch.Size, bool] | None, ...]


def signature(tensors: Sequence[torch.Tensor | None], grad_flags: Sequence[bool]) -> Signature:
    """Everything of a message's tensors that its metadata encodes: per tensor dtype, shape, grad flag."""
    out: list[tuple[torch.dtype, torch.Size, bool] | None] = []
    for t, g in zip(tensors, grad_flags, strict=False):  # a loop, not a generator: once per message
        out.append(None if t is None else (t.dtype, t.shape, bool(g)))
    return tuple(out)


def same_signature(sig: Signature, tensors: Sequence[torch.Tensor | None], grad_flags: Sequence[bool]) -> bool:
    """``signature(tensors, grad_flags) == sig`` without building the signature (once per repeated send)."""
    if len(sig) != len(tensors) or len(grad_flags) < len(tensors):
        return False
    for e, t, g in zip(sig, tensors, grad_flags, strict=False):
        if t is None or e is None:
            if t is not e:
                return False
        elif e[0] != t.dtype or e[2] != bool(g) or e[1] != t.shape:
            return False
    return True


def handover(layout: Layout, plan: InlinePlan, device: torch.device) -> bool:
    """Whether messages of ``layout`` (read on ``device``) are handed over (:data:`HANDOVER_MIN_BYTES`):
    host tensors, unpacked, at least that many bytes, all in one tensor (the others None: a zero-size one is
    allocated by :func:`read`, and two tensors in one buffer would share their storage)."""
    return (
        device.type == "cpu"
        and plan.pack is None
        and plan.nbytes >= HANDOVER_MIN_BYTES
        and sum(off is not None for off in plan.offsets) == 1
        and all(e is None or off is not None for e, off in zip(layout, plan.offsets, strict=True))
    )


def _handed_over(buf: torch.Tensor, layout: Layout, plan: InlinePlan) -> list[torch.Tensor | None]:
    """The message's one tensor on ``buf``'s storage, not a view of ``buf`` (its own version counter, no
    ``_base``: in-place edits, a stage returning its input and the memory policies' sole-holder test
    behave as for a fresh tensor); the other entries None."""
    out: list[torch.Tensor | None] = []
    for e, off in zip(layout, plan.offsets, strict=True):
        if e is None or off is None:
            out.append(None)
            continue
        shape, strides, n = tuple(e[1]), [], 1
        for d in reversed(shape):  # contiguous strides
            strides.append(n)
            n *= d
        t = torch.empty(0, dtype=e[0], device="cpu")
        out.append(t.set_(buf.untyped_storage(), (META_BYTES + off) // e[0].itemsize, shape, strides[::-1]))
    return out


def header_bytes(buf: torch.Tensor) -> bytes:
    """The metadata header at the start of an inline buffer (host uint8), as bytes."""
    return buf.numpy()[:META_BYTES].tobytes()


class SmallSend:
    """A posted inline message: holds its own buffer until :meth:`wait` (the caller's tensors are not held).

    ``SmallSend(None, None)`` stands for a message already delivered to the ring (a gathered send)."""

    __slots__ = ("_handle", "_buf")

    def __init__(self, handle: Handle | None, buf: torch.Tensor | None) -> None:
        self._handle: Handle | None = handle
        self._buf: torch.Tensor | None = buf

    @property
    def done(self) -> bool:
        """Waited for (successfully): the transport no longer reads the buffer."""
        return self._handle is None

    def wait(self, timeout_s: float) -> None:
        if self._handle is not None:
            self._handle.wait(timeout_s)
            self._handle = self._buf = None


SENT = SmallSend(None, None)  # a message the transport took at once (gathered into its ring)


@dataclass(frozen=True, slots=True)
class RepeatSend:
    """The sender's memory of the last inline message of one key whose layout the receiver remembered."""

    sig: Signature
    meta: torch.Tensor  # the encoded metadata (speculative flag set), host int64
    codec: MessageCodec
    layout: Layout
    plan: InlinePlan
    #: ``[buffer, its per-tensor data views, the SmallSend that last posted it]`` once a message was built
    #: (``none`` format): the next one is written into the same buffer when that send has been waited for
    reuse: list[Any] = field(default_factory=list)

    def post(
        self, transport: Transport, tensors: Sequence[torch.Tensor | None], peer: int, tag: int, what: str
    ) -> SmallSend:
        """Build the message of ``tensors`` (whose signature is :attr:`sig`) and post it.

        A key sends one message per step and every step ends by waiting for its
        small sends, so from the second repeat on the buffer of the last message
        is free again: its header stays, the data is copied over (one copy per
        tensor, no allocation).  A buffer still in flight is never written: a new
        one is built then.

        A transport that can gather (the native one, to a same-host peer) gets the
        header and the tensors' bytes written straight into its ring slot instead,
        when it can take the message at once: no buffer, no copy into it, no
        handle; the bytes on the wire are the same (the gaps between tensors zero).
        """
        gather = getattr(transport, "try_isend_gather", None)
        if gather is not None and self.plan.pack is None:
            pieces: list[tuple[int, torch.Tensor]] = [(0, self.meta)]
            for t, off in zip(tensors, self.plan.offsets, strict=True):
                if off is not None:
                    assert t is not None
                    pieces.append((META_BYTES + off, t))
            try:
                if gather(pieces, META_BYTES + self.plan.nbytes, peer, tag):
                    return SENT
            except ValueError:
                pass  # a non-contiguous or device tensor: the buffer below copies it
        reuse = self.reuse
        if reuse and reuse[2]._handle is None:  # its last send was waited for (SmallSend.done inline)
            buf, views = reuse[0], reuse[1]
            for v, t in zip(views, tensors, strict=True):
                if v is not None:
                    assert t is not None
                    v.copy_(t.detach())
        else:
            buf = build(self.meta, tensors, self.codec, self.layout, self.plan)
            views = None if reuse or self.plan.pack is not None else data_views(buf, self.layout, self.plan)
        send = SmallSend(transport.isend(buf, peer, tag, what), buf)
        if views is not None:
            reuse[:] = [buf, views, send]
        return send


@dataclass(frozen=True, slots=True)
class RepeatRecv:
    """The receiver's memory of the last inline message of one key that came in the remembered layout.

    ``views``: per pooled buffer this key's messages arrived in (the pool hands
    the same few back every step), the header as a numpy array and each
    tensor's typed view into the buffer (``none`` format), so that reading a
    message is a compare and a clone per tensor.  An entry holds its buffer, so
    the ``id`` it is keyed by stays that buffer's; at most ``_MAX_VIEWS`` are kept.
    The entries of one layout share this dict (LayoutMemory.repeat_views): a key's
    next message comes in another of the pool's buffers of that size, whose views
    another key of the layout made.
    """

    header: bytes  # its metadata header, as it arrived
    nbytes: int  # the inline buffer's size: header and data
    codec: MessageCodec
    layout: Layout
    plan: InlinePlan
    grads: tuple[bool, ...]  # per tensor: requires grad on this side
    #: large, one tensor, unpacked and read on the host: each message arrives in a new buffer whose storage
    #: becomes the tensor's (:data:`HANDOVER_MIN_BYTES`); else in a pooled buffer its tensors are copied out of
    handover: bool = False
    views: dict[int, tuple[torch.Tensor, Any, list[torch.Tensor | None] | None]] = field(default_factory=dict)

    def views_of(self, buf: torch.Tensor) -> tuple[Any, list[torch.Tensor | None] | None]:
        """(the header of ``buf`` as a numpy array, the tensors' views into ``buf`` or None: use :func:`read`)."""
        hit = self.views.get(id(buf))
        if hit is not None and hit[0] is buf:
            return hit[1], hit[2]
        if len(self.views) >= _MAX_VIEWS:
            self.views.clear()
        views: list[torch.Tensor | None] | None = None
        # (a zero-size tensor has no bytes to view: read() allocates it)
        if self.plan.pack is None and all(
            e is None or off is not None for e, off in zip(self.layout, self.plan.offsets, strict=True)
        ):
            views = data_views(buf, self.layout, self.plan)
        header = buf.numpy()[:META_BYTES]
        self.views[id(buf)] = (buf, header, views)
        return header, views


class RepeatRecvOp:
    """One inline receive posted from a :class:`RepeatRecv` entry.

    ``link``: None when :attr:`handle` is a transport handle; else the transport that posted it as a bare
    request (``irecv_raw``), whose ``wait_raw`` waits for it (``Boundary.complete_recv``)."""

    __slots__ = ("entry", "handle", "buf", "link")

    def __init__(self, entry: RepeatRecv, handle: Any, buf: torch.Tensor, link: Any = None) -> None:
        self.entry = entry
        self.handle = handle
        self.buf = buf
        self.link = link

    def tensors(self, memory: LayoutMemory, device: torch.device) -> list[torch.Tensor | None] | None:
        """The message's tensors once :attr:`handle` completed, or None when its header is not the
        remembered one (the caller hands :attr:`buf` to the general protocol)."""
        e, buf = self.entry, self.buf
        out: list[torch.Tensor | None]
        if e.handover:
            if header_bytes(buf) != e.header:
                return None
            out = _handed_over(buf, e.layout, e.plan)  # the tensor keeps the buffer; it never returns to the pool
            self.buf = None  # type: ignore[assignment]  # the tensor is the storage's only holder once read
        else:
            hit = e.views.get(id(buf))  # views_of inline when they are there (once per message)
            header, views = (hit[1], hit[2]) if hit is not None and hit[0] is buf else e.views_of(buf)
            if header.tobytes() != e.header:
                return None
            if views is not None and device.type == "cpu":
                out = []  # a loop, not a comprehension: once per message
                for v in views:
                    out.append(None if v is None else v.clone())
            else:
                out = read(buf, e.codec, e.layout, e.plan, device)
            pool = memory.pool  # copied out: free again (pool.give inline)
            free = pool.free.get(buf.numel())
            if free is not None and len(free) < pool.max_per_size:
                free.append(buf)
            else:
                pool.give(buf)
        for t, g in zip(out, e.grads, strict=True):
            if g and t is not None:
                t.requires_grad_(True)
        return out


def post_repeat(
    memory: LayoutMemory,
    entry: RepeatRecv,
    transport: Transport,
    peer: int,
    tag: int,
    what: str,
    raw: Callable[..., Any] | None = None,
) -> RepeatRecvOp:
    """Post the inline receive of a message expected in ``entry``'s layout; ``raw``: ``transport``'s
    ``irecv_raw`` where it has one (a bare engine request, no handle: the native engine's), tried first."""
    if entry.handover:
        buf = torch.empty(entry.nbytes, dtype=torch.uint8, device="cpu")
    else:
        free = memory.pool.free.get(entry.nbytes)  # pool.take inline (once per receive)
        buf = free.pop() if free else memory.pool.take(entry.nbytes)
    if raw is not None:
        request = raw(buf, peer, tag, what)
        if request is not None:
            return RepeatRecvOp(entry, request, buf, transport)
    return RepeatRecvOp(entry, transport.irecv(buf, peer, tag, what), buf)
