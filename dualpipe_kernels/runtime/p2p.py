"""Stage-boundary messages: shape/dtype metadata ahead of the data, over any Transport.

A boundary message carries the tensors one stage hands to another for one
micro-batch (activations forward, input gradients backward).  The receiver
does not know their shapes in advance, so every message starts with

1. one int64 metadata tensor of ``META_LEN`` entries (fixed size, so it can be
   received before anything is known): ``[MAGIC, n, speculative, (kind, dtype,
   ndim, dims...) * n]``.  ``kind`` is 0 for "no tensor" (a None gradient:
   nothing is sent for it), 1 for a tensor without grad (integer ids, masks),
   2 for a tensor that requires grad on the receiving side;
2. one transfer per tensor of non-zero size, each with its own tag.

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
posted receive is left hanging) and the real tensors to the *fresh* tags,
which the receiver posts once it has read the metadata.  Both ends update
their memory with every message, and every message of a step is received, so
the two memories always agree.  The first step (no memory) is two-phase:
metadata first, data receives posted the moment it arrives (from the
transport's completion callback where it has one, otherwise from
:meth:`BoundaryRecv.progress` between actions).

Devices: every tensor handed to the transport lives on the transport's
device (:func:`wire_device`): the metadata, the placeholders and payloads
that come from elsewhere (e.g. a CPU mask) are staged there first, and
received data is allocated on the receiver's device.  A CUDA transport
rejects host tensors, so nothing may be created on the default device.

Tags: ``TagSpace`` gives every (direction, consumer stage, micro-batch, slot)
its own tag, so transfers between one pair of ranks never mix: slot 0 is the
metadata, slots 1..31 the speculative and 32..62 the fresh tensor transfers.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dualpipe_kernels.transport.base import Handle, Transport, TransportError

__all__ = [
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

META_LEN = 128
MAX_TENSORS = 31  # speculative slots 1..31, fresh slots 32..62; slot 0 is the metadata, 63 is spare
_SLOTS = 64
_SPEC_BASE, _FRESH_BASE = 1, 32
_MAX_ENCODED = 512
_MAGIC = 0x44504B31  # "DPK1"

_KIND_NONE, _KIND_TENSOR, _KIND_GRAD = 0, 1, 2

_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}


@dataclass(frozen=True)
class TensorMeta:
    """What the receiver needs to allocate one tensor (None entries are gradients that were not computed)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


class TagSpace:
    """Tags for one pipeline: ``((direction * stages + stage) * microbatches + mb) * 64 + index``.

    direction 0: activations (keyed by the consuming stage), 1: gradients
    (keyed by the stage whose inputs they are, i.e. the same consumer stage),
    2: end-of-step exchanges (mirror gradients), keyed by the sender's stage.
    """

    DIRECTIONS = 3

    def __init__(self, num_stages: int, num_microbatches: int) -> None:
        self.num_stages = num_stages
        self.num_microbatches = num_microbatches
        top = self.DIRECTIONS * num_stages * max(num_microbatches, 1) * _SLOTS
        if top >= 2**31:
            raise ValueError(
                f"{num_stages} stages x {num_microbatches} micro-batches exceed the 31-bit tag space of the transport"
            )

    def tag(self, direction: int, stage: int, microbatch: int, index: int) -> int:
        return ((direction * self.num_stages + stage) * self.num_microbatches + microbatch) * _SLOTS + index


Layout = tuple[tuple[torch.dtype, tuple[int, ...]] | None, ...]
"""What must match for a speculative receive: per tensor None or (dtype, shape); grad flags may differ."""


def layout_of(metas: Sequence[TensorMeta | None]) -> Layout:
    return tuple(None if m is None else (m.dtype, m.shape) for m in metas)


def _layout_of_tensors(tensors: Sequence[torch.Tensor | None]) -> Layout:
    return tuple(None if t is None else (t.dtype, tuple(t.shape)) for t in tensors)


class LayoutMemory:
    """Per pipeline and per direction of use: message key -> layout of the last message with that key.

    The sender's memory holds what it sent, the receiver's what it received;
    they agree because every message sent in a step is received in that step
    (a failed step breaks the pipeline for good).
    """

    def __init__(self) -> None:
        self.sent: dict[tuple[int, int, int], Layout] = {}
        self.received: dict[tuple[int, int, int], Layout] = {}
        # Encoded metadata tensors by signature: a send only reads its metadata
        # tensor, so messages with the same layout share one (never written after
        # creation).  At most ``_MAX_ENCODED`` entries.
        self.encoded: dict[tuple[object, ...], torch.Tensor] = {}


