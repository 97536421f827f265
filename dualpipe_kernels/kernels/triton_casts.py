"""The pack kernels' conversions, as Triton device functions.

fp8 (e4m3fn, one fp32 scale per row of 128 elements): the row's absmax is taken
over its *finite* elements; the stored scale is ``absmax / 448`` and the elements
are multiplied (not divided) by ``448 / absmax`` in fp32, then cast to e4m3 with
round-to-nearest-even, saturating at +-448.  A NaN element becomes the NaN code
0x7F and an inf saturates to +-448 (decoding as +- the row's finite absmax); the
rest of the row is quantised as if they were absent.  With ``pow2`` the scale
is rounded up to a power of two and the multiplier is ``1 / scale``.  A
multiplier that overflows fp32 (absmax below about 2^-119, or 0) is clamped to
the largest finite fp32, so an all-zero row stays zeros.

``HW`` (compiled for a GPU): the casts are the hardware's (``cvt.rn.satfinite``
for fp32 -> e4m3, ``cvt.rn`` for fp32 -> bf16, exact e4m3 -> fp32); otherwise (``TRITON_INTERPRET=1``,
whose casts truncate or lose carries) the rounding is done explicitly on the
fp32 bit patterns: round-to-nearest-even of 3 mantissa bits, subnormals
rounded by adding 2^14 in fp32 (whose ulp, 2^-9, is the e4m3 subnormal step).
Both give what torch's own fp32 -> float8_e4m3fn cast gives for every finite
product (which stays within +-448 * (1 + 2^-23)), and round bf16 to nearest even.
NaN payloads are not matched (a NaN fp8 element is always the code 0x7F).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["bf16_bits", "bf16_cast", "bf16_value", "e4m3_bits", "e4m3_value", "fp8_codes", "fp8_value", "quantize_e4m3"]

#: the largest finite fp32 (a multiplier's clamp)
_FP32_MAX = tl.constexpr(3.4028234663852886e38)


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
    """Round-to-nearest-even float8 e4m3fn code (uint8) of fp32 ``q``, saturated to +-448 (explicit rounding)."""
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
    """fp32 value of float8 e4m3fn codes (uint8), exact (0x7F / 0xFF are NaN; explicit decoding)."""
    b = code.to(tl.uint32)
    e = (b >> 3) & 15
    m = b & 7
    normal = ((e + 120) << 23) | (m << 20)
    sub = (m.to(tl.float32) * 0.001953125).to(tl.uint32, bitcast=True)
    # the sign goes in as a bit: compiled Triton negates as 0 - x, which turns the code 0x80 into +0.0
    val = (tl.where(e == 0, sub, normal) | ((b & 0x80) << 24)).to(tl.float32, bitcast=True)
    return tl.where((b & 0x7F) == 0x7F, float("nan"), val)


@triton.jit
def fp8_codes(q, HW: tl.constexpr):
    """e4m3fn codes (uint8) of fp32 ``q`` with |q| <= 448 (1 + 2^-23), rounded to nearest even."""
    if HW:
        codes = q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        codes = e4m3_bits(q)
    return codes


@triton.jit
def fp8_value(code, HW: tl.constexpr):
    """fp32 values of e4m3fn codes (uint8), exact."""
    if HW:
        val = code.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        val = e4m3_value(code)
    return val


@triton.jit
def bf16_cast(x, HW: tl.constexpr):
    """Round-to-nearest-even bfloat16 bits (uint16) of fp32 ``x`` (the hardware's cast when ``HW``)."""
    if HW:
        bits = x.to(tl.bfloat16).to(tl.uint16, bitcast=True)
    else:
        bits = bf16_bits(x)
    return bits


@triton.jit
def quantize_e4m3(x, POW2: tl.constexpr, HW: tl.constexpr):
    """(e4m3 codes of the [ROWS, 128] fp32 tile ``x``, one fp32 scale per row = finite absmax / 448).

    A NaN element's product is NaN (code 0x7F), an inf's is inf, which saturates to +-448; the
    absmax leaves both out, so the row's other elements are quantised as if they were absent."""
    a = tl.abs(x)
    amax = tl.max(tl.where(a < float("inf"), a, 0.0), axis=1)  # false for NaN and +-inf
    scale = tl.math.div_rn(amax, 448.0)
    if POW2:
        bits = scale.to(tl.uint32, bitcast=True)
        up = (bits & 0xFF800000) + 0x800000
        scale = tl.where((bits & 0x7FFFFF) != 0, up, bits).to(tl.float32, bitcast=True)
        num, den = tl.full(scale.shape, 1.0, tl.float32), scale
    else:
        num, den = tl.full(amax.shape, 448.0, tl.float32), amax
    # an all-zero row: the largest finite fp32, as the overflowing quotient below (its elements are +-0 either way)
    mult = tl.where(den > 0.0, tl.math.div_rn(num, tl.where(den > 0.0, den, 1.0)), _FP32_MAX)
    mult = tl.minimum(mult, _FP32_MAX)  # a quotient past fp32 (absmax below about 2^-119)
    return fp8_codes(x * mult[:, None], HW), scale
