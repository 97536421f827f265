"""The layout of a packed buffer: where each tensor's bytes (and fp8 scales) sit, as small plain data.

A :class:`PackLayout` is computed from the tensors' dtypes and shapes and the
format alone (never from their values or strides), so two micro-batches with the
same shapes share one layout: the receiver needs it once per *signature*
(:attr:`PackLayout.signature`), and :class:`LayoutCache` keeps them.  It
travels between processes as a pickle (a frozen dataclass of tuples) or as
a 1-D int64 tensor (:meth:`PackLayout.to_tensor` / :meth:`PackLayout.from_tensor`) or
bytes (:meth:`PackLayout.to_bytes` / :meth:`PackLayout.from_bytes`),
and :attr:`PackLayout.digest` names it in 8 bytes, stable across processes.

Buffer format (bytes, 1-D ``torch.uint8``): tensor after tensor in the given
order, each region starting at a multiple of :data:`ALIGN` bytes; the padding bytes
after a region (up to the next multiple of ALIGN) are zeros, so equal inputs give
equal buffers, byte for byte.  A region holds
the tensor's elements in row-major (C) order, either in the tensor's own dtype
(``copy``: bit-exact), as bfloat16 (``bf16``), or as float8 e4m3 codes
(``fp8``) followed, at the next aligned offset, by one fp32 scale per
:data:`FP8_BLOCK` consecutive elements (the last block may be shorter).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Sequence
from typing import Any

import torch

from dualpipe_kernels.wire_dtypes import WIRE_DTYPE_CODE, WIRE_DTYPES

__all__ = [
    "ALIGN",
    "FP8_BLOCK",
    "FP8_MAX",
    "FORMATS",
    "KIND_COPY",
    "KIND_BF16",
    "KIND_FP8",
    "Entry",
    "PackLayout",
    "LayoutCache",
    "plan_layout",
    "format_for",
]

#: every region starts at a multiple of this many bytes (vector loads; a float64 region stays aligned)
ALIGN = 16
#: elements per fp8 scale
FP8_BLOCK = 128
#: largest finite float8 e4m3fn value; scale = block absmax / FP8_MAX
FP8_MAX = 448.0
#: format names: ``packed`` = lossless; ``fp8_pow2`` = fp8 with scales rounded up to a power of two
FORMATS = ("packed", "bf16", "fp8", "fp8_pow2")
KIND_COPY, KIND_BF16, KIND_FP8 = 0, 1, 2
_KIND_NAMES = ("copy", "bf16", "fp8")

#: dtypes a buffer can carry (elements of at most 8 bytes: the kernels' widest copy), coded by the
#: package-wide wire table
DTYPES: tuple[torch.dtype, ...] = tuple(d for d in WIRE_DTYPES if d.itemsize <= 8)
_DTYPE_CODE = {d: WIRE_DTYPE_CODE[d] for d in DTYPES}


def _packable_code(code: int) -> bool:
    return 0 <= code < len(WIRE_DTYPES) and WIRE_DTYPES[code] in _DTYPE_CODE


#: float dtypes each lossy format casts; every other dtype is carried bit for bit
_CAST_FROM = {
    "bf16": (torch.float32, torch.float16),
    "fp8": (torch.float32, torch.float16, torch.bfloat16),
    "fp8_pow2": (torch.float32, torch.float16, torch.bfloat16),
}
_MAGIC, _VERSION = 0x504B, 1  # "PK"
_HEADER = 4  # magic, version, format, number of tensors


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def format_for(dtype: torch.dtype | None, pow2_scales: bool = False) -> str:
    """The format name of ``pack``'s ``dtype`` argument (None, torch.bfloat16 or torch.float8_e4m3fn)."""
    if dtype is None:
        return "packed"
    if dtype == torch.bfloat16:
        return "bf16"
    if dtype == torch.float8_e4m3fn:
        return "fp8_pow2" if pow2_scales else "fp8"
    raise ValueError(
        f"pack: unsupported cast dtype {dtype}; use None (lossless), torch.bfloat16 or torch.float8_e4m3fn"
    )


