"""The pack kernels' launch table, built on the host: one int64 row per tensor.

Its per-layout columns (:func:`_static_table`) are cached per layout and strides
by :mod:`.pack_triton`; each call fills in the addresses.  The kernels read a
row's columns as ``row + i``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from dualpipe_kernels.kernels.layout import ALIGN, KIND_BF16, KIND_COPY, PackLayout

__all__ = ["COPY1", "COPY2", "COPY4", "COPY8", "BF16_F32", "BF16_F16", "FP8_F32", "FP8_F16", "FP8_BF16"]

# conversion codes (a column of the table); copies go by element size
COPY1, COPY2, COPY4, COPY8 = 0, 1, 2, 3
BF16_F32, BF16_F16 = 4, 5
FP8_F32, FP8_F16, FP8_BF16 = 6, 7, 8
#: table columns (the kernels read them as ``row + i``):
#:  0 address, 1 numel, 2 data byte offset, 3 scale byte offset, 4 code, 5 contiguous flag,
#:  6..8 sizes of dims 1..3, 9..12 strides of dims 0..3 (elements; dims collapsed, padded in front),
#:  13 first fast-path program, 14 elements stored incl. padding, 15 scales stored incl. padding,
#:  16 fast-path flag (contiguous and 16 bytes apart from the buffer), 17 address - buffer address,
#:  18 blocks of the tensor, 19 first masked-path program, 20 whole blocks taken by the fast path
_WIDTH = 21
#: columns that change from call to call (addresses and what follows from them); the others are cached per
#: layout and strides
_ADDR, _FAST, _DELTA = 0, 16, 17
_FIRST_FAST, _FIRST_SLOW, _NFAST, _NBLK = 13, 19, 20, 18
#: bytes per element of the tensor's side, by conversion code
CODE_ITEMSIZE = (1, 2, 4, 8, 4, 2, 4, 2, 2)
_MAX_DIMS = 4
_COPY_CODE = {1: COPY1, 2: COPY2, 4: COPY4, 8: COPY8}
_BF16_CODE = {torch.float32: BF16_F32, torch.float16: BF16_F16}
_FP8_CODE = {torch.float32: FP8_F32, torch.float16: FP8_F16, torch.bfloat16: FP8_BF16}


def _collapse(shape: Sequence[int], stride: Sequence[int]) -> list[tuple[int, int]]:
    """(size, stride) dims with size-1 dims dropped and mergeable neighbours merged (row-major order kept)."""
    dims: list[tuple[int, int]] = []
    for size, st in zip(shape, stride, strict=True):
        if size == 1:
            continue
        if dims and dims[-1][1] == st * size:
            dims[-1] = (dims[-1][0] * size, st)
        else:
            dims.append((size, st))
    return dims


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _code(kind: int, dtype: torch.dtype) -> int:
    if kind == KIND_COPY:
        return _COPY_CODE[dtype.itemsize]
    return _BF16_CODE[dtype] if kind == KIND_BF16 else _FP8_CODE[dtype]


def _static_table(tensors: Sequence[torch.Tensor], layout: PackLayout, block: int) -> np.ndarray:
    """The table's per-layout columns (one row per tensor; the per-call columns left 0; ``block`` elements per
    block)."""
    rows = []
    for t, e in zip(tensors, layout.entries, strict=True):
        dims = _collapse(t.shape, t.stride())
        contig = int(len(dims) == 0 or (len(dims) == 1 and dims[0][1] == 1))
        dims = [(1, 0)] * (_MAX_DIMS - len(dims)) + dims
        sizes, strides = zip(*dims, strict=True)
        # elements and scales written, padding included (the region's aligned end)
        nstore = _align(e.nbytes) // (e.nbytes // e.numel) if e.numel else 0
        nscale = _align(4 * e.num_scales) // 4
        nblk = -(-nstore // block)
        rows.append([0, e.numel, e.offset, max(e.scale_offset, 0), _code(e.kind, e.dtype), contig,
                     *sizes[1:], *strides, 0, nstore, nscale, 0, 0, nblk, 0, 0])  # fmt: skip
    return np.array(rows, dtype=np.int64).reshape(len(rows), _WIDTH)


def _schedule(table: np.ndarray, nfast: np.ndarray, iters: int) -> tuple[int, int]:
    """Fill ``table``'s program columns in place for ``nfast`` whole blocks per tensor on the fast path (the
    rest of each tensor's blocks on the masked path), ``iters`` blocks per program: the fast programs come
    first, tensor after tensor, then the masked ones.  Returns (fast programs, all programs)."""
    fast = -(-nfast // iters)
    slow = -(-(table[:, _NBLK] - nfast) // iters)
    nf = int(fast.sum())
    table[:, _NFAST] = nfast
    table[:, _FIRST_FAST] = np.cumsum(fast) - fast
    table[:, _FIRST_SLOW] = nf + np.cumsum(slow) - slow
    return nf, nf + int(slow.sum())
