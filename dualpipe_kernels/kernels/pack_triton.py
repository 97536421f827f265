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

from dualpipe_kernels.kernels.cubin import fit_per_sm, registers_per_thread
from dualpipe_kernels.kernels.layout import ALIGN, FP8_BLOCK, PackLayout
from dualpipe_kernels.kernels.pack_jit import pack_kernel as _pack_kernel
from dualpipe_kernels.kernels.pack_jit import unpack_kernel as _unpack_kernel
from dualpipe_kernels.kernels.pack_table import (
    _ADDR,
    _DELTA,
    _FAST,
    _MAX_DIMS,
    _NBLK,
    _WIDTH,
    CODE_ITEMSIZE,
    COPY4,
    _code,
    _collapse,
    _schedule,
    _static_table,
)
from dualpipe_kernels.kernels.parse_race import is_ast_race

__all__ = ["INTERPRETED", "Launch", "prepare", "pack_into", "unpack_into", "rows_per_block", "registers_per_thread",
           "fit_per_sm", "host_only"]  # fmt: skip

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


# ---------------------------------------------------------------- host side
#: bytes of the tensor's side per block (the same for fp32, bf16 and fp16 tensors in a launch of one
#: conversion: 16 rows of 128 fp32, 32 of bf16): a GPU's, and the interpreter's (fewer Python steps)
BLOCK_BYTES_GPU, BLOCK_BYTES_CPU = 8192, 16384
TILE_ROWS_GPU = 16
#: rows of 128 fp32 per block for every launch, instead of the bytes above (``bench kernels --variants``
#: tunes with it; a launch of another element size keeps the same bytes per block)
rows_override: int | None = None


def block_bytes(device: torch.device) -> int:
    """Bytes of the tensor's side per block of a launch on ``device``."""
    if rows_override is not None:
        return rows_override * 128 * 4
    return BLOCK_BYTES_GPU if device.type == "cuda" else BLOCK_BYTES_CPU


def tile_rows(device: torch.device) -> int:
    """Rows of 128 elements a kernel converts at once: a block of more (2-byte or 1-byte elements) is taken as
    several tiles in turn, so a thread holds at most 16 fp32 values of a tile on a GPU (registers)."""
    return TILE_ROWS_GPU if device.type == "cuda" else 64


