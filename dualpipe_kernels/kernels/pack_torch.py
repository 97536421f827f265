"""The torch fallback of pack/unpack: a few torch ops per call, bit-identical to the Triton kernels.

Used on CPU and wherever Triton is missing.  Every conversion is torch's own:
bf16 is ``tensor.to(torch.bfloat16)`` (round to nearest even); fp8 takes each block's
absmax over its finite elements, stores ``scale = absmax / 448`` and casts
``x * (448 / absmax)`` (fp32; the multiplier clamped to the largest finite fp32, so
an all-zero block stays zeros) with torch's fp32 -> float8_e4m3fn cast, which rounds
to nearest even as the GPU's ``cvt.rn.satfinite`` does (the product stays within
448 * (1 + 2^-23), which rounds to 448).  A NaN element is stored as the NaN code
0x7F and an inf saturates to +-448 (it decodes as +- the block's finite absmax); the
rest of its block is quantised as if they were absent.  With
``pow2_scales`` the scale is rounded up to a power of two and the multiplier is
``1 / scale``.  Unpacking casts back with ``copy_``.  A block whose absmax is below
about 2^-119 has a clamped multiplier: it stays finite but loses the
2^-4 * absmax error bound.

Packing writes the buffer with ``torch.cat`` (region bytes and zero padding); small fp8
tensors of a call are quantised together, each padded to whole blocks.  An fp8 tensor
of at least :data:`DIRECT_MIN` elements is quantised straight into its buffer region
instead (and dequantised straight into its output): one absmax pass for the
scales, one multiply, one cast into the buffer, no padding copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from dualpipe_kernels.kernels.layout import ALIGN, FP8_BLOCK, FP8_MAX, KIND_BF16, KIND_COPY, KIND_FP8, Entry, PackLayout

__all__ = ["pack_into", "unpack_into", "fp8_scales", "quantize_fp8", "dequantize_fp8", "DIRECT_MIN"]

_MANTISSA = 0x7FFFFF
#: fp8 tensors of at least this many elements are (de)quantised in place, one by one
DIRECT_MIN = 1 << 14
_FP32_MAX = torch.finfo(torch.float32).max
#: what a NaN element is stored as, and an inf (+-448, with its sign)
_NAN_CODE, _MAX_CODE = 0x7F, 0x7E
#: scales below this may be multiplied by 2^8 without overflow (the dequantisation's fp16 route)
_FP16_ROUTE_MAX_SCALE = 2.0**119


def _region(buffer: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    return buffer[offset : offset + nbytes].view(dtype)


def fp8_scales(blocks: torch.Tensor, pow2: bool) -> torch.Tensor:
    """One fp32 scale per row of ``blocks`` ([num_blocks, 128]): finite absmax / 448, optionally rounded up to 2^k."""
    return _scale_of_absmax(_finite_absmax(blocks)[0], pow2)


def _finite_absmax(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(fp32 absmax of each row over its finite elements, the mask of non-finite elements or None if none)."""
    absmax = blocks.abs().amax(dim=1).to(torch.float32)  # exact in any float dtype; NaN and inf propagate
    if bool(torch.isfinite(absmax).all()):
        return absmax, None
    bad = ~torch.isfinite(blocks)
    return blocks.abs().masked_fill(bad, 0).amax(dim=1).to(torch.float32), bad


def _scale_of_absmax(absmax: torch.Tensor, pow2: bool) -> torch.Tensor:
    scale = absmax / FP8_MAX
    if pow2:
        bits = scale.view(torch.int32)
        up = (bits & ~_MANTISSA) + (_MANTISSA + 1)  # the next power of two (exponent + 1, mantissa 0)
        scale = torch.where((bits & _MANTISSA) != 0, up, bits).view(torch.float32)
    return scale


def _multiplier(absmax: torch.Tensor, scale: torch.Tensor, pow2: bool) -> torch.Tensor:
    """448 / absmax (pow2: 1 / scale), in fp32, clamped to the largest finite fp32 (1 / 0 is inf)."""
    # (a true division: ``c / tensor`` would be reciprocal-then-multiply, rounded twice)
    mult = torch.full_like(scale, 1.0).div_(scale) if pow2 else torch.full_like(absmax, FP8_MAX).div_(absmax)
    return mult.clamp_(max=_FP32_MAX)


def _quantize_blocks(blocks: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, pow2: bool) -> None:
    """Quantise ``blocks`` ([n, 128], fp32/fp16/bf16) into ``codes`` ([n, 128] e4m3) and ``scales`` ([n] fp32).

    bf16/fp16 blocks are multiplied in fp32 by type promotion (exact conversions).
    """
    absmax, bad = _finite_absmax(blocks)
    scale = _scale_of_absmax(absmax, pow2)
    scales.copy_(scale)
    codes.copy_(blocks * _multiplier(absmax, scale, pow2)[:, None])
    if bad is not None:  # torch casts inf to NaN: the kernels' rule is NaN -> 0x7F, +-inf -> +-448
        raw = codes.view(torch.uint8)
        raw.masked_fill_(torch.isnan(blocks), _NAN_CODE)
        raw.masked_fill_(blocks == float("inf"), _MAX_CODE)
        raw.masked_fill_(blocks == float("-inf"), _MAX_CODE | 0x80)