@dataclasses.dataclass(frozen=True)
class Entry:
    """Where one tensor sits in the buffer.  Offsets and sizes in bytes; ``scale_offset`` is -1 unless fp8."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    kind: int
    offset: int
    nbytes: int
    scale_offset: int = -1

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def num_scales(self) -> int:
        return -(-self.numel // FP8_BLOCK) if self.kind == KIND_FP8 else 0

    @property
    def kind_name(self) -> str:
        return _KIND_NAMES[self.kind]

    @property
    def end(self) -> int:
        """One past the entry's last byte (its scales' when fp8), before the padding."""
        return self.scale_offset + 4 * self.num_scales if self.kind == KIND_FP8 else self.offset + self.nbytes

    def padding(self) -> list[tuple[int, int]]:
        """(offset, nbytes) of the zero bytes after the data (and after the scales) up to ALIGN."""
        ends = [self.offset + self.nbytes, self.end] if self.kind == KIND_FP8 else [self.end]
        return [(end, _align(end) - end) for end in ends if _align(end) > end]


@dataclasses.dataclass(frozen=True)
class PackLayout:
    """The layout of one packed buffer: the format, one :class:`Entry` per tensor, the total size in bytes."""

    format: str
    entries: tuple[Entry, ...]
    nbytes: int

    @property
    def signature(self) -> tuple[Any, ...]:
        """What the layout depends on (format, dtypes, shapes): equal signatures have equal layouts."""
        return (self.format, tuple((e.dtype, e.shape) for e in self.entries))

    def encode(self) -> list[int]:
        """The layout as a flat list of ints (what the custom ops and :meth:`to_tensor` carry)."""
        ints = [_MAGIC, _VERSION, FORMATS.index(self.format), len(self.entries)]
        for e in self.entries:
            ints += [_DTYPE_CODE[e.dtype], len(e.shape), *e.shape]
        return ints

    @classmethod
    def decode(cls, ints: Sequence[int]) -> PackLayout:
        """The layout :meth:`encode` wrote (offsets are recomputed: the plan is deterministic)."""
        ints = [int(i) for i in ints]
        if len(ints) < _HEADER or ints[0] != _MAGIC:
            raise ValueError("PackLayout.decode: not an encoded pack layout (bad magic or too short)")
        if ints[1] != _VERSION:
            raise ValueError(f"PackLayout.decode: layout version {ints[1]}, this build reads {_VERSION}")
        if not 0 <= ints[2] < len(FORMATS):
            raise ValueError(f"PackLayout.decode: unknown format code {ints[2]}")
        specs, pos = [], _HEADER
        for i in range(ints[3]):
            if pos + 2 > len(ints) or not _packable_code(ints[pos]) or ints[pos + 1] < 0:
                raise ValueError(f"PackLayout.decode: entry {i} is truncated or has a bad dtype/rank")
            ndim = ints[pos + 1]
            shape = tuple(ints[pos + 2 : pos + 2 + ndim])
            if len(shape) != ndim or any(s < 0 for s in shape):
                raise ValueError(f"PackLayout.decode: entry {i} has a truncated or negative shape {shape}")
            specs.append((WIRE_DTYPES[ints[pos]], shape))
            pos += 2 + ndim
        if pos != len(ints):
            raise ValueError(f"PackLayout.decode: {len(ints) - pos} trailing ints after {ints[3]} entries")
        return plan_layout(specs, FORMATS[ints[2]])

    def to_tensor(self) -> torch.Tensor:
        """The encoded layout as a 1-D int64 CPU tensor (to send over a tensor transport)."""
        return torch.tensor(self.encode(), dtype=torch.int64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> PackLayout:
        """The layout a :meth:`to_tensor` tensor carries."""
        if t.dtype != torch.int64 or t.dim() != 1:
            raise ValueError(
                f"PackLayout.from_tensor: needs a 1-D int64 tensor, got {t.dtype} of shape {tuple(t.shape)}"
            )
        return cls.decode(t.tolist())

    def to_bytes(self) -> bytes:
        """The encoding as little-endian int64s (``torch.frombuffer(..., dtype=torch.uint8)`` makes it a tensor)."""
        return b"".join(i.to_bytes(8, "little", signed=True) for i in self.encode())

    @classmethod
    def from_bytes(cls, raw: bytes | bytearray | memoryview) -> PackLayout:
        """The layout :meth:`to_bytes` wrote."""
        raw = bytes(raw)
        if len(raw) % 8:
            raise ValueError(f"PackLayout.from_bytes: {len(raw)} bytes is not a whole number of int64s")
        return cls.decode([int.from_bytes(raw[i : i + 8], "little", signed=True) for i in range(0, len(raw), 8)])

    @property
    def digest(self) -> int:
        """A 63-bit name of the layout, the same in every process (blake2b of the encoding)."""
        return int.from_bytes(hashlib.blake2b(self.to_bytes(), digest_size=8).digest(), "little") >> 1

    def regions(self) -> list[tuple[int, int]]:
        """(offset, nbytes) of every byte range that carries data or scales (the rest is zero padding)."""
        out = []
        for e in self.entries:
            out.append((e.offset, e.nbytes))
            if e.kind == KIND_FP8:
                out.append((e.scale_offset, 4 * e.num_scales))
        return out

    def describe(self) -> str:
        """One line per tensor: index, dtype, shape, how it is stored, byte range."""
        lines = [f"PackLayout format={self.format} tensors={len(self.entries)} nbytes={self.nbytes}"]
        for i, e in enumerate(self.entries):
            scales = f" scales@{e.scale_offset}" if e.kind == KIND_FP8 else ""
            lines.append(f"  [{i}] {e.dtype} {list(e.shape)} {e.kind_name} @{e.offset}+{e.nbytes}{scales}")
        return "\n".join(lines)


def _entry(dtype: torch.dtype, shape: tuple[int, ...], fmt: str, offset: int) -> Entry:
    numel = math.prod(shape)
    if dtype in _CAST_FROM.get(fmt, ()):
        if fmt == "bf16":
            return Entry(dtype, shape, KIND_BF16, offset, 2 * numel)
        scale_offset = _align(offset + numel)
        return Entry(dtype, shape, KIND_FP8, offset, numel, scale_offset)
    return Entry(dtype, shape, KIND_COPY, offset, numel * dtype.itemsize)


def plan_layout(specs: Sequence[tuple[torch.dtype, Sequence[int]]], fmt: str = "packed") -> PackLayout:
    """The layout for tensors of these ``(dtype, shape)`` in this format (one of :data:`FORMATS`)."""
    if fmt not in FORMATS:
        raise ValueError(f"pack: unknown format {fmt!r}; expected one of {FORMATS}")
    if not specs:
        raise ValueError("pack: needs at least one tensor")
    entries, offset = [], 0
    for i, (dtype, shape) in enumerate(specs):
        if dtype not in _DTYPE_CODE:
            supported = ", ".join(str(d).removeprefix("torch.") for d in DTYPES)
            raise TypeError(f"pack: tensor {i} has unsupported dtype {dtype}; supported: {supported}")
        e = _entry(dtype, tuple(int(s) for s in shape), fmt, offset)
        entries.append(e)
        offset = _align(e.end)
    return PackLayout(fmt, tuple(entries), offset)


class LayoutCache:
    """Layouts by signature, owned by one sender or receiver (e.g. one pipeline boundary and direction).

    A sender calls :meth:`lookup` and sends the layout (:meth:`PackLayout.to_tensor`) only when it
    is new, then just its :attr:`PackLayout.digest` with each message; the receiver :meth:`add` s
    what it receives and finds it again with :meth:`by_digest`.  Not thread-safe: one owner.
    """

    def __init__(self) -> None:
        self._by_signature: dict[tuple[Any, ...], PackLayout] = {}
        self._by_digest: dict[int, PackLayout] = {}

    def __len__(self) -> int:
        return len(self._by_signature)

    def lookup(self, tensors: Sequence[torch.Tensor], fmt: str = "packed") -> tuple[PackLayout, bool]:
        """(the layout for these tensors' dtypes and shapes, True when it was planned by this call)."""
        key = (fmt, tuple((t.dtype, tuple(t.shape)) for t in tensors))
        layout = self._by_signature.get(key)
        if layout is not None:
            return layout, False
        layout = plan_layout(key[1], fmt)
        self.add(layout)
        return layout, True

    def get(self, tensors: Sequence[torch.Tensor], fmt: str = "packed") -> PackLayout:
        """The layout for these tensors' dtypes and shapes (planned the first time)."""
        return self.lookup(tensors, fmt)[0]

    def add(self, layout: PackLayout) -> None:
        """Remember a layout (e.g. one received from the peer)."""
        self._by_signature[layout.signature] = layout
        self._by_digest[layout.digest] = layout

    def by_digest(self, digest: int) -> PackLayout | None:
        """The remembered layout with this :attr:`PackLayout.digest`, or None."""
        return self._by_digest.get(digest)
