"""The Triton device code of pack/unpack: :func:`pack_kernel`, :func:`unpack_kernel` and their helpers.

One program takes runs of blocks of one tensor, found by a binary search over the launch table
(:mod:`.pack_table`: one int64 row per tensor); the host side that builds the table, picks the variant
(constexprs) and launches is :mod:`.pack_triton`, which describes the design.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dualpipe_kernels.kernels.triton_casts import bf16_cast, bf16_value, fp8_value, quantize_e4m3

__all__ = ["pack_kernel", "unpack_kernel"]


# ---------------------------------------------------------------- device helpers
@triton.jit
def _find_tensor(table, pid, n, COL: tl.constexpr, LOG_N: tl.constexpr, W: tl.constexpr):
    """The last tensor whose first program (column ``COL``) is <= pid (tensors without programs there are
    skipped by construction)."""
    lo = pid * 0
    for k in tl.static_range(LOG_N):
        cand = lo + (1 << (LOG_N - 1 - k))
        first = tl.load(table + cand * W + COL, mask=cand < n, other=pid + 1)
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
def _load_float(base, off, mask, code, FAST: tl.constexpr):
    """fp32 values of a tile of the tensor (fp32, fp16 or bf16 by conversion ``code``)."""
    if code == 4 or code == 6:
        x = _ld(base.to(tl.pointer_type(tl.float32), bitcast=True) + off, mask, FAST)
    elif code == 5 or code == 7:
        x = _ld(base.to(tl.pointer_type(tl.float16), bitcast=True) + off, mask, FAST).to(tl.float32)
    else:
        x = bf16_value(_ld(base.to(tl.pointer_type(tl.uint16), bitcast=True) + off, mask, FAST))
    return x


@triton.jit
def _store_float(base, off, x, mask, code, FAST: tl.constexpr, HW: tl.constexpr):
    """Store fp32 ``x`` into a tile of the tensor in its dtype (fp32, fp16 or bf16 by ``code``)."""
    if code == 4 or code == 6:
        _st(base.to(tl.pointer_type(tl.float32), bitcast=True) + off, x, mask, FAST)
    elif code == 5 or code == 7:
        _st(base.to(tl.pointer_type(tl.float16), bitcast=True) + off, x.to(tl.float16), mask, FAST)
    else:
        _st(base.to(tl.pointer_type(tl.uint16), bitcast=True) + off, bf16_cast(x, HW), mask, FAST)


@triton.jit
def _block_index(blk, ROWS: tl.constexpr):
    """Row-major element indices of block ``blk``: [ROWS, 128]."""
    return blk * (ROWS * 128) + tl.arange(0, ROWS)[:, None] * 128 + tl.arange(0, 128)[None, :]


# ---------------------------------------------------------------- the fast path: whole, aligned blocks
@triton.jit
def _pack_fast(src, dst, scl, blk, code, ROWS: tl.constexpr, POW2: tl.constexpr, HW: tl.constexpr):
    """Pack whole block ``blk`` of a contiguous tensor at byte pointer ``src`` into its region ``dst`` (scales at
    fp32 pointer ``scl``): no masks, both 16-byte aligned, so accesses are 16 bytes a thread."""
    local = _block_index(blk, ROWS)
    if code < 4:
        _copy_bits(src, local, dst, local, local, local, code, True)
    else:
        x = _load_float(src, local, local, code, True)
        if code == 4 or code == 5:
            tl.store(dst.to(tl.pointer_type(tl.uint16), bitcast=True) + local, bf16_cast(x, HW))
        else:
            q, scale = quantize_e4m3(x, POW2, HW)
            tl.store(dst + local, q)
            tl.store(scl + blk * ROWS + tl.arange(0, ROWS), scale)


@triton.jit
def _unpack_fast(src, dst, scl, blk, code, ROWS: tl.constexpr, HW: tl.constexpr):
    """Unpack whole block ``blk`` of region ``src`` into the contiguous tensor at ``dst`` (as :func:`_pack_fast`)."""
    local = _block_index(blk, ROWS)
    if code < 4:
        _copy_bits(src, local, dst, local, local, local, code, True)
    else:
        if code == 4 or code == 5:
            x = bf16_value(tl.load(src.to(tl.pointer_type(tl.uint16), bitcast=True) + local))
        else:
            scale = tl.load(scl + blk * ROWS + tl.arange(0, ROWS))
            x = fp8_value(tl.load(src + local), HW) * scale[:, None]
        _store_float(dst, local, x, local, code, True, HW)


@triton.jit
def _fast_block(tensor, region, scl, blk, code, ROWS: tl.constexpr, SUB: tl.constexpr, POW2: tl.constexpr,
                PACK: tl.constexpr, CODE: tl.constexpr, HW: tl.constexpr):  # fmt: skip
    """One whole block (``SUB`` tiles of ``ROWS`` rows) on the fast path; ``CODE`` >= 0: the launch's one
    conversion (only it is compiled), -1: ``code`` (read from the table)."""
    for h in tl.static_range(SUB):
        if PACK:
            if CODE >= 0:
                _pack_fast(tensor, region, scl, blk * SUB + h, CODE, ROWS, POW2, HW)
            else:
                _pack_fast(tensor, region, scl, blk * SUB + h, code, ROWS, POW2, HW)
        else:
            if CODE >= 0:
                _unpack_fast(region, tensor, scl, blk * SUB + h, CODE, ROWS, HW)
            else:
                _unpack_fast(region, tensor, scl, blk * SUB + h, code, ROWS, HW)


# ---------------------------------------------------------------- the masked path: tails, strided, misaligned
@triton.jit
def _tile(row, buf, blk, ROWS: tl.constexpr, CONTIG: tl.constexpr):
    """(tensor base as a byte pointer, row-major indices of this block, their element offsets, mask,
    the tensor's region in the buffer as a byte pointer).  ``CONTIG``: every tensor of the launch is
    contiguous (the strided index arithmetic is not compiled)."""
    local = _block_index(blk, ROWS)
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
def _pack_tile(row, buf, blk, code, ROWS: tl.constexpr, POW2: tl.constexpr, CONTIG: tl.constexpr, HW: tl.constexpr):
    base, local, src, mask, dst = _tile(row, buf, blk, ROWS, CONTIG)
    # stores run on to the region's aligned end, so the padding gets zeros (masked loads there give 0)
    smask = local < tl.load(row + 14).to(local.dtype)
    if code < 4:
        _copy_bits(base, src, dst, local, mask, smask, code, False)
    else:
        x = _load_float(base, src, mask, code, False)
        if code == 4 or code == 5:
            tl.store(dst.to(tl.pointer_type(tl.uint16), bitcast=True) + local, bf16_cast(x, HW), mask=smask)
        else:
            scale_idx, scale_dst = _scales(row, buf, blk, ROWS)
            q, scale = quantize_e4m3(x, POW2, HW)
            tl.store(dst + local, q, mask=smask)
            tl.store(scale_dst + scale_idx, scale, mask=scale_idx < tl.load(row + 15).to(scale_idx.dtype))


@triton.jit
def _unpack_tile(row, buf, blk, code, ROWS: tl.constexpr, CONTIG: tl.constexpr, HW: tl.constexpr):
    base, local, dst, mask, src = _tile(row, buf, blk, ROWS, CONTIG)
    if code < 4:
        _copy_bits(src, local, base, dst, mask, mask, code, False)
    else:
        if code == 4 or code == 5:
            x = bf16_value(tl.load(src.to(tl.pointer_type(tl.uint16), bitcast=True) + local, mask=mask, other=0))
        else:
            scale_idx, scales = _scales(row, buf, blk, ROWS)
            scale = tl.load(scales + scale_idx, mask=scale_idx * 128 < tl.load(row + 1).to(scale_idx.dtype), other=0)
            x = fp8_value(tl.load(src + local, mask=mask, other=0), HW) * scale[:, None]
        _store_float(base, dst, x, mask, code, False, HW)


@triton.jit
def _slow_block(row, buf, blk, ROWS: tl.constexpr, SUB: tl.constexpr, POW2: tl.constexpr, PACK: tl.constexpr,
                CODE: tl.constexpr, CONTIG: tl.constexpr, HW: tl.constexpr):  # fmt: skip
    """One block on the masked path (``CODE`` as in :func:`_fast_block`): ``2 * SUB`` tiles of ``ROWS // 2`` rows in
    a loop that is not unrolled (masks and strided offsets take registers: one small tile's at a time)."""
    for h in range(0, 2 * SUB):
        if PACK:
            if CODE >= 0:
                _pack_tile(row, buf, blk * (2 * SUB) + h, CODE, ROWS // 2, POW2, CONTIG, HW)
            else:
                _pack_tile(row, buf, blk * (2 * SUB) + h, tl.load(row + 4), ROWS // 2, POW2, CONTIG, HW)
        else:
            if CODE >= 0:
                _unpack_tile(row, buf, blk * (2 * SUB) + h, CODE, ROWS // 2, CONTIG, HW)
            else:
                _unpack_tile(row, buf, blk * (2 * SUB) + h, tl.load(row + 4), ROWS // 2, CONTIG, HW)


# ---------------------------------------------------------------- kernels
@triton.jit
def _blocks(table, buf, n, iters, fast_programs, LOG_N: tl.constexpr, ROWS: tl.constexpr, SUB: tl.constexpr,
            W: tl.constexpr,
            POW2: tl.constexpr, PACK: tl.constexpr, CODE: tl.constexpr, CONTIG: tl.constexpr, I32: tl.constexpr,
            HW: tl.constexpr, TAIL: tl.constexpr):  # fmt: skip
    """One program.  The first ``fast_programs`` take runs of up to ``iters`` whole blocks of a contiguous
    tensor 16 bytes apart from the buffer (the row's fields read once, before the loop; no masks); the rest
    take runs of the other blocks (a tensor's last, partial block, strided or misaligned tensors), masked.
    ``TAIL`` False leaves the masked path out (the offline analysis of the fast path alone)."""
    pid = tl.program_id(0).to(tl.int64)
    if pid < fast_programs:
        row = table + _find_tensor(table, pid, n, 13, LOG_N, W) * W
        first = (pid - tl.load(row + 13)) * iters
        nfast = tl.load(row + 20)
        # contiguous and 16 bytes apart from the buffer: addressed from the buffer pointer with `// 16 * 16`
        # offsets, so the compiler knows the alignment and vectorises
        tensor = buf + tl.load(row + 17) // 16 * 16
        region = buf + tl.load(row + 2) // 16 * 16
        scl = (buf + tl.load(row + 3) // 16 * 16).to(tl.pointer_type(tl.float32), bitcast=True)
        code = tl.load(row + 4)
        for it in range(0, iters):
            blk = first + it
            if I32:  # block indices, element indices and offsets in int32 (the host checked they fit)
                blk = blk.to(tl.int32)
            if blk < nfast:
                _fast_block(tensor, region, scl, blk, code, ROWS, SUB, POW2, PACK, CODE, HW)
    elif TAIL:
        row = table + _find_tensor(table, pid, n, 19, LOG_N, W) * W
        first = tl.load(row + 20) + (pid - tl.load(row + 19)) * iters
        nblk = tl.load(row + 18)
        for it in range(0, iters):
            blk = first + it
            if I32:
                blk = blk.to(tl.int32)
            if blk < nblk:
                _slow_block(row, buf, blk, ROWS, SUB, POW2, PACK, CODE, CONTIG, HW)


@triton.jit(do_not_specialize=["n", "iters", "fast_programs"])
def pack_kernel(table, buf, n, iters, fast_programs, LOG_N: tl.constexpr, ROWS: tl.constexpr, SUB: tl.constexpr,
                W: tl.constexpr, POW2: tl.constexpr, CODE: tl.constexpr, CONTIG: tl.constexpr, I32: tl.constexpr,
                 HW: tl.constexpr, TAIL: tl.constexpr):  # fmt: skip
    _blocks(table, buf, n, iters, fast_programs, LOG_N, ROWS, SUB, W, POW2, True, CODE, CONTIG, I32, HW, TAIL)


@triton.jit(do_not_specialize=["n", "iters", "fast_programs"])
def unpack_kernel(table, buf, n, iters, fast_programs, LOG_N: tl.constexpr, ROWS: tl.constexpr,
                   SUB: tl.constexpr, W: tl.constexpr, CODE: tl.constexpr, CONTIG: tl.constexpr, I32: tl.constexpr,
                   HW: tl.constexpr, TAIL: tl.constexpr):  # fmt: skip
    _blocks(table, buf, n, iters, fast_programs, LOG_N, ROWS, SUB, W, False, False, CODE, CONTIG, I32, HW, TAIL)
