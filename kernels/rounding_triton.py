"""Triton device functions that round as the PyTorch references do, shared by every op's Triton kernels:
round half to even, the saturating float8 e4m3fn cast and the bfloat16 cast (exact in the interpreter too), a float32
value rounded to a narrower float dtype and back, and IEEE division with one reciprocal per divisor."""

import torch
import triton
import triton.language as tl

# _round_to's ``ROUND`` id of each dtype it rounds to (float32: no rounding)
ROUND_TO = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
ROUND_TO_BF16 = tl.constexpr(ROUND_TO[torch.bfloat16])  # a constexpr: @triton.jit code reads only constexpr globals


@triton.jit
def _rne(x):
    """Round half to even for |x| < 2**22: adding 1.5·2²³ leaves no fraction bits (IEEE RN-even)."""
    return (x + 12582912.0) - 12582912.0


@triton.jit
def _to_fp8e4m3(x, EMULATE: tl.constexpr):
    """Saturating round-to-nearest-even cast to float8 e4m3fn.

    On the GPU this is one ``cvt.rn.satfinite`` (NaN stays NaN); the interpreter's own cast rounds ties up and
    mishandles subnormals, so there the value is first rounded onto the E4M3 grid exactly.
    """
    if EMULATE:
        nan = x != x
        ax = tl.minimum(tl.abs(tl.where(nan, 0.0, x)), 448.0)
        e = tl.maximum(((ax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)  # binade (subnormals: -6)
        quantum = ((e + 124) << 23).to(tl.float32, bitcast=True)  # 2**(e - 3): 3 mantissa bits
        r = tl.minimum(_rne(ax / quantum) * quantum, 448.0)
        q = tl.where(x.to(tl.int32, bitcast=True) < 0, -r, r).to(tl.float8e4nv)  # the sign bit: -0 stays -0
        # the interpreter's cast has no NaN: e4m3fn's is the byte 0x7F
        return tl.where(nan, tl.full(x.shape, 0x7F, tl.uint8).to(tl.float8e4nv, bitcast=True), q)
    # on the GPU the cast itself is cvt.rn.satfinite: it saturates, no clamp needed, and keeps NaN
    return x.to(tl.float8e4nv)


@triton.jit
def _to_bf16(x, EMULATE: tl.constexpr):
    """Round-to-nearest-even cast of float32 ``x`` to bfloat16, as PyTorch casts.

    On the GPU this is one ``cvt.rn.bf16.f32``; the interpreter's own cast truncates, so there the bits are first
    rounded onto the bfloat16 grid (adding 0x7FFF and the kept part's lowest bit carries exactly at ties to even)."""
    if EMULATE:
        bits = x.to(tl.int32, bitcast=True)
        kept = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        x = tl.where(x != x, x, kept.to(tl.float32, bitcast=True))
    return x.to(tl.bfloat16)


@triton.jit
def _round_to(x, ROUND: tl.constexpr, EMULATE: tl.constexpr):
    """float32 ``x`` rounded to nearest even onto the grid of the dtype ``ROUND`` names (:data:`ROUND_TO`: 0
    float32, unchanged; 1 bfloat16, :func:`_to_bf16`; 2 float16, whose cast rounds so in the interpreter too) and
    back to float32: what a PyTorch reference computes by casting to that dtype. Same shape as ``x``."""
    if ROUND == 1:
        x = _to_bf16(x, EMULATE).to(tl.float32)
    elif ROUND == 2:
        x = x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def _div_by(x, d):
    """``x / d`` rounded as IEEE division (``div_rn``) for a positive divisor ``d`` broadcast against ``x``,
    with one reciprocal per divisor: Markstein's correction of ``x · RN(1/d)`` (an exact FMA residual, then
    one FMA) is the correctly rounded quotient while ``RN(1/d)`` is normal, so ``d`` is first brought into
    [2⁻⁶⁴, 2⁶⁴] by an exact power of two applied to both operands. The quotient can differ from ``div_rn``
    only below 2⁻¹²⁶ (``x`` scaled into the subnormals), where every quantizer here rounds it to 0."""
    f = tl.where(d > 1.8446744073709552e19, 5.421010862427522e-20,
                 tl.where(d < 5.421010862427522e-20, 1.8446744073709552e19, 1.0))
    d = d * f
    x = x * f
    r = tl.math.div_rn(1.0, d)
    q = x * r
    # a zero ``x`` keeps its sign, as in IEEE division (the correction's sums would give +0 for -0)
    return tl.where(x == 0.0, x, tl.math.fma(tl.math.fma(-d, q, x), r, q))
