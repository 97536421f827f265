"""Triton pack/unpack: one launch moves any number of tensors into (or out of) one flat buffer.

How one launch covers many tensors: the host builds a small int64 *table*, one
row per tensor (base address, element count, byte offsets in the buffer, a
conversion code, the tensor's shape and strides collapsed to at most 4 dims,
and the index of its first block).  Every program handles one block of
``ROWS x 128`` elements of one tensor at a time, ``iters`` consecutive blocks in a
loop (so the table reads and the search below are paid once per ``iters`` blocks,
not per block; a GPU launch aims at ``PROGRAMS_PER_SM`` programs per
multiprocessor, so up to about 128 MiB on an H200 each program takes one block);
it finds its tensor by a binary search over the first-program column,
then branches on the conversion code.  Raw
addresses work in the interpreter too (it reads CPU memory at those addresses).
A whole block of a contiguous tensor whose address is 16 bytes apart from the
buffer's takes an unmasked path addressed from the buffer pointer, which the
compiler can vectorise (16-byte accesses); the rest go through masked, strided code.
The padding after each region is written with zeros (the stores run on to the
region's aligned end), so a buffer's bytes depend only on its inputs.

Each launch compiles the variant its table needs (constexprs ``CODE``,
``CONTIG``, ``I32``): when every tensor has the same conversion only that path
is built, when all are contiguous no strided index arithmetic, and indices are
int32 when every block index and element offset fits.  The generic kernel
(every path, 64-bit indices) needed ~250 registers a thread on sm_90, so two
programs of 4 warps shared a multiprocessor; a launch of one conversion needs
40-72 contiguous (7 to 12 programs fit), up to 96 strided (5), a mixed one with
int32 indices 72-168
(:func:`.cubin.registers_per_thread` reads it from the compiled cubin, no GPU needed).

Rounding is done explicitly on the fp32 bit patterns (:mod:`.triton_casts`), so
results do not depend on the backend's casts.

``TRITON_INTERPRET=1`` must be set before this module is imported to run it on
CPU tensors; :data:`INTERPRETED` says which mode the kernels were built in.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from dualpipe_kernels.kernels.cubin import fit_per_sm, registers_per_thread
from dualpipe_kernels.kernels.layout import ALIGN, FP8_BLOCK, PackLayout
from dualpipe_kernels.kernels.pack_table import (
    _ADDR,
    _DELTA,
    _FAST,
    _MAX_DIMS,
    _WIDTH,
    _collapse,
    _programs,
    _static_table,
)
from dualpipe_kernels.kernels.triton_casts import bf16_bits, bf16_value, e4m3_value, quantize_e4m3

__all__ = [
    "INTERPRETED",
    "pack_into",
    "unpack_into",
    "rows_per_block",
    "registers_per_thread",
    "fit_per_sm",
    "host_only",
]

#: True when the kernels run in Triton's interpreter (TRITON_INTERPRET=1 at import)
INTERPRETED = bool(triton.knobs.runtime.interpret)

#: programs per multiprocessor a GPU launch aims at (each loops over ``iters`` blocks): about four waves of
#: the 8 that fit at once (``fit_per_sm``), so that a last, partly filled wave costs a quarter of the
#: launch at most, not half (one wave plus a few programs per tensor's remainder ran twice as long)
PROGRAMS_PER_SM = 32
#: at most this many blocks per program
MAX_ITERS = 64
#: blocks per program for every launch, instead of the choice above (tests: the interpreter's loop path)
iters_override: int | None = None
#: compile each launch for what its table holds: one conversion for every tensor (only that path is built),
#: all contiguous (no strided index arithmetic), indices that fit int32.  False: the one generic kernel
#: (every path, 64-bit indices; tests and ``bench kernels --variants`` compare the two).  Registers per
#: thread of the sm_90 build (``registers_per_thread``): 240-255 generic, 40-72 for one contiguous
#: conversion, so that 7 or 8 programs of 4 warps fit a multiprocessor instead of 2.
specialize: bool = True
#: int32 indices: every tensor's blocks and element offsets below this
_I32_LIMIT = 2**31 - 1
#: binary-search steps for counts up to 2^_MIN_LOG_N tensors (one compiled variant for them all); a launch of
#: one tensor takes none, more take ceil(log2 n): the search covers indices below 2^steps
_MIN_LOG_N = 5


# ---------------------------------------------------------------- device helpers
@triton.jit
def _find_tensor(table, pid, n, LOG_N: tl.constexpr, W: tl.constexpr):
    """The last tensor whose first block is <= pid (tensors without blocks are skipped by construction)."""
    lo = pid * 0
    for k in tl.static_range(LOG_N):
        cand = lo + (1 << (LOG_N - 1 - k))
        first = tl.load(table + cand * W + 13, mask=cand < n, other=pid + 1)
        lo = tl.where(first <= pid, cand, lo)
    return lo


@triton.jit
def _strided(local, row):
    """Element offsets of row-major indices ``local`` in the tensor of table ``row`` (its sizes and strides)."""
    if tl.load(row + 5) != 0:  # contiguous
        off = local
    else:
        # in the indices' type: int32 when the launch's indices and offsets fit (64-bit division is slow)
        d1 = tl.load(row + 6).to(local.dtype)
        d2 = tl.load(row + 7).to(local.dtype)
        d3 = tl.load(row + 8).to(local.dtype)
        i3 = local % d3
        r = local // d3
        i2 = r % d2
        r = r // d2
        off = (r // d1) * tl.load(row + 9).to(local.dtype) + (r % d1) * tl.load(row + 10).to(local.dtype)
        off += i2 * tl.load(row + 11).to(local.dtype) + i3 * tl.load(row + 12).to(local.dtype)
    return off


# ---------------------------------------------------------------- kernels
@triton.jit
def _ld(ptr, mask, FAST: tl.constexpr):
    if FAST:
        v = tl.load(ptr)
    else:
        v = tl.load(ptr, mask=mask, other=0)
    return v


@triton.jit
def _st(ptr, value, mask, FAST: tl.constexpr):
    if FAST:
        tl.store(ptr, value)
    else:
        tl.store(ptr, value, mask=mask)


@triton.jit
def _tile(row, buf, blk, ROWS: tl.constexpr, FAST: tl.constexpr, CONTIG: tl.constexpr):
    """(tensor base as a byte pointer, row-major indices of this block, their element offsets, mask,
    the tensor's region in the buffer as a byte pointer).  ``CONTIG``: every tensor of the launch is
    contiguous (the strided index arithmetic is not compiled)."""
    rows = tl.arange(0, ROWS)
    local = blk * (ROWS * 128) + rows[:, None] * 128 + tl.arange(0, 128)[None, :]
    if FAST:
        # contiguous, a whole block, 16 bytes apart from the buffer: addressed from the buffer pointer
        # with a `// 16 * 16` offset, the compiler knows the alignment and vectorises
        base = buf + tl.load(row + 17) // 16 * 16
        off = local
    else:
        base = tl.load(row + 0).to(tl.pointer_type(tl.uint8))
        if CONTIG:
            off = local
        else:
            off = _strided(local, row)
    return base, local, off, local < tl.load(row + 1).to(local.dtype), buf + tl.load(row + 2) // 16 * 16


@triton.jit
def _scales(row, buf, blk, ROWS: tl.constexpr):
    """(indices of this block's rows among the tensor's fp8 scales, the scale region as an fp32 pointer)."""
    scale_idx = blk * ROWS + tl.arange(0, ROWS)
    return scale_idx, (buf + tl.load(row + 3) // 16 * 16).to(tl.pointer_type(tl.float32), bitcast=True)


@triton.jit
def _copy_bits(src, src_off, dst, dst_off, mask, smask, code, FAST: tl.constexpr):
    """Copy a tile of 1/2/4/8-byte elements (``code`` 0..3) bit for bit; ``src``/``dst`` are byte pointers,
    the offsets count elements; loads are masked by ``mask``, stores by ``smask``.  (One name per width:
    Triton merges a name bound in both arms of an if, and the widths' types differ.)"""
    if code == 0:
        _st(dst + dst_off, _ld(src + src_off, mask, FAST), smask, FAST)
    elif code == 1:
        v16 = _ld(src.to(tl.pointer_type(tl.uint16), bitcast=True) + src_off, mask, FAST)
        _st(dst.to(tl.pointer_type(tl.uint16), bitcast=True) + dst_off, v16, smask, FAST)
    elif code == 2:
        v32 = _ld(src.to(tl.pointer_type(tl.uint32), bitcast=True) + src_off, mask, FAST)
        _st(dst.to(tl.pointer_type(tl.uint32), bitcast=True) + dst_off, v32, smask, FAST)
    else:
        v64 = _ld(src.to(tl.pointer_type(tl.uint64), bitcast=True) + src_off, mask, FAST)
        _st(dst.to(tl.pointer_type(tl.uint64), bitcast=True) + dst_off, v64, smask, FAST)


@triton.jit
def _pack_block(row, buf, blk, ROWS: tl.constexpr, POW2: tl.constexpr, FAST: tl.constexpr, CODE: tl.constexpr,
                CONTIG: tl.constexpr):  # fmt: skip
    """Pack one block; ``CODE`` >= 0: every tensor of the launch converts so (only that path is compiled),
    -1: each tensor's code is read from the table (every path compiled)."""
    if CODE >= 0:
        _pack_tile(row, buf, blk, CODE, ROWS, POW2, FAST, CONTIG)
    else:
        _pack_tile(row, buf, blk, tl.load(row + 4), ROWS, POW2, FAST, CONTIG)


@triton.jit
def _pack_tile(row, buf, blk, code, ROWS: tl.constexpr, POW2: tl.constexpr, FAST: tl.constexpr,
               CONTIG: tl.constexpr):  # fmt: skip
    base, local, src, mask, dst = _tile(row, buf, blk, ROWS, FAST, CONTIG)
    # stores run on to the region's aligned end, so the padding gets zeros (masked loads there give 0)
    smask = local < tl.load(row + 14).to(local.dtype)
    if code < 4:
        _copy_bits(base, src, dst, local, mask, smask, code, FAST)
    else:
        if code == 4 or code == 6:
            x = _ld(base.to(tl.pointer_type(tl.float32), bitcast=True) + src, mask, FAST)
        elif code == 5 or code == 7:
            x = _ld(base.to(tl.pointer_type(tl.float16), bitcast=True) + src, mask, FAST).to(tl.float32)
        else:
            x = bf16_value(_ld(base.to(tl.pointer_type(tl.uint16), bitcast=True) + src, mask, FAST))
        if code == 4 or code == 5:
            _st(dst.to(tl.pointer_type(tl.uint16), bitcast=True) + local, bf16_bits(x), smask, FAST)
        else:
            scale_idx, scale_dst = _scales(row, buf, blk, ROWS)
            q, scale = quantize_e4m3(x, POW2)
            _st(dst + local, q, smask, FAST)
            _st(scale_dst + scale_idx, scale, scale_idx < tl.load(row + 15).to(scale_idx.dtype), FAST)


@triton.jit
def _unpack_block(row, buf, blk, ROWS: tl.constexpr, FAST: tl.constexpr, CODE: tl.constexpr, CONTIG: tl.constexpr):
    """Unpack one block (``CODE`` as in :func:`_pack_block`)."""
    if CODE >= 0:
        _unpack_tile(row, buf, blk, CODE, ROWS, FAST, CONTIG)
    else:
        _unpack_tile(row, buf, blk, tl.load(row + 4), ROWS, FAST, CONTIG)


@triton.jit
def _unpack_tile(row, buf, blk, code, ROWS: tl.constexpr, FAST: tl.constexpr, CONTIG: tl.constexpr):
    base, local, dst, mask, src = _tile(row, buf, blk, ROWS, FAST, CONTIG)
    if code < 4:
        _copy_bits(src, local, base, dst, mask, mask, code, FAST)
    else:
        if code == 4 or code == 5:
            x = bf16_value(_ld(src.to(tl.pointer_type(tl.uint16), bitcast=True) + local, mask, FAST))
        else:
            scale_idx, scales = _scales(row, buf, blk, ROWS)
            scale = _ld(scales + scale_idx, scale_idx * 128 < tl.load(row + 1).to(scale_idx.dtype), FAST)
            x = e4m3_value(_ld(src + local, mask, FAST)) * scale[:, None]
        if code == 4 or code == 6:
            _st(base.to(tl.pointer_type(tl.float32), bitcast=True) + dst, x, mask, FAST)
        elif code == 5 or code == 7:
            _st(base.to(tl.pointer_type(tl.float16), bitcast=True) + dst, x.to(tl.float16), mask, FAST)
        else:
            _st(base.to(tl.pointer_type(tl.uint16), bitcast=True) + dst, bf16_bits(x), mask, FAST)


@triton.jit
def _fast(row, blk, ROWS: tl.constexpr):
    """Whether this block takes the unmasked aligned path (host flag, and the block lies wholly inside)."""
    return (tl.load(row + 16) != 0) & ((blk + 1) * (ROWS * 128) <= tl.load(row + 1))


@triton.jit
def _blocks(table, buf, n, iters, LOG_N: tl.constexpr, ROWS: tl.constexpr, W: tl.constexpr, POW2: tl.constexpr,
            PACK: tl.constexpr, CODE: tl.constexpr, CONTIG: tl.constexpr, I32: tl.constexpr):  # fmt: skip
    """One program: find its tensor, then pack (``PACK``) or unpack its run of up to ``iters`` blocks."""
    pid = tl.program_id(0).to(tl.int64)
    row = table + _find_tensor(table, pid, n, LOG_N, W) * W
    first = (pid - tl.load(row + 13)) * iters
    nblk = tl.load(row + 18)
    for it in range(0, iters):
        blk = first + it
        if I32:  # block indices, element indices and offsets in int32 (the host checked they fit)
            blk = blk.to(tl.int32)
        if blk < nblk:
            fast = _fast(row, blk, ROWS)
            if PACK:
                if fast:
                    _pack_block(row, buf, blk, ROWS, POW2, True, CODE, CONTIG)
                else:
                    _pack_block(row, buf, blk, ROWS, POW2, False, CODE, CONTIG)
            else:
                if fast:
                    _unpack_block(row, buf, blk, ROWS, True, CODE, CONTIG)
                else:
                    _unpack_block(row, buf, blk, ROWS, False, CODE, CONTIG)


@triton.jit
def _pack_kernel(table, buf, n, iters, LOG_N: tl.constexpr, ROWS: tl.constexpr, W: tl.constexpr, POW2: tl.constexpr,
                 CODE: tl.constexpr, CONTIG: tl.constexpr, I32: tl.constexpr):  # fmt: skip
    _blocks(table, buf, n, iters, LOG_N, ROWS, W, POW2, True, CODE, CONTIG, I32)


@triton.jit
def _unpack_kernel(table, buf, n, iters, LOG_N: tl.constexpr, ROWS: tl.constexpr, W: tl.constexpr,
                   CODE: tl.constexpr, CONTIG: tl.constexpr, I32: tl.constexpr):  # fmt: skip
    _blocks(table, buf, n, iters, LOG_N, ROWS, W, False, False, CODE, CONTIG, I32)


# ---------------------------------------------------------------- host side
#: rows per block for every launch, instead of the choice below (bench kernels --variants tunes with it)
rows_override: int | None = None


def rows_per_block(device: torch.device) -> int:
    """Rows of 128 elements per block: large tiles on a GPU, and in the interpreter (fewer Python steps)."""
    if rows_override is not None:
        return rows_override
    return 16 if device.type == "cuda" else 32


def _variant(static: np.ndarray, block: int) -> tuple[int, bool, bool]:
    """(CODE, CONTIG, I32) of the kernel variant for ``static``'s tensors (the ones with blocks: a program
    never lands on the others): their one conversion code or -1, all contiguous, int32 indices enough."""
    if not specialize:
        return -1, False, False
    live = static[static[:, 18] > 0]
    if len(live) == 0:
        return -1, False, False
    codes = live[:, 4]
    code = int(codes[0]) if (codes == codes[0]).all() else -1
    contig = bool((live[:, 5] != 0).all())
    # the last index a block touches, and the furthest element offset of a strided tensor
    last_index = int((live[:, 18] * block).max())
    inner = live[:, 6:9]  # sizes of dims 1..3; dim 0's is what the element count leaves
    outer = live[:, 1] // np.maximum(inner.prod(axis=1), 1)
    sizes = np.concatenate([outer[:, None], inner], axis=1)
    last_offset = int((np.maximum(sizes - 1, 0) * np.abs(live[:, 9:13])).sum(axis=1).max())
    return code, contig, max(last_index, last_offset) <= _I32_LIMIT


class _Plan:
    """A layout's table for one set of strides, rows and device: everything but the addresses."""

    __slots__ = ("layout", "table", "programs", "iters", "contig", "code", "all_contig", "i32")

    def __init__(self, layout: PackLayout, table: np.ndarray, programs: int, iters: int, block: int) -> None:
        self.layout, self.table, self.programs, self.iters = layout, table, programs, iters
        self.contig = table[:, 5] != 0
        self.code, self.all_contig, self.i32 = _variant(table, block)


#: (id(layout), strides, rows, device, the launch-shape settings) -> _Plan; the plan holds its layout, so an id is
#: never reused while cached
_PLANS: dict[tuple, _Plan] = {}
_MAX_PLANS = 256
_SM_COUNT: dict[int, int] = {}


def _iters(device: torch.device, blocks: int) -> int:
    """Blocks per program: about PROGRAMS_PER_SM programs per multiprocessor (1 in the interpreter)."""
    if iters_override is not None:
        return iters_override
    if device.type != "cuda":
        return 1
    idx = device.index if device.index is not None else torch.cuda.current_device()
    sms = _SM_COUNT.get(idx)
    if sms is None:
        sms = _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return max(1, min(MAX_ITERS, blocks // (sms * PROGRAMS_PER_SM)))


def _plan(tensors: Sequence[torch.Tensor], layout: PackLayout, rows: int, device: torch.device) -> _Plan:
    key = (id(layout), tuple(t.stride() for t in tensors), rows, device, iters_override, PROGRAMS_PER_SM, specialize)
    plan = _PLANS.get(key)
    if plan is None or plan.layout is not layout:
        static = _static_table(tensors, layout, rows * FP8_BLOCK)
        iters = _iters(device, int(static[:, 18].sum()))
        table, programs = _programs(static, iters)
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        plan = _PLANS[key] = _Plan(layout, table, programs, iters, rows * FP8_BLOCK)
    return plan


def _table(plan: _Plan, tensors: Sequence[torch.Tensor], buf_addr: int, addrs: np.ndarray | None = None) -> np.ndarray:
    """The plan's table with this call's addresses (column 0), offsets from the buffer and fast-path flags."""
    if addrs is None:
        addrs = _addresses(tensors)
    table = plan.table.copy()
    delta = addrs - buf_addr
    table[:, _ADDR] = addrs
    table[:, _DELTA] = delta
    table[:, _FAST] = plan.contig & (delta % ALIGN == 0)
    return table


def _addresses(tensors: Sequence[torch.Tensor]) -> np.ndarray:
    return np.fromiter((t.data_ptr() for t in tensors), dtype=np.int64, count=len(tensors))


#: (plan id, buffer address, the tensors' addresses, stream) -> (plan, the table on the device): the same
#: tensors packed again (a benchmark's loop; a training step whose allocator hands back the same blocks)
#: reuse the table already on the device instead of staging it through pinned memory and copying it
#: again.  A table is a function of its key's contents alone; an entry holds its plan, so the plan's id
#: is not reused while the entry lives, and a stream sees only tables it copied itself (ordered before it).
_TABLES: dict[tuple, tuple[_Plan, torch.Tensor]] = {}
_MAX_TABLES = 64
#: tables built (host work and a host-to-device copy each on a GPU); a hit in _TABLES builds none
table_builds = 0


def _stream_key(device: torch.device) -> int:
    """The current stream of ``device`` as an int (0 on CPU)."""
    if device.type != "cuda":
        return 0
    idx = device.index if device.index is not None else torch.cuda.current_device()
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return int(raw(idx)) if raw is not None else int(torch.cuda.current_stream(idx).cuda_stream)


def _device_table(plan: _Plan, tensors: Sequence[torch.Tensor], buffer: torch.Tensor) -> torch.Tensor:
    """This call's table where the kernel reads it (on the buffer's device), from :data:`_TABLES` when the
    same addresses were launched on this stream before."""
    global table_builds
    addrs = _addresses(tensors)
    # Under CUDA graph capture the copy below runs only at replay and the table lives in the graph's pool:
    # such a table is neither served nor kept (a later capture or an eager call would read a copy never made)
    capturing = buffer.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    key = (id(plan), buffer.data_ptr(), addrs.tobytes(), _stream_key(buffer.device))
    hit = None if capturing else _TABLES.get(key)
    if hit is not None and hit[0] is plan:
        return hit[1]
    table = _table(plan, tensors, buffer.data_ptr(), addrs)
    table_builds += 1
    if buffer.device.type == "cuda":
        # through pinned memory: an asynchronous copy (torch's host allocator keeps the block until it is done)
        host = torch.empty(table.size, dtype=torch.int64, pin_memory=True)
        host.numpy()[:] = table.ravel()
        meta = host.to(buffer.device, non_blocking=True)
    else:
        meta = torch.from_numpy(table.ravel())
    if not capturing:
        if len(_TABLES) >= _MAX_TABLES:
            _TABLES.clear()
        _TABLES[key] = (plan, meta)
    return meta


def _launch(kernel, tensors: Sequence[torch.Tensor], layout: PackLayout, buffer: torch.Tensor, **kw) -> None:
    device = buffer.device
    rows = rows_per_block(device)
    plan = _plan(tensors, layout, rows, device)
    if plan.programs == 0:
        return
    meta = _device_table(plan, tensors, buffer)
    n = len(plan.table)
    log_n = 0 if n == 1 else max(_MIN_LOG_N, math.ceil(math.log2(n)))
    # Triton launches on the current device; the buffer's may be another (switching costs microseconds)
    other = device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device()
    if _host_only:
        return
    with torch.cuda.device(device) if other else contextlib.nullcontext():
        kernel[(plan.programs,)](meta, buffer, n, plan.iters, LOG_N=log_n, ROWS=rows, W=_WIDTH,
                                 CODE=plan.code, CONTIG=plan.all_contig, I32=plan.i32, **kw)  # fmt: skip


def _bit_view(t: torch.Tensor) -> torch.Tensor:
    """complex64 as int64 (same bits: the kernels copy it by element size); other dtypes as they are."""
    return t.view(torch.int64) if t.dtype == torch.complex64 else t


def _as_copyable(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a tensor the table can describe: a bit view, contiguous if it has more than 4 strided dims."""
    if t.dtype == torch.complex64:
        t = t.view(torch.int64)
    if t.dim() <= _MAX_DIMS:  # collapsing never adds dims (the common case: no per-call dim walk)
        return t
    return t if len(_collapse(t.shape, t.stride())) <= _MAX_DIMS else t.contiguous()


def pack_into(tensors: Sequence[torch.Tensor], layout: PackLayout, buffer: torch.Tensor) -> None:
    """One kernel launch writing ``tensors`` into ``buffer`` (1-D uint8, same device) as ``layout`` says."""
    srcs = [_as_copyable(t) for t in tensors]
    _launch(_pack_kernel, srcs, layout, buffer, POW2=layout.format == "fp8_pow2")


def unpack_into(buffer: torch.Tensor, layout: PackLayout, outs: Sequence[torch.Tensor]) -> None:
    """One kernel launch filling ``outs`` (the layout's shapes and dtypes, any non-overlapping strides)."""
    dsts = [_as_copyable(o) for o in outs]
    _launch(_unpack_kernel, dsts, layout, buffer)
    for o, d in zip(outs, dsts, strict=True):
        if d is not o and d.data_ptr() != o.data_ptr():  # a > 4-dim strided view went through a contiguous copy
            _bit_view(o).copy_(d)


_host_only = False  # set by host_only()


@contextlib.contextmanager
def host_only() -> Iterator[None]:
    """Inside: :func:`pack_into` / :func:`unpack_into` do all their host work (checks, the launch plan, the
    table) and launch no kernel, so what a benchmark times is this library's own host path per call
    (bench/pack_host_us.py).  Process-wide, for benchmarks only: no kernel runs anywhere meanwhile."""
    global _host_only
    before, _host_only = _host_only, True
    try:
        yield
    finally:
        _host_only = before
