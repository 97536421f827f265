"""The pack kernels' conversions, as Triton device functions: explicit rounding on fp32 bit patterns.

Results do not depend on the backend's casts (the interpreter truncates
fp32 -> bf16 and misrounds fp32 -> e4m3 across a power of two): bf16 is
round-to-nearest-even of the top 16 bits; e4m3 is round-to-nearest-even of 3
mantissa bits, with subnormals rounded by adding 2^14 in fp32 (whose ulp, 2^-9,
is the e4m3 subnormal step).  Divisions use ``div_rn`` (IEEE), as torch does.
NaN payloads are not matched.  Used by :mod:`.pack_triton`; they run compiled
and under ``TRITON_INTERPRET=1`` alike.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["bf16_bits", "bf16_value", "e4m3_bits", "e4m3_value", "quantize_e4m3"]


@triton.jit
def bf16_bits(x):
    """Round-to-nearest-even bfloat16 bits (uint16) of fp32 ``x``; NaN -> 0xFFFF as torch's CPU cast."""
    u = x.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    r = tl.where(x != x, 0xFFFF, r)
    return r.to(tl.uint16)


@triton.jit
def bf16_value(bits):
    """fp32 value of bfloat16 bits (uint16), exact."""
    return (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def e4m3_bits(q):
    """Round-to-nearest-even float8 e4m3fn code (uint8) of fp32 ``q``, saturated to +-448."""
    nan = q != q
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    u = q.to(tl.uint32, bitcast=True)
    sign = (u >> 24) & 0x80
    a_bits = u & 0x7FFFFFFF
    normal = ((a_bits + 0x7FFFF + ((a_bits >> 20) & 1)) >> 20) - (120 << 3)
    # below 2^-6 (exponent 121): adding 2^14 leaves round(a / 2^-9) in the low mantissa bits
    a = a_bits.to(tl.float32, bitcast=True)
    sub = (a + 16384.0).to(tl.uint32, bitcast=True) - 0x46800000
    code = tl.where(a_bits < (121 << 23), sub, normal) | sign
    code = tl.where(nan, 0x7F, code)
    return code.to(tl.uint8)


@triton.jit
def e4m3_value(code):
    """fp32 value of float8 e4m3fn codes (uint8), exact (0x7F / 0xFF are NaN)."""
    b = code.to(tl.uint32)
    e = (b >> 3) & 15
    m = b & 7
    normal = ((e + 120) << 23) | (m << 20)
    sub = (m.to(tl.float32) * 0.001953125).to(tl.uint32, bitcast=True)
    # the sign goes in as a bit: compiled Triton negates as 0 - x, which turns the code 0x80 into +0.0
    val = (tl.where(e == 0, sub, normal) | ((b & 0x80) << 24)).to(tl.float32, bitcast=True)
    return tl.where((b & 0x7F) == 0x7F, float("nan"), val)


@triton.jit
def quantize_e4m3(x, POW2: tl.constexpr):
    """(e4m3 codes of the [ROWS, 128] fp32 tile ``x``, one fp32 scale per row = row absmax / 448)."""
    scale = tl.math.div_rn(tl.max(tl.abs(x), axis=1), 448.0)
    if POW2:
        bits = scale.to(tl.uint32, bitcast=True)
        up = (bits & 0xFF800000) + 0x800000
        scale = tl.where((bits & 0x7FFFFF) != 0, up, bits).to(tl.float32, bitcast=True)
    divisor = tl.where(scale == 0.0, 1.0, scale)
    return e4m3_bits(tl.math.div_rn(x, divisor[:, None])), scale
