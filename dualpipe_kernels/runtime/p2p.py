"""Stage-boundary messages: shape/dtype metadata ahead of the data, over any Transport.

A boundary message carries the tensors one stage hands to another for one
micro-batch (activations forward, input gradients backward).  The receiver
does not know their shapes in advance, so every message is two-phase:

1. one int64 metadata tensor of ``META_LEN`` entries (fixed size, so it can be
   received before anything is known): ``[MAGIC, n, (kind, dtype, ndim,
   dims...) * n]``.  ``kind`` is 0 for "no tensor" (a None gradient: nothing is
   sent for it), 1 for a tensor without grad (integer ids, masks), 2 for a
   tensor that requires grad on the receiving side;
2. one transfer per tensor of non-zero size, each with its own tag.

The receiver posts the metadata receive early (as soon as the executor looks
ahead to it) and posts the data receives the moment the metadata has arrived
(from the transport's completion callback where it has one, otherwise from
:meth:`BoundaryRecv.progress` between actions), so data receives are in flight
before the compute that needs them.  Sends are posted by the executor and waited lazily.

Tags: ``TagSpace`` gives every (direction, consumer stage, micro-batch, tensor
index) its own tag, so transfers between one pair of ranks never mix.
"""

from __future__ import annotations

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
]

META_LEN = 128
MAX_TENSORS = 62  # tensor indices 1..62; index 0 is the metadata, 63 is spare
_SLOTS = 64
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


def encode_meta(tensors: Sequence[torch.Tensor | None], grad_flags: Sequence[bool]) -> torch.Tensor:
    """The metadata tensor (int64, ``META_LEN`` entries, CPU) for ``tensors``."""
    if len(tensors) > MAX_TENSORS:
        raise ValueError(f"a stage boundary carries at most {MAX_TENSORS} tensors, got {len(tensors)}")
    words = [_MAGIC, len(tensors)]
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
    meta = torch.zeros(META_LEN, dtype=torch.int64)
    meta[: len(words)] = torch.tensor(words, dtype=torch.int64)
    return meta


def decode_meta(meta: torch.Tensor) -> list[TensorMeta | None]:
    words = meta.tolist()
    if words[0] != _MAGIC:
        raise TransportError(f"corrupt stage boundary metadata (magic {words[0]:#x}): sender and receiver disagree")
    out: list[TensorMeta | None] = []
    pos = 2
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
    return out


class BoundarySend:
    """One boundary message in flight to ``peer``.  Owns (keeps alive) the tensors until completion."""

    def __init__(
        self,
        transport: Transport,
        tensors: Sequence[torch.Tensor | None],
        grad_flags: Sequence[bool],
        peer: int,
        tags: TagSpace,
        key: tuple[int, int, int],
        what: str,
    ) -> None:
        direction, stage, mb = key
        self.what = what
        self._meta = encode_meta(tensors, grad_flags)
        self._payload = [None if t is None else t.detach().contiguous() for t in tensors]
        self._handles: list[Handle] = [transport.isend(self._meta, peer, tags.tag(direction, stage, mb, 0), what)]
        for i, t in enumerate(self._payload):
            if t is not None and t.numel() > 0:
                tag = tags.tag(direction, stage, mb, i + 1)
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
    """One boundary message being received from ``peer`` into tensors allocated from its metadata."""

    def __init__(
        self,
        transport: Transport,
        peer: int,
        tags: TagSpace,
        key: tuple[int, int, int],
        what: str,
        device: torch.device,
    ) -> None:
        self.what = what
        self._transport = transport
        self._peer = peer
        self._tags = tags
        self._key = key
        self._device = device
        self._meta_buf = torch.empty(META_LEN, dtype=torch.int64)
        self._metas: list[TensorMeta | None] | None = None
        self._tensors: list[torch.Tensor | None] = []
        self._handles: list[Handle] = []
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._meta_handle = transport.irecv(self._meta_buf, peer, tags.tag(key[0], key[1], key[2], 0), what)
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
            metas = decode_meta(self._meta_buf)
            direction, stage, mb = self._key
            for i, m in enumerate(metas):
                if m is None:
                    self._tensors.append(None)
                    continue
                t = torch.empty(m.shape, dtype=m.dtype, device=self._device)
                self._tensors.append(t)
                if t.numel() > 0:
                    tag = self._tags.tag(direction, stage, mb, i + 1)
                    self._handles.append(self._transport.irecv(t, self._peer, tag, f"{self.what} tensor {i}"))
            self._metas = metas

    def progress(self) -> None:
        """Post the data receives if the metadata has arrived (non-blocking)."""
        if self._metas is None and self._meta_handle.is_completed():
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
