"""FireQ's look-up-table weight operand as an FP8 matrix, in one Triton launch.

With ``weight_operand="lut"`` (FireQ §3.1.1 Step 1, :mod:`~quantpatch.kernels.w4a8.w4a8_ref`) the product's weight
operand is ``e4m3(ŵ σ)``: each INT4 code times its group's e4m3 scale, rounded once to e4m3. That is a plain FP8
matrix, so the layer is ``y = β · 2⁻ⁿ · x̂ · e4m3(ŵ σ)ᵀ + b``: an FP8 GEMM with per-token (``β``) and per-channel
(``2⁻ⁿ``) scales, which ``torch._scaled_mm`` runs at FP8 speed. :func:`lut_weight_fp8` writes that matrix from the
packed weight (``N × K`` bytes read as ``N × K / 2``): the product ``ŵ σ`` is exact in float32 (at most 6
significant bits), and the one rounding is the shared saturating round-to-nearest-even e4m3 cast of
:mod:`~quantpatch.kernels.rounding_triton` (exact in the interpreter too), so the matrix is bit for bit the
reference's ``cast_fp8(ŵ σ)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..compiled_launch import cdiv, interpreting
from ..rounding_triton import _to_fp8e4m3
from .w4a8_ref import GROUP_SIZE

BLOCK_N = 16  # output rows a program (one group of GROUP_SIZE input channels each)


@triton.jit
def _signed_nibble(v):
    """A 4-bit two's-complement code (0..15) as its integer value (-8..7)."""
    return tl.where(v >= 8, v - 16, v)


@triton.jit
def _w4a8_lut_weight_kernel(
    Q_ptr, S_ptr, W_ptr,
    N, stride_qn, stride_sn, stride_wn,
    BLOCK_N: tl.constexpr, GROUP: tl.constexpr, EMULATE: tl.constexpr,
):
    """Rows ``BLOCK_N · program_id(0)`` on, input group ``program_id(1)``: ``W = e4m3(ŵ σ)``, channel ``2c`` from the
    low nibble of byte ``c`` and ``2c + 1`` from its high nibble."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.program_id(1)
    keep = rows < N
    rows64 = rows.to(tl.int64)
    pairs = tl.arange(0, GROUP // 2)
    codes = tl.load(Q_ptr + rows64[:, None] * stride_qn + g * (GROUP // 2) + pairs[None, :], mask=keep[:, None],
                    other=0).to(tl.int32)
    sigma = tl.load(S_ptr + rows64 * stride_sn + g, mask=keep, other=0.0).to(tl.float32)[:, None]
    low = _signed_nibble(codes & 0xF).to(tl.float32) * sigma
    high = _signed_nibble((codes >> 4) & 0xF).to(tl.float32) * sigma
    w = tl.reshape(tl.join(low, high), [BLOCK_N, GROUP])  # channels 2c, 2c + 1 side by side
    chans = g * GROUP + tl.arange(0, GROUP)
    tl.store(W_ptr + rows64[:, None] * stride_wn + chans[None, :], _to_fp8e4m3(w, EMULATE), mask=keep[:, None])


def lut_weight_fp8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """FireQ's look-up-table operand ``e4m3(ŵ σ)`` of a packed weight, on the current stream.

    Args:
        qweight: ``uint8 (N, Kp/2)``, two INT4 codes a byte (layout of ``w4a8_ref.quantize_weight``).
        scales: ``float8_e4m3fn (N, Kp / 128)`` group scales σ.

    Returns:
        ``float8_e4m3fn (N, Kp)``, bit for bit ``cast_fp8(ŵ σ)`` of the reference (PTS not undone: the layer's
        ``2⁻ⁿ`` is a scale of the product).
    """
    n, half = qweight.shape
    groups = scales.shape[1] if scales.dim() == 2 else -1
    if qweight.dtype != torch.uint8 or scales.dtype != torch.float8_e4m3fn or scales.shape[0] != n \
            or half * 2 != groups * GROUP_SIZE or qweight.stride(-1) != 1:
        raise ValueError(f"qweight uint8 (N, Kp/2) and scales float8_e4m3fn (N, Kp/{GROUP_SIZE}) expected, got "
                         f"{qweight.dtype} {tuple(qweight.shape)} and {scales.dtype} {tuple(scales.shape)}")
    w = torch.empty((n, half * 2), device=qweight.device, dtype=torch.float8_e4m3fn)
    if n and groups:
        _w4a8_lut_weight_kernel[(cdiv(n, BLOCK_N), groups)](
            qweight, scales, w, n, qweight.stride(0), scales.stride(0), w.stride(0),
            BLOCK_N=BLOCK_N, GROUP=GROUP_SIZE, EMULATE=interpreting(), num_warps=4,
        )
    return w
