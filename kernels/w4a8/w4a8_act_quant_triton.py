"""W4A8 per-token FP8 activation quantization in Triton: the first step of the W4A8 linear
(:mod:`quantpatch.kernels.w4a8.w4a8_triton`), fused into its decode kernel and the Gluon GEMMs
(:mod:`quantpatch.kernels.w4a8.w4a8_gluon`, :mod:`quantpatch.kernels.w4a8.w4a8_prefill_gluon`).

One program per token (:func:`quantize_activation_fp8`): ``a = max_k |x|``, ``β = bf16(a / 448)`` (1 if 0),
``x̂ = e4m3(x / β)`` saturating. Bit-exact with :func:`~quantpatch.kernels.w4a8.w4a8_ref.quantize_activation_fp8`
computing in float32: an IEEE division (``div_rn``), and the shared round-half-even bf16 cast and saturating e4m3
cast of :mod:`~quantpatch.kernels.rounding_triton` (exact under the interpreter too).
A row of up to ``ACT_BLOCK_K`` is read once. x̂ is stored in channel order or in fragment order
(:func:`fragment_slots`), the order the Gluon GEMMs read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..compiled_launch import LaunchPlans, interpreting, next_pow2
from ..rounding_triton import ROUND_TO_BF16, _round_to, _to_fp8e4m3
from .w4a8_ref import GROUP_SIZE

ACT_BLOCK_K = 16384  # activation-quantization chunk along K: a row up to this long is read once
# ... except rows longer than 2 · LONG_ROW_CHUNK of more than DECODE_BLOCK_M tokens: chunks of LONG_ROW_CHUNK, 8 warps,
# the row read twice (H200, 4096 tokens × 14336: 68 µs against 152 µs in one 16384-wide chunk)
LONG_ROW_CHUNK = 2048
DECODE_BLOCK_M = 16  # the fp16 mma's row count: the decode kernel takes M ≤ 16
DECODE_QBLOCK = 4096  # the decode kernels' fused quantization: its chunk along K (registers per producer program)


@triton.jit
def _store_x_hat(q_ptr, offs, xq, mask, FRAGMENT: tl.constexpr):
    """``xq`` (channels ``offs``, a block of whole 128-groups where FRAGMENT) stored in channel order, or with each
    group in fragment order (:func:`fragment_slots`): channel ``32q + 8s + 2j + h`` at ``32s + 16h + 4q + j``,
    reordered in registers so the stores stay contiguous."""
    if FRAGMENT:
        n: tl.constexpr = xq.shape[0]
        xq = tl.reshape(tl.permute(tl.reshape(xq, [n // 128, 4, 4, 4, 2]), (0, 2, 4, 1, 3)), [n])
    tl.store(q_ptr + offs, xq, mask=mask)


@triton.jit
def _quantize_row(x_row, q_row, s_ptr, K, BLOCK_K: tl.constexpr, FRAGMENT: tl.constexpr, EMULATE: tl.constexpr):
    """One token: ``β = bf16(max|x| / 448)`` (1 if 0), ``x̂ = e4m3(x / β)`` (saturating, RNE), stored in channel
    order or, ``FRAGMENT``, in fragment order (:func:`_store_x_hat`).

    A row of ``K ≤ BLOCK_K`` is loaded once and quantized from registers; a longer one in two passes.
    """
    offs = tl.arange(0, BLOCK_K)
    x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
    amax = tl.abs(x)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        amax = tl.maximum(amax, tl.abs(tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)))
    beta = tl.math.div_rn(tl.max(amax, 0), 448.0)  # e4m3 max
    beta = tl.where(beta == 0.0, 1.0, beta)  # symmetric_scale: an all-zero token gets 1
    beta = _round_to(beta, ROUND_TO_BF16, EMULATE)
    beta = tl.where(beta == 0.0, 1.0, beta)  # bf16 underflow (absmax < ~1e-36)
    _store_x_hat(q_row, offs, _to_fp8e4m3(tl.math.div_rn(x, beta), EMULATE), offs < K, FRAGMENT)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        mask = k0 + offs < K
        x = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        _store_x_hat(q_row + k0, offs, _to_fp8e4m3(tl.math.div_rn(x, beta), EMULATE), mask, FRAGMENT)
    tl.store(s_ptr, beta.to(tl.bfloat16))  # exact: beta is on the bf16 grid


@triton.jit
def _w4a8_quantize_activation_kernel(
    X_ptr, XQ_ptr, S_ptr,
    K, stride_xm, stride_qm,
    BLOCK_K: tl.constexpr, FRAGMENT: tl.constexpr, EMULATE: tl.constexpr,
):
    """Token ``m = program_id``: :func:`_quantize_row`."""
    m = tl.program_id(0).to(tl.int64)
    _quantize_row(X_ptr + m * stride_xm, XQ_ptr + m * stride_qm, S_ptr + m, K, BLOCK_K, FRAGMENT, EMULATE)


_QUANTIZE_LAUNCH = LaunchPlans(_w4a8_quantize_activation_kernel)


def quantize_activation_fp8(x: torch.Tensor, *, fragment_order: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token FP8 quantization of ``x (M, K)`` (fp16/bf16/fp32, last dim contiguous).

    Args:
        x: the activations.
        fragment_order: store each 128-group's channels in fragment order (:func:`to_fragment_order`: what the
            Gluon prefill GEMM reads); K must then be a multiple of 128.

    Returns:
        ``x̂ float8_e4m3fn (M, K)`` and ``β bfloat16 (M,)`` with ``x ≈ β x̂``; the numerics of
        :func:`quantpatch.kernels.w4a8.w4a8_ref.quantize_activation_fp8` (float32) bit for bit.
    """
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be 2-D (M, K) with a contiguous last dim, got shape {tuple(x.shape)}")
    m, k = x.shape
    if fragment_order and k % GROUP_SIZE:
        raise ValueError(f"fragment order needs K a multiple of {GROUP_SIZE}, got {k}")
    x_hat = torch.empty((m, k), device=x.device, dtype=torch.float8_e4m3fn)
    beta = torch.empty((m,), device=x.device, dtype=torch.bfloat16)
    if m:
        block_k = min(ACT_BLOCK_K, next_pow2(max(k, GROUP_SIZE if fragment_order else 16)))
        warps = max(1, min(16, block_k // 512))
        if m > DECODE_BLOCK_M and k > 2 * LONG_ROW_CHUNK:
            block_k, warps = LONG_ROW_CHUNK, 8
        _QUANTIZE_LAUNCH((m,), (x, x_hat, beta, k, x.stride(0), x_hat.stride(0)),
                         dict(BLOCK_K=block_k, FRAGMENT=fragment_order, EMULATE=interpreting()), num_warps=warps)
    return x_hat, beta


def fragment_slots() -> torch.Tensor:
    """``int64 (128,)``: the input channel each slot of a 128-group holds in fragment order.

    Fragment order puts channel ``c = 32q + 8s + 2j + h`` of a group at slot ``32s + 16h + 4q + j``: the
    channels whose INT4 nibbles sit in packed bytes ``16q … 16q + 15`` (one 16-byte load of a thread of quad
    lane ``q``) land where wgmma's 8-bit A fragment wants them (k32 step ``s``: low nibbles at ``4q + j``, high
    nibbles at ``16 + 4q + j``), so the weights go from one load to the tensor core with no data movement.
    """
    slot = torch.arange(GROUP_SIZE)
    s, h, q, j = slot >> 5, (slot >> 4) & 1, (slot >> 2) & 3, slot & 3
    return 32 * q + 8 * s + 2 * j + h


def to_fragment_order(t: torch.Tensor) -> torch.Tensor:
    """``t (..., K)`` (K a multiple of 128), each 128-group's channels in fragment order (:func:`fragment_slots`)."""
    groups = t.shape[-1] // GROUP_SIZE
    return t.reshape(*t.shape[:-1], groups, GROUP_SIZE)[..., fragment_slots().to(t.device)].reshape(t.shape)