def _quantize_into(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, pow2: bool) -> None:
    """Quantise ``x`` (any shape/strides) into its buffer regions: ``codes`` (numel uint8), ``scales`` (uint8)."""
    flat = x.reshape(-1)
    n = flat.numel()
    full = n - n % FP8_BLOCK
    q, s = codes.view(torch.float8_e4m3fn), scales.view(torch.float32)
    if full:
        _quantize_blocks(flat[:full].view(-1, FP8_BLOCK), q[:full].view(-1, FP8_BLOCK), s[: full // FP8_BLOCK], pow2)
    if full < n:  # the last, short block: zero-padded to a whole one
        tail = F.pad(flat[full:].to(torch.float32), (0, FP8_BLOCK - (n - full))).view(1, FP8_BLOCK)
        tq = torch.empty_like(tail, dtype=torch.float8_e4m3fn)
        _quantize_blocks(tail, tq, s[-1:], pow2)
        q[full:].copy_(tq.view(-1)[: n - full])


def _e4m3_as_fp16(codes: torch.Tensor) -> torch.Tensor:
    """e4m3 codes (uint8) as fp16 values 2^-8 times theirs: the code's bits shifted into an fp16.

    Exact for every code but NaN (0x7F, 0xFF): e4m3's 4 exponent bits (bias 7) and 3 mantissa bits
    land in fp16's 5 exponent bits (bias 15) and top mantissa bits, subnormals included, which
    scales every value by 2^(7 - 15).  Far faster on CPU than torch's element-wise fp8 cast.
    """
    wide = codes.to(torch.int16) << 8  # sign in bit 15, exponent and mantissa in bits 14..8
    return ((wide >> 1) & ~0x4000).view(torch.float16)  # arithmetic shift: clear the copied sign


def _dequantize_into(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """Fill ``out`` (any shape/strides) with the fp32 values of ``codes`` (uint8) times ``scales`` (uint8 of fp32).

    Bit for bit ``codes.to(float32) * scale``: the fp16 route multiplies by ``scale * 2^8`` instead,
    which is exact while |scale| < 2^119 and rounds the same product once.
    """
    s = scales.view(torch.float32)
    n = codes.numel()
    full = n - n % FP8_BLOCK
    direct = out.is_contiguous() and out.dtype == torch.float32
    flat = out.view(-1) if direct else torch.empty(n, dtype=torch.float32, device=out.device)
    # NaN codes (torch's own cast keeps their bits) or a scale whose 2^8 multiple would overflow
    # (a power-of-two scale rounded up to 2^120, or inf / NaN): the exact element-wise cast.
    if n and (int((codes & 0x7F).amax()) == 0x7F or not bool(s.abs().amax() < _FP16_ROUTE_MAX_SCALE)):
        flat.copy_(codes.view(torch.float8_e4m3fn))
        factor = s
    else:
        flat.copy_(_e4m3_as_fp16(codes))
        factor = s * 256.0
    if full:
        flat[:full].view(-1, FP8_BLOCK).mul_(factor[: full // FP8_BLOCK, None])
    if full < n:
        flat[full:].mul_(factor[-1])
    if not direct:
        out.copy_(flat.view(out.shape))


def _direct(e: Entry) -> bool:
    return e.kind == KIND_FP8 and e.numel >= DIRECT_MIN


def _batched(e: Entry) -> bool:
    return e.kind == KIND_FP8 and 0 < e.numel < DIRECT_MIN


def _fp8_regions(buffer: torch.Tensor, e: Entry) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of fp8 entry ``e``: uint8 views of ``buffer``."""
    return buffer.narrow(0, e.offset, e.nbytes), buffer.narrow(0, e.scale_offset, 4 * e.num_scales)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """``x`` flattened to fp32, zero-padded to whole blocks of FP8_BLOCK: [num_blocks, FP8_BLOCK]."""
    flat = x.reshape(-1).to(torch.float32)
    return F.pad(flat, (0, -flat.numel() % FP8_BLOCK)).view(-1, FP8_BLOCK)


def quantize_fp8(x: torch.Tensor, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes of ``x`` flattened, [numel]; fp32 scales, [ceil(numel / 128)])."""
    blocks = _blocks(x)
    q = torch.empty_like(blocks, dtype=torch.float8_e4m3fn)
    scale = torch.empty(blocks.shape[0], dtype=torch.float32, device=blocks.device)
    _quantize_blocks(blocks, q, scale, pow2)
    return q.view(-1)[: x.numel()], scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values of e4m3 codes ``q`` ([numel]) times their block's scale: [numel]."""
    vals = F.pad(q.to(torch.float32), (0, -q.numel() % FP8_BLOCK)).view(-1, FP8_BLOCK)
    return (vals * scale[:, None]).view(-1)[: q.numel()]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _quantize_all(tensors: Sequence[torch.Tensor], entries: Sequence[Entry], pow2: bool) -> list[list[torch.Tensor]]:
    """[codes bytes, scales bytes] of every fp8 entry, quantised together (one pass, not one per tensor).

    Each tensor is zero-padded to whole blocks before the concatenation, so no block spans two tensors.
    """
    chosen = [(t, e) for t, e in zip(tensors, entries, strict=True) if _batched(e)]
    if not chosen:
        return []
    zeros = torch.zeros(FP8_BLOCK, dtype=torch.float32, device=chosen[0][0].device)
    pieces: list[torch.Tensor] = []
    for t, e in chosen:
        pieces += [t.reshape(-1).to(torch.float32), zeros.narrow(0, 0, -e.numel % FP8_BLOCK)]
    q, scale = quantize_fp8(torch.cat(pieces), pow2)
    q = q.view(torch.uint8)
    out, block = [], 0
    for _, e in chosen:
        n = e.num_scales
        out.append([q.narrow(0, block * FP8_BLOCK, e.numel), _bytes(scale.narrow(0, block, n))])
        block += n
    return out


def pack_into(tensors: Sequence[torch.Tensor], layout: PackLayout, buffer: torch.Tensor) -> None:
    """Write ``tensors`` into ``buffer`` (1-D uint8, exactly ``layout.nbytes`` long) as ``layout`` says.

    One ``torch.cat`` of every region's bytes and the zero padding writes the buffer between the
    fp8 tensors quantised in place (the casts make temporaries first); per-tensor copies cost more
    in Python than in bytes moved.
    """
    pow2 = layout.format == "fp8_pow2"
    fp8 = iter(_quantize_all(tensors, layout.entries, pow2))
    zeros = torch.zeros(ALIGN, dtype=torch.uint8, device=buffer.device)
    parts: list[torch.Tensor] = []
    start = 0  # where the bytes in ``parts`` begin

    def flush(end: int) -> None:
        if end > start:
            torch.cat(parts, out=buffer[start:end])
        parts.clear()

    for t, e in zip(tensors, layout.entries, strict=True):
        if e.numel == 0:
            pass
        elif e.kind == KIND_COPY:
            parts.append(_bytes(t))
        elif e.kind == KIND_BF16:
            parts.append(_bytes(t.to(torch.bfloat16)))
        elif _direct(e):
            flush(e.offset)
            _quantize_into(t, *_fp8_regions(buffer, e), pow2)
            buffer[e.offset + e.nbytes : e.scale_offset].zero_()
            start = e.end
        else:
            codes, scales = next(fp8)
            parts += [codes, zeros.narrow(0, 0, e.scale_offset - e.offset - e.nbytes), scales]
        if e.end % ALIGN:
            parts.append(zeros.narrow(0, 0, -e.end % ALIGN))
    flush(buffer.numel())


def _dequantize_all(buffer: torch.Tensor, entries: Sequence[Entry]) -> list[torch.Tensor]:
    """fp32 values of every fp8 entry (flat), dequantised together; the inverse of :func:`_quantize_all`."""
    chosen = [e for e in entries if _batched(e)]
    if not chosen:
        return []
    zeros = torch.zeros(FP8_BLOCK, dtype=torch.uint8, device=buffer.device)
    codes: list[torch.Tensor] = []
    for e in chosen:
        codes += [buffer.narrow(0, e.offset, e.nbytes), zeros.narrow(0, 0, -e.numel % FP8_BLOCK)]
    scales = torch.cat([buffer.narrow(0, e.scale_offset, 4 * e.num_scales) for e in chosen]).view(torch.float32)
    vals = dequantize_fp8(torch.cat(codes).view(torch.float8_e4m3fn), scales)
    out, block = [], 0
    for e in chosen:
        out.append(vals.narrow(0, block * FP8_BLOCK, e.numel))
        block += e.num_scales
    return out


def unpack_into(buffer: torch.Tensor, layout: PackLayout, outs: Sequence[torch.Tensor]) -> None:
    """Fill ``outs`` (one tensor per entry, the entry's shape and dtype, any strides) from ``buffer``."""
    fp8 = iter(_dequantize_all(buffer, layout.entries))
    for e, out in zip(layout.entries, outs, strict=True):
        if e.numel == 0:
            continue
        if _direct(e):
            _dequantize_into(*_fp8_regions(buffer, e), out)
        elif e.kind == KIND_FP8:
            out.copy_(next(fp8).view(e.shape))
        else:
            stored = e.dtype if e.kind == KIND_COPY else torch.bfloat16
            out.copy_(_region(buffer, e.offset, e.nbytes, stored).view(e.shape))
