"""The torch fallback of pack/unpack: a few torch ops per call, bit-identical to the Triton kernels.

Used on CPU and wherever Triton is missing.  Every conversion is torch's own:
bf16 is ``tensor.to(torch.bfloat16)`` (round to nearest even), fp8 is
``(x / scale).clamp(-448, 448).to(torch.float8_e4m3fn)`` with ``scale = block absmax / 448``
in fp32, and unpacking casts back with ``copy_``.  The clamp only matters when the
scale is an fp32 subnormal (block absmax below 448 * 2^-126): the quotient can then
exceed 448; such blocks stay finite but lose the 2^-4 * absmax error bound.

Packing writes the whole buffer with one ``torch.cat`` (region bytes and zero padding);
all fp8 tensors of a call are quantised in one pass, each padded to whole blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from dualpipe_kernels.kernels.layout import ALIGN, FP8_BLOCK, FP8_MAX, KIND_BF16, KIND_COPY, KIND_FP8, Entry, PackLayout

__all__ = ["pack_into", "unpack_into", "fp8_scales", "quantize_fp8", "dequantize_fp8"]

_MANTISSA = 0x7FFFFF


def _region(buffer: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    return buffer[offset : offset + nbytes].view(dtype)


def fp8_scales(blocks: torch.Tensor, pow2: bool) -> torch.Tensor:
    """One fp32 scale per row of ``blocks`` ([num_blocks, 128] fp32): absmax / 448, optionally rounded up to 2^k."""
    scale = blocks.abs().amax(dim=1) / FP8_MAX
    if pow2:
        bits = scale.view(torch.int32)
        up = (bits & ~_MANTISSA) + (_MANTISSA + 1)  # the next power of two (exponent + 1, mantissa 0)
        scale = torch.where((bits & _MANTISSA) != 0, up, bits).view(torch.float32)
    return scale


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """``x`` flattened to fp32, zero-padded to whole blocks of FP8_BLOCK: [num_blocks, FP8_BLOCK]."""
    flat = x.reshape(-1).to(torch.float32)
    return F.pad(flat, (0, -flat.numel() % FP8_BLOCK)).view(-1, FP8_BLOCK)


def quantize_fp8(x: torch.Tensor, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes of ``x`` flattened, [numel]; fp32 scales, [ceil(numel / 128)])."""
    blocks = _blocks(x)
    scale = fp8_scales(blocks, pow2)
    divisor = torch.where(scale == 0, torch.ones_like(scale), scale)  # an all-zero block stays zeros
    q = (blocks / divisor[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
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
    chosen = [(t, e) for t, e in zip(tensors, entries, strict=True) if e.kind == KIND_FP8 and e.numel]
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

    One ``torch.cat`` of every region's bytes and the zero padding writes the whole buffer (the
    casts make temporaries first); per-tensor copies cost more in Python than in bytes moved.
    """
    fp8 = iter(_quantize_all(tensors, layout.entries, layout.format == "fp8_pow2"))
    zeros = torch.zeros(ALIGN, dtype=torch.uint8, device=buffer.device)
    parts: list[torch.Tensor] = []
    for t, e in zip(tensors, layout.entries, strict=True):
        if e.numel == 0:
            pass
        elif e.kind == KIND_COPY:
            parts.append(_bytes(t))
        elif e.kind == KIND_BF16:
            parts.append(_bytes(t.to(torch.bfloat16)))
        else:
            codes, scales = next(fp8)
            parts += [codes, zeros.narrow(0, 0, e.scale_offset - e.offset - e.nbytes), scales]
        if e.end % ALIGN:
            parts.append(zeros.narrow(0, 0, -e.end % ALIGN))
    if parts:  # all tensors empty: a 0-byte buffer
        torch.cat(parts, out=buffer)


def _dequantize_all(buffer: torch.Tensor, entries: Sequence[Entry]) -> list[torch.Tensor]:
    """fp32 values of every fp8 entry (flat), dequantised together; the inverse of :func:`_quantize_all`."""
    chosen = [e for e in entries if e.kind == KIND_FP8 and e.numel]
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
        if e.kind == KIND_FP8:
            out.copy_(next(fp8).view(e.shape))
        else:
            stored = e.dtype if e.kind == KIND_COPY else torch.bfloat16
            out.copy_(_region(buffer, e.offset, e.nbytes, stored).view(e.shape))
