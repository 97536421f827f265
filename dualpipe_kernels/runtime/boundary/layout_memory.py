"""What one pipeline remembers between messages, and which channels its messages take.

:class:`LayoutMemory`: per message key, the layout of the last message with
that key (both ends keep one, in agreement: see transfer.py), and the caches
that make a repeated message cheap.  :class:`Channels`: the transports one
pipeline's messages travel on, worked out once from its transport:

* ``wire``: the data, matched by tag (gloo, the native engine, CUDA IPC);
* ``ordered``: where the transport pairs transfers in posting order (NCCL, or gloo with ``ordered=True``),
  the pipeline's in-order channel (``Transport.in_order``), which carries, in the order the program gives
  both ends, the data of every message whose layout both ends remember;
* ``host``: a tag-matched channel of host memory (the wire itself on a tag-matched host wire, else the
  transport's ``host_channel``), which carries the headers where the wire is a device's or ordered, and,
  where the wire is ordered, the data of a message whose layout the receiver did not know.

This module knows the layers below it (header, codec, inline, pool, the
transport) and nothing above: the repeat caches hold whatever repeat.py
puts there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dualpipe_kernels.runtime.boundary.codec import BoundaryFormat, MessageCodec
from dualpipe_kernels.runtime.boundary.header import Layout, wire_device
from dualpipe_kernels.runtime.boundary.inline import InlinePlan, inline_plan
from dualpipe_kernels.runtime.boundary.pool import BufferPool
from dualpipe_kernels.transport.base import Transport

__all__ = ["Channels", "LayoutMemory", "MessageKey"]

MessageKey = tuple[int, int, int]
"""(direction, stage, micro-batch): one message of a step."""


@dataclass(frozen=True)
class Channels:
    """The transports one pipeline's messages travel on (see the module docstring).

    ``host_wire``: the wire's buffers are host memory (a header may travel inside a data buffer and be read
    on the host; small messages travel inline); ``device``: where wire tensors are made.
    """

    wire: Transport
    host: Transport
    ordered: Transport | None
    host_wire: bool
    device: torch.device

    @property
    def data(self) -> Transport:
        """Where the data of a message of a remembered layout goes: the in-order channel, or the wire."""
        return self.ordered if self.ordered is not None else self.wire

    @property
    def fresh(self) -> Transport:
        """Where the data of a message of a layout the receiver did not know goes (it posts that receive only
        once its header has arrived, so it cannot take its place in an in-order channel): the wire when it
        matches tags, else the host channel."""
        return self.wire if self.ordered is None else self.host

    @staticmethod
    def of(transport: Transport, channel: int = 0) -> Channels:
        """The channels of a pipeline numbered ``channel`` on its group (see TagSpace) over ``transport``."""
        host_wire = transport.host_wire
        ordered = None if transport.matches_tags else transport.in_order(channel)
        host = transport if host_wire and ordered is None else transport.host_channel()
        return Channels(transport, host, ordered, host_wire, wire_device(transport))


class LayoutMemory:
    """Per pipeline and per direction of use: message key -> layout of the last message with that key.

    The sender's memory holds what it sent, the receiver's what it received;
    they agree because every message sent in a step is received in that step
    (a failed step breaks the pipeline for good).  ``channel``: the pipeline's
    number on its group (its in-order channel, where the transport has them).
    """

    #: at most this many cached metadata tensors (and inline plans)
    MAX_ENCODED = 512

    def __init__(self, inline_max_bytes: int = 0, channel: int = 0) -> None:
        self.sent: dict[MessageKey, Layout] = {}
        self.received: dict[MessageKey, Layout] = {}
        # Encoded metadata tensors by signature: a send only reads its metadata
        # tensor, so messages with the same layout share one (never written after
        # creation).  At most ``MAX_ENCODED`` entries.
        self.encoded: dict[tuple[object, ...], torch.Tensor] = {}
        #: remembered layouts whose data is at most this many bytes travel as one transfer
        #: (runtime/boundary/inline.py; 0: never).  Both ends of a message must use the same value.
        self.inline_max_bytes = inline_max_bytes
        self.channel = channel
        self.pool = BufferPool()  # inline receive buffers
        self.inline_plans: dict[tuple[object, ...], InlinePlan] = {}  # (format code, direction, layout) -> plan
        self.codecs: dict[tuple[str, int], MessageCodec] = {}  # (format, direction) -> codec
        # Repeats (repeat.py's entries): per message key, what the last inline message with the remembered
        # layout looked like, so the next one with the same layout skips the protocol's bookkeeping.
        # Dropped whenever a message of that key takes the general path.
        self.repeat_send: dict[MessageKey, Any] = {}
        self.repeat_recv: dict[MessageKey, Any] = {}
        #: the receive entries' views into pooled buffers, per (layout, inline plan): shared by every key of that
        #: layout, since the pool hands a key a different one of the same few buffers from step to step
        self.repeat_views: dict[tuple[Any, ...], dict[int, Any]] = {}
        self._channels: Channels | None = None

    def channels(self, transport: Transport) -> Channels:
        """:meth:`Channels.of` ``transport``, worked out once (a pipeline has one transport)."""
        ch = self._channels
        if ch is None or ch.wire is not transport:
            ch = self._channels = Channels.of(transport, self.channel)
        return ch

    def wire_device(self, transport: Transport) -> torch.device:
        """Where the tensors posted to ``transport`` live (:func:`~.header.wire_device`)."""
        return self.channels(transport).device

    def codec(self, fmt: BoundaryFormat | str, direction: int) -> MessageCodec:
        """The (stateless, shared) codec of messages of ``fmt`` in ``direction``."""
        name = fmt.for_direction(direction) if isinstance(fmt, BoundaryFormat) else fmt
        codec = self.codecs.get((name, direction))
        if codec is None:
            codec = self.codecs[(name, direction)] = MessageCodec(name, direction)
        return codec

    def inline(self, codec: MessageCodec, layout: Layout | None) -> InlinePlan | None:
        """The inline plan of a message of remembered ``layout``, or None when it does not travel inline."""
        if layout is None or self.inline_max_bytes <= 0:
            return None
        key = (codec.code, codec.direction, layout)
        plan = self.inline_plans.get(key)
        if plan is None:
            if len(self.inline_plans) >= self.MAX_ENCODED:
                self.inline_plans.clear()
            plan = self.inline_plans[key] = inline_plan(codec, layout)
        return plan if plan.nbytes <= self.inline_max_bytes else None

    def clear(self) -> None:
        """Forget everything (the pipeline is closed): layouts, caches, pooled buffers."""
        self.sent.clear()
        self.received.clear()
        self.encoded.clear()
        self.inline_plans.clear()
        self.repeat_send.clear()
        self.repeat_recv.clear()
        self.repeat_views.clear()
        self.pool.clear()
