"""Stage-boundary messages: metadata ahead of the data, over any Transport.

A boundary message carries the tensors one stage hands to another for one
micro-batch (activations forward, input gradients backward).  The receiver
does not know their shapes in advance, so every message is

1. one fixed-size int64 metadata tensor (shapes, dtypes, grad flags, the
   boundary format: header.py);
2. its data: one transfer per tensor of non-zero size (format ``none``), or
   one packed uint8 buffer (``packed``, ``bf16``, ``fp8``: codec.py,
   sent with :meth:`Transport.isend_packed`).

Speculative receives (why: latency).  Over gloo a transfer only moves once its
receive is posted (the receiver notifies the sender), so a receive posted
after the metadata arrived costs three one-way hops instead of one.  Both
ends therefore remember, per message key, the layout of the *previous*
message with that key (the same boundary and micro-batch one step earlier: a
training loop repeats its shapes).  When there is one, the receiver allocates
buffers of that layout and posts their receives together with the metadata
receive, long before the data is sent.  The sender sends to those
*speculative* tags when the layout is unchanged (flag 1 in the metadata),
else it sends zero-filled placeholders of the remembered layout there (so no
posted receive is left hanging) and the real data to the *fresh* tags,
which the receiver posts once it has read the metadata.  Both ends update
their memory with every message, and every message of a step is received, so
the two memories always agree.  The first step (no memory) is two-phase:
metadata first, data receives posted the moment it arrives (from the
transport's completion callback where it has one, otherwise from
:meth:`BoundaryRecv.progress` between actions).

Small messages (runtime/boundary/inline.py): when the remembered layout's data is at
most the pipeline's inline limit (``INLINE_MAX_BYTES``, or more where the
transport takes larger whole messages: ``inline_limit``) and the transport
moves host memory, the receiver
posts one buffer for metadata and data together and the sender fills it: one
transfer per boundary instead of two or more (a changed layout: metadata and
zeros in that buffer, the data to the fresh tags).

Repeats (runtime/boundary/repeat.py): once a small message has travelled inline in
the remembered layout, both ends keep what it looked like, per message key.
The next message of that key with the same signature is built and posted by
``Boundary`` without this module's bookkeeping, and the receiver reads it
without decoding its metadata when the header bytes are the same; anything
else falls back to the protocol above (the receiver hands it the buffer that
arrived).  The bytes on the wire are the same.

Devices: the header is host memory on every wire, built and read on the
host.  On a host wire it travels on the wire (alone, or at the head of an
inline message); on a device wire (CUDA IPC, NCCL: ``Transport.host_wire``
False) on the transport's host channel, so reading it never waits for the
device, and nothing posted to or received from the wire is read on the host
(tests/process/test_wire_host_read.py).  Every data tensor handed to the wire
lives on its device (:func:`wire_device`): placeholders and payloads that
come from elsewhere are staged there first, and received data is allocated
on the receiver's device.  A CUDA transport rejects host tensors, so nothing
may be created on the default device.

In-order wires (NCCL, or gloo with ``ordered=True``: ``Transport.matches_tags``
False): the speculative slots (data of a layout both ends remember, placeholders,
inline messages) go over the pipeline's in-order channel, which both ends post
in the order of the program (exchange.py); the header and the fresh data (a
layout the receiver did not know, posted once its header is in) over the
tag-matched host channel (layout_memory.py ``Channels``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch

from dualpipe_kernels.runtime.boundary.codec import BOUNDARY_FORMATS, BoundaryFormat, MessageCodec
from dualpipe_kernels.runtime.boundary.header import (
    FRESH_BASE,
    MAX_TENSORS,
    META_LEN,
    SPEC_BASE,
    Layout,
    TagSpace,
    TensorMeta,
    decode_meta,
    encode_meta,
    meta_signature,
    wire_device,
)
from dualpipe_kernels.runtime.boundary.inline import META_BYTES, build, read
from dualpipe_kernels.runtime.boundary.layout_memory import Channels, LayoutMemory
from dualpipe_kernels.runtime.boundary.repeat import RepeatRecv, RepeatSend, handover, header_bytes, signature
from dualpipe_kernels.transport.base import Handle, Transport, TransportError

_HOST = torch.device("cpu")


def _codec(memory: LayoutMemory | None, fmt: BoundaryFormat | str, direction: int) -> MessageCodec:
    if memory is not None:
        return memory.codec(fmt, direction)
    return MessageCodec(fmt.for_direction(direction) if isinstance(fmt, BoundaryFormat) else fmt, direction)


def _channels(memory: LayoutMemory | None, transport: Transport) -> Channels:
    return memory.channels(transport) if memory is not None else Channels.of(transport)


__all__ = [
    "Channels",
    "META_LEN",
    "MAX_TENSORS",
    "TagSpace",
    "encode_meta",
    "decode_meta",
    "BoundarySend",
    "BoundaryRecv",
    "TensorMeta",
    "LayoutMemory",
    "wire_device",
]


def _metadata(
    memory: LayoutMemory | None,
    tensors: Sequence[torch.Tensor | None],
    grad_flags: Sequence[bool],
    hit: bool,
    code: int,
    wire: torch.device,
) -> torch.Tensor:
    """The message's metadata tensor (host memory), from the memory's cache when it has one."""
    if memory is None:
        return encode_meta(tensors, grad_flags, hit, wire, code)
    sig = meta_signature(tensors, grad_flags, hit, code)
    meta = memory.encoded.get(sig)
    if meta is None:
        if len(memory.encoded) >= memory.MAX_ENCODED:
            memory.encoded.clear()  # shapes that change every step: keep the cache small
        meta = memory.encoded[sig] = encode_meta(tensors, grad_flags, hit, wire, code)
    return meta


class BoundarySend:
    """One boundary message in flight to ``peer``.  Owns (keeps alive) what it sends until completion.

    ``memory``: the sender's layout memory (see the module docstring); None
    disables speculation for this message (the receiver must pass None too).
    ``fmt``: the boundary format (codec.py; the receiver must use the
    same).  Every tensor posted is on the transport's device
    (:func:`wire_device`); payloads elsewhere are copied there first.
    ``data_bytes``: the bytes of the message's data transfers (without the
    metadata and placeholders).
    """

    def __init__(
        self,
        transport: Transport,
        tensors: Sequence[torch.Tensor | None],
        grad_flags: Sequence[bool],
        peer: int,
        tags: TagSpace,
        key: tuple[int, int, int],
        what: str,
        memory: LayoutMemory | None = None,
        fmt: BoundaryFormat | str = "none",
    ) -> None:
        direction, stage, mb = key
        self.what = what
        codec = _codec(memory, fmt, direction)
        ch = _channels(memory, transport)
        wire = ch.device
        layout = codec.layout(tensors, grad_flags)
        guess = memory.sent.get(key) if memory is not None else None
        hit = guess is not None and guess == layout
        if memory is not None:
            memory.sent[key] = layout
            memory.repeat_send.pop(key, None)  # remade below when this message repeats (repeat.py)
        meta = _metadata(memory, tensors, grad_flags, hit, codec.code, _HOST)
        self.data_bytes = 0
        #: the whole message is one small copy (inline): nothing the caller owns is held until completion
        self.small = False
        inline = memory.inline(codec, guess) if memory is not None and ch.host_wire else None
        if inline is not None:
            # The receiver posted one buffer for metadata and data (inline.py): fill it.
            buf = build(meta, tensors, codec, layout if hit else None, inline)
            self._payload: list[torch.Tensor] = [buf]
            self._handles: list[Handle] = [ch.data.isend(buf, peer, tags.tag(direction, stage, mb, 0), what)]
            if hit:
                self.data_bytes = inline.nbytes
                self.small = True
                assert memory is not None
                memory.repeat_send[key] = RepeatSend(signature(tensors, grad_flags), meta, codec, layout, inline)
                return
        else:
            # The header: host bytes, over the host channel (the wire itself on a tag-matched host wire).
            self._payload = [meta]
            self._handles = [ch.host.isend(meta, peer, tags.tag(direction, stage, mb, 0), what)]
            if guess is not None and not hit:
                # The receiver posted receives of the remembered layout: satisfy them with placeholders.
                for slot, dtype, shape in codec.wire_specs(guess):
                    dummy = torch.zeros(shape, dtype=dtype, device=wire)
                    self._payload.append(dummy)
                    tag = tags.tag(direction, stage, mb, SPEC_BASE + slot)
                    self._handles.append(ch.data.isend(dummy, peer, tag, f"{what} placeholder {slot}"))
        base = SPEC_BASE if hit else FRESH_BASE
        out = ch.data if hit else ch.fresh
        if codec.packed:
            self._send_packed(codec, out, tensors, layout, wire, peer, tags.tag(direction, stage, mb, base))
            return
        for i, t in enumerate(tensors):
            if t is not None and t.numel() > 0:
                t = t.detach().to(wire).contiguous()
                self._payload.append(t)
                self.data_bytes += t.numel() * t.element_size()
                tag = tags.tag(direction, stage, mb, base + i)
                self._handles.append(out.isend(t, peer, tag, f"{what} tensor {i}"))

    def _send_packed(
        self,
        codec: MessageCodec,
        transport: Transport,
        tensors: Sequence[torch.Tensor | None],
        layout: Layout,
        wire: torch.device,
        peer: int,
        tag: int,
    ) -> None:
        plan = codec.pack_layout(layout)
        if plan is None or plan.nbytes == 0:
            return
        # Pack where the data is (a device-staging transport then moves one buffer), except
        # on a device-native transport, whose buffers must be on its device.
        first = next(t for t in tensors if t is not None)
        device = wire if wire.type != "cpu" else first.device
        inputs = codec.pack_inputs(tensors, layout, device)
        self.data_bytes = plan.nbytes
        self._handles.append(transport.isend_packed(inputs, plan, peer, tag, f"{self.what} packed ({codec.format})"))

    def is_completed(self) -> bool:
        return all(h.is_completed() for h in self._handles)

    def wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for h in self._handles:
            h.wait(max(0.001, deadline - time.monotonic()))
        # Drop every reference to the sent tensors (the transport's work objects hold them too).
        self._payload, self._handles = [], []


class BoundaryRecv:
    """One boundary message being received from ``peer`` into tensors allocated from its metadata.

    ``memory``: the receiver's layout memory; with a remembered layout for
    ``key`` the data receives are posted at once (speculatively), see the
    module docstring.  ``device``: where the received tensors are allocated
    (the transport's device; the metadata buffer is always there).  ``fmt``:
    the boundary format this rank expects (a sender using another one is an error).
    """

    def __init__(
        self,
        transport: Transport,
        peer: int,
        tags: TagSpace,
        key: tuple[int, int, int],
        what: str,
        device: torch.device,
        memory: LayoutMemory | None = None,
        fmt: BoundaryFormat | str = "none",
        posted: tuple[Handle, torch.Tensor] | None = None,
    ) -> None:
        self.what = what
        self._transport = transport
        ch = self._channels = _channels(memory, transport)
        self._peer = peer
        self._tags = tags
        self._key = key
        self._device = device
        self._memory = memory
        self._codec = _codec(memory, fmt, key[0])
        self._metas: list[TensorMeta | None] | None = None
        self._layout: Layout = ()
        self._tensors: list[torch.Tensor | None] = []
        self._buffers: list[tuple[int, torch.Tensor]] = []
        self._handles: list[Handle] = []
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._guess = memory.received.get(key) if memory is not None else None
        self._spec: tuple[list[torch.Tensor | None], list[tuple[int, torch.Tensor]]] = ([], [])
        self._spec_handles: list[Handle] = []
        #: the data receives wait for the metadata and for :meth:`progress` calls to post them
        self.needs_progress = False
        meta_tag = tags.tag(key[0], key[1], key[2], 0)
        self._inline = memory.inline(self._codec, self._guess) if memory is not None and ch.host_wire else None
        if self._inline is not None:
            # One transfer brings the metadata and the data of the remembered layout (inline.py).
            assert memory is not None
            if posted is not None:
                # Already posted (repeat.py), and its header was not the remembered one: read it here.
                self._meta_handle, buf = posted
                assert buf.numel() == META_BYTES + self._inline.nbytes
            else:
                buf = memory.pool.take(META_BYTES + self._inline.nbytes)
                self._meta_handle = ch.data.irecv(buf, peer, meta_tag, what)
            self._inline_buf: torch.Tensor | None = buf
            self._meta_buf = buf[:META_BYTES].view(torch.int64)
            return
        if posted is not None:
            raise AssertionError(f"{what}: a posted inline buffer, but this message's layout does not travel inline")
        self._inline_buf = None
        # The header: host bytes, over the host channel (never a device tensor: it is read on the host).
        self._meta_buf = torch.empty(META_LEN, dtype=torch.int64, device=_HOST)
        self._meta_handle = ch.host.irecv(self._meta_buf, peer, meta_tag, what)
        if self._guess is not None:
            self._spec = self._codec.alloc(self._guess, device)
            self._spec_handles = self._post(self._spec[1], SPEC_BASE)
            return  # the data is already on its way: no need to watch the metadata
        # Transports that can call back on completion (TorchDist over gloo) post
        # the data receives from their waiter thread the moment the metadata is
        # in; the others rely on progress() between actions.
        add_callback = getattr(self._meta_handle, "add_done_callback", None)
        if add_callback is not None:
            add_callback(self._on_meta)
        else:
            self.needs_progress = True

    def _post(self, buffers: Sequence[tuple[int, torch.Tensor]], base: int) -> list[Handle]:
        direction, stage, mb = self._key
        to = self._channels.data if base == SPEC_BASE else self._channels.fresh
        return [
            to.irecv(buf, self._peer, self._tags.tag(direction, stage, mb, base + slot), f"{self.what} data {slot}")
            for slot, buf in buffers
        ]

    def _on_meta(self, error: BaseException | None) -> None:
        if error is not None:
            return  # the owner's wait reports it, with its own timeout
        try:
            self._post_data()
        except BaseException as exc:  # noqa: BLE001 - re-raised by wait() on the owner's thread
            self._error = exc

    def _read_meta(self) -> tuple[list[TensorMeta | None], bool]:
        metas, speculative, code = decode_meta(self._meta_buf)
        if code != self._codec.code:
            theirs = BOUNDARY_FORMATS[code] if 0 <= code < len(BOUNDARY_FORMATS) else f"code {code}"
            raise TransportError(
                f"{self.what}: the sender uses boundary format {theirs!r}, this rank {self._codec.format!r}; "
                "every rank must pass the same boundary_format"
            )
        return metas, speculative

    def _post_data(self) -> None:
        with self._lock:
            if self._metas is not None:
                return
            metas, speculative = self._read_meta()
            layout = self._codec.layout_of(metas)
            if self._memory is not None:
                self._memory.repeat_recv.pop(self._key, None)  # remade when this message repeats (repeat.py)
            if speculative != (self._guess is not None and self._guess == layout):
                raise TransportError(
                    f"{self.what}: sender and receiver disagree on the remembered layout of this message "
                    "(a previous step did not complete on both sides?)"
                )
            if self._memory is not None:
                self._memory.received[self._key] = layout
            if self._inline_buf is not None:
                self._finish_inline(layout, speculative, metas)
            elif speculative:
                (self._tensors, self._buffers), self._handles = self._spec, self._spec_handles
            else:
                self._tensors, self._buffers = self._codec.alloc(layout, self._device)
                # Placeholders into the speculative buffers: waited for, then dropped.
                self._handles = self._post(self._buffers, FRESH_BASE) + self._spec_handles
            self._spec, self._spec_handles = ([], []), []
            self._layout = layout
            self._metas = metas

    def _finish_inline(self, layout: Layout, speculative: bool, metas: Sequence[TensorMeta | None]) -> None:
        """The inline buffer has arrived: its data (when the layout held), else post the fresh receives."""
        buf, self._inline_buf = self._inline_buf, None
        assert buf is not None and self._inline is not None and self._memory is not None
        if speculative:
            self._tensors = read(buf, self._codec, layout, self._inline, self._device)
            self._buffers, self._handles = [], []
            grads = tuple(m is not None and m.requires_grad for m in metas)
            self._memory.repeat_recv[self._key] = RepeatRecv(
                header_bytes(buf), buf.numel(), self._codec, layout, self._inline, grads,
                handover=handover(layout, self._inline, self._device),
                views=self._memory.repeat_views.setdefault((layout, self._inline), {}),
            )  # fmt: skip
        else:
            self._tensors, self._buffers = self._codec.alloc(layout, self._device)
            self._handles = self._post(self._buffers, FRESH_BASE)
        self._memory.pool.give(buf)  # read (copied out) or never to be read: free again

    def progress(self) -> bool:
        """Post the data receives if the metadata has arrived (non-blocking); True once nothing is left to do."""
        if self._metas is not None or self._guess is not None:
            return True
        if not self._meta_handle.is_completed():
            return False
        self._meta_handle.wait(0.001)
        self._post_data()
        return True

    def wait(self, timeout_s: float, stream: torch.cuda.Stream | None = None) -> list[torch.Tensor | None]:
        """Block (at most ``timeout_s`` in all) until every tensor has arrived; return them.

        Tensors whose metadata says "requires grad" come back as leaves with
        ``requires_grad=True`` (set only after the transfer: the transport writes
        into them outside autograd).  A packed message is unpacked here (on
        ``stream``'s device: after the transfer in stream order).
        """
        deadline = time.monotonic() + timeout_s
        if self._metas is None:
            self._meta_handle.wait(timeout_s)
            self._post_data()
        if self._error is not None:
            raise self._error
        for h in self._handles:
            if self._device.type == "cuda":
                h.wait_stream(stream)
            else:
                h.wait(max(0.001, deadline - time.monotonic()))
        assert self._metas is not None
        out = self._codec.finish(self._tensors, self._buffers, self._layout)
        for t, m in zip(out, self._metas, strict=False):
            if t is not None and m is not None and m.requires_grad:
                t.requires_grad_(True)
        self._tensors, self._buffers, self._handles = [], [], []
        return out
