"""Stage-boundary metadata: the fixed-size int64 header sent ahead of a message's data, and tags.

The receiver of a boundary message does not know its shapes in advance, so
every message starts with one int64 tensor of ``META_LEN`` entries (fixed
size, so it can be received before anything is known)::

    [MAGIC, n, speculative, format, (kind, dtype, ndim, dims...) * n]

``kind`` is 0 for "no tensor" (a None gradient: nothing is sent for it), 1
for a tensor without grad (integer ids, masks), 2 for a tensor that requires
grad on the receiving side; ``format`` is the boundary format's code
(:data:`~dualpipe_kernels.runtime.boundary.codec.BOUNDARY_FORMATS`), checked
against the receiver's own.

Tags: :class:`TagSpace` gives every (direction, consumer stage, micro-batch,
slot) its own tag, so transfers between one pair of ranks never mix: slot 0 is
the metadata, slots 1..31 the speculative and 32..62 the fresh data transfers;
each pipeline on a process group has its own block of tags (``channel``), so
the messages of two pipelines never match.

The header is host memory on every wire: it is built and read on the host,
and travels over the transport's host channel where the wire is a device's
(layout_memory.py ``Channels``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dualpipe_kernels.transport.base import Transport, TransportError
from dualpipe_kernels.wire_dtypes import WIRE_DTYPE_CODE, WIRE_DTYPES

__all__ = [
    "META_LEN",
    "MAX_TENSORS",
    "SPEC_BASE",
    "FRESH_BASE",
    "TagSpace",
    "TensorMeta",
    "Layout",
    "encode_meta",
    "decode_meta",
    "meta_signature",
    "wire_device",
]

META_LEN = 128
MAX_TENSORS = 31  # speculative slots 1..31, fresh slots 32..62; slot 0 is the metadata, 63 is spare
_SLOTS = 64
SPEC_BASE, FRESH_BASE = 1, 32
_MAGIC = 0x44504B31  # "DPK1"

_KIND_NONE, _KIND_TENSOR, _KIND_GRAD = 0, 1, 2
_SHORT = 24  # words decode_meta reads first (enough for a few tensors of a few dimensions)

_DTYPES = WIRE_DTYPES
_DTYPE_CODE = WIRE_DTYPE_CODE


@dataclass(frozen=True)
class TensorMeta:
    """What the receiver needs to allocate one tensor (None entries are gradients that were not computed)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


class TagSpace:
    """Tags for one pipeline: ``base + ((direction * stages + stage) * microbatches + mb) * 64 + index``.

    direction 0: activations (keyed by the consuming stage), 1: gradients
    (keyed by the stage whose inputs they are, i.e. the same consumer stage),
    2: end-of-step exchanges (mirror gradients), keyed by the sender's stage.
    ``channel``: the pipeline's number on its process group (every rank numbers it the same): ``base`` is
    ``channel`` (modulo the blocks that fit below 2**31 - 1) times the size of one pipeline's block, so the
    messages of two pipelines on one group never match.
    """

    DIRECTIONS = 3

    def __init__(self, num_stages: int, num_microbatches: int, channel: int = 0) -> None:
        self.num_stages = num_stages
        self.num_microbatches = num_microbatches
        top = self.DIRECTIONS * num_stages * max(num_microbatches, 1) * _SLOTS
        if top >= 2**31 - 1:
            raise ValueError(
                f"{num_stages} stages x {num_microbatches} micro-batches exceed the 31-bit tag space of the transport"
            )
        if channel < 0:
            raise ValueError(f"TagSpace: channel must be >= 0, got {channel}")
        self.channel = channel
        self.base = (channel % ((2**31 - 1) // top)) * top

    def tag(self, direction: int, stage: int, microbatch: int, index: int) -> int:
        return self.base + ((direction * self.num_stages + stage) * self.num_microbatches + microbatch) * _SLOTS + index

    @staticmethod
    def is_metadata(tag: int) -> bool:
        """Whether ``tag`` is a message's slot 0: its metadata, alone or at the head of a small message."""
        return tag % _SLOTS == 0


Layout = tuple[tuple[torch.dtype, tuple[int, ...], bool] | None, ...]
"""What must match for a speculative receive: per tensor None or (dtype, shape, exact).

``exact``: the tensor is carried bit for bit under a lossy boundary format
(codec.py); always False under ``none`` and ``packed``.
"""


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
    format_code: int = 0,
) -> torch.Tensor:
    """The metadata tensor (int64, ``META_LEN`` entries, on ``device``) for ``tensors``.

    ``speculative``: the data goes to the speculative tags (the receiver's
    remembered layout matches).  ``format_code``: the sender's boundary format.
    """
    if len(tensors) > MAX_TENSORS:
        raise ValueError(f"a stage boundary carries at most {MAX_TENSORS} tensors, got {len(tensors)}")
    words = [_MAGIC, len(tensors), int(speculative), format_code]
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


def meta_signature(
    tensors: Sequence[torch.Tensor | None], grad_flags: Sequence[bool], speculative: bool, format_code: int
) -> tuple[object, ...]:
    """Everything :func:`encode_meta` reads, as a hashable key (for the metadata cache)."""
    entries: list[object] = []
    for t, g in zip(tensors, grad_flags, strict=False):  # a loop, not a generator: per boundary message
        entries.append(None if t is None else (t.dtype, tuple(t.shape), bool(g)))
    return (speculative, format_code, tuple(entries), len(tensors))


def decode_meta(meta: torch.Tensor) -> tuple[list[TensorMeta | None], bool, int]:
    """``(per-tensor metadata, speculative flag, format code)`` of a metadata tensor (read after its transfer)."""
    # Most messages need a few words: read a short prefix, the whole header only when the prefix ends early.
    words = meta[:_SHORT].tolist()
    if words[0] != _MAGIC:
        raise TransportError(f"corrupt stage boundary metadata (magic {words[0]:#x}): sender and receiver disagree")
    out = _parse(words)
    if out is None:
        words = meta.tolist()
        out = _parse(words)
        if out is None:
            raise TransportError(f"corrupt stage boundary metadata: {words[1]} tensors overrun {META_LEN} words")
    return out, bool(words[2]), int(words[3])


def _parse(words: list[int]) -> list[TensorMeta | None] | None:
    """The per-tensor entries of header ``words``; None when they run past its end (read more words)."""
    out: list[TensorMeta | None] = []
    pos, end = 4, len(words)
    for _ in range(words[1]):
        if pos >= end:
            return None
        kind = words[pos]
        if kind == _KIND_NONE:
            out.append(None)
            pos += 1
            continue
        if pos + 3 > end or pos + 3 + words[pos + 2] > end:
            return None
        dtype, ndim = _DTYPES[words[pos + 1]], words[pos + 2]
        out.append(TensorMeta(tuple(words[pos + 3 : pos + 3 + ndim]), dtype, kind == _KIND_GRAD))
        pos += 3 + ndim
    return out