def rows_per_block(device: torch.device, code: int = COPY4) -> int:
    """Rows of 128 elements per block of a launch of conversion ``code`` (-1: mixed, as for fp32): the block's
    bytes over the element size, at least 4 (so a tensor's padding scales lie in its last block)."""
    itemsize = 4 if code < 0 else CODE_ITEMSIZE[code]
    return max(4, block_bytes(device) // (128 * itemsize))


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
    """A layout's table for one set of strides and device: everything but the addresses and what follows from
    them (which blocks take the fast path, the programs), and the launch's scalar arguments and constexprs."""

    __slots__ = ("layout", "table", "blocks", "iters", "rows", "tile", "contig", "whole", "code", "all_contig", "i32",
                 "n", "kw")  # fmt: skip

    def __init__(self, layout: PackLayout, table: np.ndarray, iters: int, rows: int, tile: int) -> None:
        block = rows * FP8_BLOCK
        self.layout, self.table, self.iters, self.rows, self.tile = layout, table, iters, rows, tile
        self.blocks = int(table[:, _NBLK].sum())
        self.contig = table[:, 5] != 0
        #: whole blocks of each contiguous tensor (what the fast path takes when the tensor is 16 bytes apart
        #: from the buffer)
        self.whole = np.where(self.contig, table[:, 1] // block, 0)
        self.code, self.all_contig, self.i32 = _variant(table, block)
        self.n = len(table)
        #: the constexprs of an unpack launch (a pack launch adds POW2)
        self.kw = {"LOG_N": 0 if self.n == 1 else max(_MIN_LOG_N, math.ceil(math.log2(self.n))), "ROWS": tile,
                   "SUB": rows // tile, "W": _WIDTH, "CODE": self.code, "CONTIG": self.all_contig, "I32": self.i32,
                   "HW": not INTERPRETED, "TAIL": True}  # fmt: skip


#: (id(layout), strides, device, the launch-shape settings) -> _Plan; the plan holds its layout, so an id is
#: never reused while cached
_PLANS: dict[tuple, _Plan] = {}
_MAX_PLANS = 256
_SM_COUNT: dict[int, int] = {}
#: plans made (the per-layout host work: static table, launch shape, variant); a cached call makes none
plan_builds = 0


def _settings() -> tuple:
    """The module settings a plan depends on (tests and ``bench kernels --variants`` change them)."""
    return (iters_override, PROGRAMS_PER_SM, specialize, rows_override)


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


def _launch_code(layout: PackLayout) -> int:
    """The one conversion code of the layout's non-empty tensors, or -1 (mixed, or not specialising)."""
    codes = {_code(e.kind, e.dtype) for e in layout.entries if e.numel}
    return codes.pop() if specialize and len(codes) == 1 else -1


def _plan(tensors: Sequence[torch.Tensor], layout: PackLayout, device: torch.device) -> _Plan:
    global plan_builds
    key = (id(layout), tuple(t.stride() for t in tensors), device, *_settings())
    plan = _PLANS.get(key)
    if plan is None or plan.layout is not layout:
        plan_builds += 1
        rows = rows_per_block(device, _launch_code(layout))
        static = _static_table(tensors, layout, rows * FP8_BLOCK)
        iters = _iters(device, int(static[:, _NBLK].sum()))
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        plan = _PLANS[key] = _Plan(layout, static, iters, rows, min(rows, tile_rows(device)))
    return plan


def _table(
    plan: _Plan, tensors: Sequence[torch.Tensor], buf_addr: int, addrs: np.ndarray | None = None
) -> tuple[np.ndarray, int, int]:
    """(the plan's table with this call's addresses (column 0), offsets from the buffer, fast-path flags and
    programs; fast programs; all programs)."""
    if addrs is None:
        addrs = _addresses(tensors)
    table = plan.table.copy()
    delta = addrs - buf_addr
    table[:, _ADDR] = addrs
    table[:, _DELTA] = delta
    fast = plan.contig & (delta % ALIGN == 0)
    table[:, _FAST] = fast
    nfast, programs = _schedule(table, np.where(fast, plan.whole, 0), plan.iters)
    return table, nfast, programs


def _addresses(tensors: Sequence[torch.Tensor]) -> np.ndarray:
    return np.fromiter((t.data_ptr() for t in tensors), dtype=np.int64, count=len(tensors))


#: (plan id, buffer address, the tensors' addresses, stream) -> (plan, the table on the device, fast programs,
#: programs): the same tensors packed again (a benchmark's loop; a training step whose allocator hands back the
#: same blocks) reuse the table already on the device instead of staging it through pinned memory and copying it
#: again.  A table is a function of its key's contents alone; an entry holds its plan, so the plan's id
#: is not reused while the entry lives, and a stream sees only tables it copied itself (ordered before it).
_TABLES: dict[tuple, tuple[_Plan, torch.Tensor, int, int]] = {}
_MAX_TABLES = 64
#: tables built (host work and a host-to-device copy each on a GPU); a hit in _TABLES builds none
table_builds = 0


def _stream_key(device: torch.device) -> int:
    """The current stream of ``device`` as an int (0 on CPU)."""
    if device.type != "cuda":
        return 0
    return _stream_of(device.index if device.index is not None else torch.cuda.current_device())


def _stream_of(idx: int) -> int:
    """The current stream of GPU ``idx`` as an int."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return int(raw(idx)) if raw is not None else int(torch.cuda.current_stream(idx).cuda_stream)


def _device_table(plan: _Plan, tensors: Sequence[torch.Tensor], buffer: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(this call's table where the kernel reads it (on the buffer's device), fast programs, programs), from
    :data:`_TABLES` when the same addresses were launched on this stream before."""
    global table_builds
    addrs = _addresses(tensors)
    # Under CUDA graph capture the copy below runs only at replay and the table lives in the graph's pool:
    # such a table is neither served nor kept (a later capture or an eager call would read a copy never made)
    capturing = buffer.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    key = (id(plan), buffer.data_ptr(), addrs.tobytes(), _stream_key(buffer.device))
    hit = None if capturing else _TABLES.get(key)
    if hit is not None and hit[0] is plan:
        return hit[1], hit[2], hit[3]
    table, nfast, programs = _table(plan, tensors, buffer.data_ptr(), addrs)
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
        _TABLES[key] = (plan, meta, nfast, programs)
    return meta, nfast, programs


class Launch:
    """One call replayed: a plan's table on the device for one set of addresses (the tensors' and the buffer's)
    and the kernel's arguments, so that a call with the same tensors, buffer and settings is one launch and no
    other host work (:func:`prepare`).  Calling it launches; :meth:`ready` says whether it still applies."""

    __slots__ = ("pack", "meta", "grid", "args", "kw", "settings", "device", "stream")

    def __init__(self, plan: _Plan, meta: torch.Tensor | None, nfast: int, programs: int, pack: bool,
                 device: torch.device, stream: int) -> None:  # fmt: skip
        self.pack, self.meta, self.grid = pack, meta, (programs,)
        self.args = (plan.n, plan.iters, nfast)
        self.kw = {**plan.kw, "POW2": plan.layout.format == "fp8_pow2"} if pack else plan.kw
        self.settings = _settings()
        self.device = device.index if device.type == "cuda" else None
        self.stream = stream

    def ready(self) -> bool:
        """Whether the settings, and on a GPU the current device and stream, are still those it was made for (and
        no CUDA graph is being captured: a capture gets a table of its own)."""
        if self.settings != (iters_override, PROGRAMS_PER_SM, specialize, rows_override):
            return False
        if self.device is None:
            return True
        return (
            torch.cuda.current_device() == self.device
            and not torch.cuda.is_current_stream_capturing()
            and _stream_of(self.device) == self.stream
        )

    def __call__(self, buffer: torch.Tensor) -> None:
        if self.meta is not None and not _host_only:  # None: no blocks (empty tensors), nothing to launch
            kernel = _pack_kernel if self.pack else _unpack_kernel
            try:
                kernel[self.grid](self.meta, buffer, *self.args, **self.kw)
            except Exception as err:  # CPython's AST race in the compile of a first launch (.parse_race)
                if not is_ast_race(err):
                    raise
                kernel[self.grid](self.meta, buffer, *self.args, **self.kw)


def prepare(tensors: Sequence[torch.Tensor], layout: PackLayout, buffer: torch.Tensor, pack: bool) -> Launch | None:
    """The :class:`Launch` of ``pack_into(tensors, layout, buffer)`` (``pack``) or ``unpack_into(buffer, layout,
    tensors)``, or None when such a call cannot be replayed (a tensor goes through a contiguous copy, a CUDA graph
    is being captured, the buffer is on another GPU than the current one)."""
    device = buffer.device  # (a CUDA tensor's device has an index)
    if device.type == "cuda" and (
        device.index != torch.cuda.current_device() or torch.cuda.is_current_stream_capturing()
    ):
        return None
    views = [_as_copyable(t) for t in tensors]
    if any(v is not t and v.data_ptr() != t.data_ptr() for v, t in zip(views, tensors, strict=True)):
        return None
    plan = _plan(views, layout, device)
    if plan.blocks == 0:
        return Launch(plan, None, 0, 0, pack, device, _stream_key(device))
    meta, nfast, programs = _device_table(plan, views, buffer)
    return Launch(plan, meta, nfast, programs, pack, device, _stream_key(device))


def _launch(kernel, tensors: Sequence[torch.Tensor], layout: PackLayout, buffer: torch.Tensor, **kw) -> None:
    device = buffer.device
    plan = _plan(tensors, layout, device)
    if plan.blocks == 0:
        return
    meta, nfast, programs = _device_table(plan, tensors, buffer)
    # Triton launches on the current device; the buffer's may be another (switching costs microseconds)
    other = device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device()
    if _host_only:
        return
    with torch.cuda.device(device) if other else contextlib.nullcontext():
        try:
            kernel[(programs,)](meta, buffer, plan.n, plan.iters, nfast, **plan.kw, **kw)
        except Exception as err:  # CPython's AST race in the compile of a first launch (.parse_race)
            if not is_ast_race(err):
                raise
            kernel[(programs,)](meta, buffer, plan.n, plan.iters, nfast, **plan.kw, **kw)


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
            with torch.no_grad():
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
