"""The torch fallback of pack/unpack: a loop of torch ops, bit-identical to the Triton kernels.

Used on CPU and wherever Triton is missing.  Every conversion is torch's own:
bf16 is ``tensor.to(torch.bfloat16)`` (round to nearest even), fp8 is
``(x / scale).clamp(-448, 448).to(torch.float8_e4m3fn)`` with ``scale = block absmax / 448``
in fp32 (the clamp only matters when the scale is subnormal; otherwise the
quotient is already within range), and unpacking casts back with ``copy_``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from dualpipe_kernels.kernels.layout import ALIGN, FP8_BLOCK, FP8_MAX, KIND_BF16, KIND_COPY, Entry, PackLayout

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


def _packed_parts(t: torch.Tensor, e: Entry, pow2: bool) -> list[torch.Tensor]:
    """The bytes of one entry's region(s), in buffer order (zero padding not included)."""
    if e.kind == KIND_COPY:
        return [_bytes(t)]
    if e.kind == KIND_BF16:
        return [_bytes(t.to(torch.bfloat16))]
    q, scale = quantize_fp8(t, pow2)
    pad = torch.zeros(e.scale_offset - e.offset - e.nbytes, dtype=torch.uint8, device=t.device)
    return [_bytes(q), pad, _bytes(scale)]


def pack_into(tensors: Sequence[torch.Tensor], layout: PackLayout, buffer: torch.Tensor) -> None:
    """Write ``tensors`` into ``buffer`` (1-D uint8, exactly ``layout.nbytes`` long) as ``layout`` says.

    One ``torch.cat`` of every region's bytes and the zero padding writes the whole buffer (the
    casts make temporaries first); per-tensor copies cost more in Python than in bytes moved.
    """
    pow2 = layout.format == "fp8_pow2"
    zeros = torch.zeros(16, dtype=torch.uint8, device=buffer.device)
    parts: list[torch.Tensor] = []
    for t, e in zip(tensors, layout.entries, strict=True):
        if e.numel:
            parts += _packed_parts(t, e, pow2)
        pad = -e.end % ALIGN
        if pad:
            parts.append(zeros.narrow(0, 0, pad))
    if parts:  # all tensors empty: a 0-byte buffer
        torch.cat(parts, out=buffer)


def _unpack_one(buffer: torch.Tensor, e: Entry, out: torch.Tensor) -> None:
    if e.kind == KIND_COPY:
        out.copy_(_region(buffer, e.offset, e.nbytes, e.dtype).view(e.shape))
    elif e.kind == KIND_BF16:
        out.copy_(_region(buffer, e.offset, e.nbytes, torch.bfloat16).view(e.shape))
    else:
        q = _region(buffer, e.offset, e.nbytes, torch.float8_e4m3fn)
        scale = _region(buffer, e.scale_offset, 4 * e.num_scales, torch.float32)
        out.copy_(dequantize_fp8(q, scale).view(e.shape))


def unpack_into(buffer: torch.Tensor, layout: PackLayout, outs: Sequence[torch.Tensor]) -> None:
    """Fill ``outs`` (one tensor per entry, the entry's shape and dtype, any strides) from ``buffer``."""
    for e, out in zip(layout.entries, outs, strict=True):
        if e.numel:
            _unpack_one(buffer, e, out)