def wire_device(transport: Transport) -> torch.device:
    """The device of every tensor posted to ``transport``: its ``device``, or CPU.

    CPU when the transport declares no device, or when it moves host memory
    and only stages device tensors through it (``device_native`` False, e.g.
    torch over gloo): its metadata then needs no staging at all, and a data
    callback never reads a metadata buffer whose staging copy has not run.
    """
    dev = getattr(transport, "device", None)
    if dev is None or not getattr(transport, "device_native", True):
        return torch.device("cpu")
    return torch.device(dev)


def encode_meta(
    tensors: Sequence[torch.Tensor | None],
    grad_flags: Sequence[bool],
    speculative: bool = False,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """The metadata tensor (int64, ``META_LEN`` entries, on ``device``) for ``tensors``.

    ``speculative``: the data goes to the speculative tags (the receiver's
    remembered layout matches).
    """
    if len(tensors) > MAX_TENSORS:
        raise ValueError(f"a stage boundary carries at most {MAX_TENSORS} tensors, got {len(tensors)}")
    words = [_MAGIC, len(tensors), int(speculative)]
    for t, g in zip(tensors, grad_flags, strict=False):
        if t is None:
            words.append(_KIND_NONE)
            continue
        if t.dtype not in _DTYPE_CODE:
            raise ValueError(f"dtype {t.dtype} cannot cross a stage boundary (supported: {list(_DTYPE_CODE)})")
        words += [_KIND_GRAD if g else _KIND_TENSOR, _DTYPE_CODE[t.dtype], t.dim(), *t.shape]
    if len(words) > META_LEN:
        raise ValueError(
            f"stage boundary metadata needs {len(words)} words, more than {META_LEN}: too many tensors or dimensions"
        )
    # Built on the host (the words are Python ints), then moved: one small copy per distinct layout (cached).
    return torch.tensor(words + [0] * (META_LEN - len(words)), dtype=torch.int64, device="cpu").to(device)


def _meta_signature(
    tensors: Sequence[torch.Tensor | None], grad_flags: Sequence[bool], speculative: bool
) -> tuple[object, ...]:
    """Everything :func:`encode_meta` reads, as a hashable key (for the metadata cache)."""
    return (
        speculative,
        tuple(
            None if t is None else (t.dtype, tuple(t.shape), bool(g)) for t, g in zip(tensors, grad_flags, strict=False)
        ),
        len(tensors),
    )


def decode_meta(meta: torch.Tensor) -> tuple[list[TensorMeta | None], bool]:
    """``(per-tensor metadata, speculative flag)`` of a metadata tensor (on any device; read after its transfer)."""
    words = meta.tolist()
    if words[0] != _MAGIC:
        raise TransportError(f"corrupt stage boundary metadata (magic {words[0]:#x}): sender and receiver disagree")
    out: list[TensorMeta | None] = []
    pos = 3
    for _ in range(words[1]):
        kind = words[pos]
        if kind == _KIND_NONE:
            out.append(None)
            pos += 1
            continue
        dtype, ndim = _DTYPES[words[pos + 1]], words[pos + 2]
        shape = tuple(words[pos + 3 : pos + 3 + ndim])
        out.append(TensorMeta(shape, dtype, kind == _KIND_GRAD))
        pos += 3 + ndim
    return out, bool(words[2])


class BoundarySend:
    """One boundary message in flight to ``peer``.  Owns (keeps alive) the tensors until completion.

    ``memory``: the sender's layout memory (see the module docstring); None
    disables speculation for this message (the receiver must pass None too).
    Every tensor posted is on the transport's device (:func:`wire_device`);
    payloads elsewhere are copied there first.
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
    ) -> None:
        direction, stage, mb = key
        self.what = what
        wire = wire_device(transport)
        layout = _layout_of_tensors(tensors)
        guess = memory.sent.get(key) if memory is not None else None
        hit = guess is not None and guess == layout
        if memory is not None:
            memory.sent[key] = layout
        if memory is not None:
            sig = _meta_signature(tensors, grad_flags, hit)
            meta = memory.encoded.get(sig)
            if meta is None:
                if len(memory.encoded) >= _MAX_ENCODED:
                    memory.encoded.clear()  # shapes that change every step: keep the cache small
                meta = memory.encoded[sig] = encode_meta(tensors, grad_flags, speculative=hit, device=wire)
        else:
            meta = encode_meta(tensors, grad_flags, speculative=hit, device=wire)
        self._meta = meta
        self._payload: list[torch.Tensor | None] = [
            None if t is None else t.detach().to(wire).contiguous() for t in tensors
        ]
        self._handles: list[Handle] = [transport.isend(self._meta, peer, tags.tag(direction, stage, mb, 0), what)]
        if guess is not None and not hit:
            # The receiver posted receives of the remembered layout: satisfy them with placeholders.
            for i, g in enumerate(guess):
                if g is not None and math.prod(g[1]) > 0:
                    dummy = torch.zeros(g[1], dtype=g[0], device=wire)
                    self._payload.append(dummy)
                    tag = tags.tag(direction, stage, mb, _SPEC_BASE + i)
                    self._handles.append(transport.isend(dummy, peer, tag, f"{what} placeholder {i}"))
        base = _SPEC_BASE if hit else _FRESH_BASE
        for i, t in enumerate(self._payload[: len(tensors)]):
            if t is not None and t.numel() > 0:
                tag = tags.tag(direction, stage, mb, base + i)
                self._handles.append(transport.isend(t, peer, tag, f"{what} tensor {i}"))

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
    (the transport's device; the metadata buffer is always there).
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
    ) -> None:
        self.what = what
        self._transport = transport
        self._peer = peer
        self._tags = tags
        self._key = key
        self._device = device
        self._memory = memory
        self._meta_buf = torch.empty(META_LEN, dtype=torch.int64, device=wire_device(transport))
        self._metas: list[TensorMeta | None] | None = None
        self._tensors: list[torch.Tensor | None] = []
        self._handles: list[Handle] = []
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._meta_handle = transport.irecv(self._meta_buf, peer, tags.tag(key[0], key[1], key[2], 0), what)
        self._guess = memory.received.get(key) if memory is not None else None
        self._spec: list[torch.Tensor | None] = []
        self._spec_handles: list[Handle] = []
        if self._guess is not None:
            direction, stage, mb = key
            for i, g in enumerate(self._guess):
                if g is None:
                    self._spec.append(None)
                    continue
                t = torch.empty(g[1], dtype=g[0], device=device)
                self._spec.append(t)
                if t.numel() > 0:
                    tag = tags.tag(direction, stage, mb, _SPEC_BASE + i)
                    self._spec_handles.append(transport.irecv(t, peer, tag, f"{what} tensor {i}"))
            return  # the data is already on its way: no need to watch the metadata
        # Transports that can call back on completion (TorchDist over gloo) post
        # the data receives from their waiter thread the moment the metadata is
        # in; the others rely on progress() between actions.
        add_callback = getattr(self._meta_handle, "add_done_callback", None)
        if add_callback is not None:
            add_callback(self._on_meta)

    def _on_meta(self, error: BaseException | None) -> None:
        if error is not None:
            return  # the owner's wait reports it, with its own timeout
        try:
            self._post_data()
        except BaseException as exc:  # noqa: BLE001 - re-raised by wait() on the owner's thread
            self._error = exc

    def _post_data(self) -> None:
        with self._lock:
            if self._metas is not None:
                return
            if self._meta_buf.is_cuda:
                # Reading it on the host goes through the current stream: order it after the transfer's copy.
                self._meta_handle.wait_stream(torch.cuda.current_stream(self._meta_buf.device))
            metas, speculative = decode_meta(self._meta_buf)
            if speculative != (self._guess is not None and self._guess == layout_of(metas)):
                raise TransportError(
                    f"{self.what}: sender and receiver disagree on the remembered layout of this message "
                    "(a previous step did not complete on both sides?)"
                )
            if self._memory is not None:
                self._memory.received[self._key] = layout_of(metas)
            if speculative:
                self._tensors = self._spec
                self._handles = self._spec_handles
            else:
                direction, stage, mb = self._key
                for i, m in enumerate(metas):
                    if m is None:
                        self._tensors.append(None)
                        continue
                    t = torch.empty(m.shape, dtype=m.dtype, device=self._device)
                    self._tensors.append(t)
                    if t.numel() > 0:
                        tag = self._tags.tag(direction, stage, mb, _FRESH_BASE + i)
                        self._handles.append(self._transport.irecv(t, self._peer, tag, f"{self.what} tensor {i}"))
                # Placeholders into the speculative buffers: waited for, then dropped.
                self._handles += self._spec_handles
            self._spec, self._spec_handles = [], []
            self._metas = metas

    def progress(self) -> None:
        """Post the data receives if the metadata has arrived (non-blocking; nothing to do when speculative)."""
        if self._metas is None and self._guess is None and self._meta_handle.is_completed():
            self._meta_handle.wait(0.001)
            self._post_data()

    def wait(self, timeout_s: float, stream: torch.cuda.Stream | None = None) -> list[torch.Tensor | None]:
        """Block (at most ``timeout_s`` in all) until every tensor has arrived; return them.

        Tensors whose metadata says "requires grad" come back as leaves with
        ``requires_grad=True`` (set only after the transfer: the transport writes
        into them outside autograd).
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
        out = self._tensors
        for t, m in zip(out, self._metas, strict=False):
            if t is not None and m is not None and m.requires_grad:
                t.requires_grad_(True)
        self._tensors, self._handles = [], []
        return out
