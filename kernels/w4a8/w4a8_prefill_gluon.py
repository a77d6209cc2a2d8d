"""W4A8 prefill GEMM (M > 16 tokens) in Gluon (Triton 3.6+, sm_90): FP8 wgmma, the INT4 weights as its register
operand, x̂ streamed by TMA.

Numerics: those of :func:`~quantpatch.kernels.w4a8.w4a8_triton.w4a8_gemm` (the reference's ``group`` operand): per
128-group ``g`` one FP8 tensor-core product into a fresh fp32 accumulator (Hopper's FP8 MMA accumulates in a
narrower register within the group; the tests' bound), times the group's e4m3 scale σ_g, added to an fp32
accumulator in group order, then ``(acc ⊙ β) · 2⁻ⁿ + bias``. The weight operand is ``ŵ · 2⁻⁹`` (below) and σ is
taken as ``σ · 2⁹``: powers of two, so every product and partial is that of ``ŵ`` and ``σ`` exactly.

Design (swap AB, ``yᵀ = ŵ x̂ᵀ``; a program is 128 output channels × ``BT`` tokens, warp-specialized)::

    x̂ in fragment order ([M, K] e4m3, :func:`~quantpatch.kernels.w4a8.w4a8_act_quant_triton.fragment_slots`)
    producer warp   TMA [BT, 128] tiles of x̂ into a ring of STAGES shared buffers (a "ready" mbarrier each, the
                    TMA's byte count) once both consumers released the buffer (an "empty" mbarrier, two arrivals)
    two consumer warpgroups, 64 output channels each, per group g:
      wgmma         m64nBTk32 × 4 from group g's operand registers into a fresh accumulator, async
      INT4 → e4m3   group g + 1's words (requested three groups earlier) in registers (prmt/lop3: two's
                    complement nibble v → the e4m3 bits of v · 2⁻⁹, a subnormal or 2⁻⁶: sign | |v|), already
                    wgmma's A fragment (fragment order: no data movement); group g + 4's words requested
                    (ld.global.v4, 16 bytes of rows r and r + 8 a thread)
      wait          release the x̂ buffer; acc += part · σ_g

Each warpgroup waits for its own product before promoting it, and the two never meet: while one promotes and
unpacks, the other's product keeps the tensor core busy. The version before ran both warpgroups as one 8-warp
partition meeting at a bar.sync every group (so both promoted at the same time) and requested weights two groups
ahead: the same numerics bit for bit, 8-13 % slower at M = 4096 on an H200 (warp specialization), and a further
up to 10 % (weights four groups ahead) at the long-K and long-N shapes (docs/performance.md).
Two things measured and left out: the product's wait right after its issue with the unpack and the
σ load after it (ptxas then keeps the four wgmma in flight, no advisory C7513, but the kernel was no faster), and
BT = 256 (the accumulator and a group's product take 256 registers a thread: spills, 2.5× slower).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..compiled_launch import cdiv
from ..gluon_compat import tma_load
from .w4a8_act_quant_triton import quantize_activation_fp8
from .w4a8_gluon_operand import (
    GROUP,
    HALF,
    SIGMA_SHIFT,
    WG_ROWS,
    WORDS_L,
    _epilogue,
    _unpack,
    _weight_operand,
    check_x_hat,
    weight_words,
)
from .w4a8_ref import GROUP_SIZE, check_gemm_operands

BLOCK_N = gl.constexpr(128)  # output channels per program: two consumer warpgroups'
DEFAULT_BT = 128  # tokens per program (wgmma N)
DEFAULT_STAGES = 4  # x̂ buffers in the ring (H200: 4 as good as or better than 2, 3 and 6)
CONSUMER_REGS = gl.constexpr(232)  # registers of a consumer thread (setmaxnreg): 2 · 128 · 232 + 128 · 24 ≤ 64 K
PRODUCER_REGS = gl.constexpr(24)  # the least setmaxnreg takes

@gluon.jit
def _x_producer(x_desc, x_s, ready, empty, m0, groups, BT: gl.constexpr, STAGES: gl.constexpr):
    """Producer warp: x̂ group ``g`` (tile ``[BT, 128]``) into ring slot ``g mod STAGES`` by TMA once both
    consumers have released the slot."""
    for g in range(groups):
        slot = g % STAGES
        mbarrier.wait(empty.index(slot), ((g // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1 at once
        mbarrier.expect(ready.index(slot), BT * GROUP)
        tma_load(x_desc, [m0, g * GROUP], ready.index(slot), x_s.index(slot))


@gluon.jit
def _wg_consumer(x_s, ready, empty, W_ptr, AS_ptr, WS_ptr, B_ptr, PTS_ptr, Y_ptr, M, N, stride_wn, stride_sn,
                 stride_ym, n0, m0, groups, BT: gl.constexpr, STAGES: gl.constexpr, HAS_BIAS: gl.constexpr):
    """One warpgroup: ``y[m0 : m0 + BT, n0 : n0 + 64]`` over all of K, releasing each x̂ slot (one arrival of
    two) as soon as its product retired; it never meets the other warpgroup."""
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 32])
    op_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=4)
    out_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[8, 1], threads_per_warp=[8, 4], warps_per_cta=[1, 4],
                                           order=[0, 1])
    r_w = gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, WORDS_L))
    c_w = gl.arange(0, HALF // 4, layout=gl.SliceLayout(0, WORDS_L))
    w_ptrs = W_ptr + (n0 + r_w[:, None]).to(gl.int64) * stride_wn + c_w[None, :]
    w_ok = (n0 + r_w < N)[:, None]
    offs_n = n0 + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, acc_l))  # σ's rows and the epilogue's
    n_ok = offs_n < N
    s_ptrs = WS_ptr + offs_n.to(gl.int64) * stride_sn

    zero = gl.zeros([WG_ROWS, BT], gl.float32, acc_l)
    acc = zero
    # group g's operand unpacked (lo, hi), the words of groups g + 1 … g + 3 in flight (w1, w2, w3)
    lo, hi = _unpack(gl.load(w_ptrs, mask=w_ok, other=0))
    w1 = gl.load(w_ptrs + HALF // 4, mask=w_ok & (groups > 1), other=0)
    w2 = gl.load(w_ptrs + 2 * (HALF // 4), mask=w_ok & (groups > 2), other=0)
    w3 = gl.load(w_ptrs + 3 * (HALF // 4), mask=w_ok & (groups > 3), other=0)
    for g in range(groups):
        slot = g % STAGES
        mbarrier.wait(ready.index(slot), (g // STAGES) & 1)
        a = _weight_operand(lo, hi, op_l)
        tok = hopper.warpgroup_mma(a, x_s.index(slot).permute((1, 0)), zero, use_acc=False, is_async=True)
        sig = gl.load(s_ptrs + g, mask=n_ok, other=0.0).to(gl.float32) * SIGMA_SHIFT
        lo_next, hi_next = _unpack(w1)
        w1 = w2
        w2 = w3
        w3 = gl.load(w_ptrs + (g + 4) * (HALF // 4), mask=w_ok & (g + 4 < groups), other=0)  # four groups ahead
        # the operand's words (its registers) dependencies of the wait: they stay the wgmma's until it retires
        # (else group g + 1's unpack may be given them, and ptxas serializes every wgmma)
        part, lo, hi = hopper.warpgroup_mma_wait(0, deps=[tok, lo, hi])
        mbarrier.arrive(empty.index(slot))  # this warpgroup is done with the x̂ buffer
        acc = acc + part * sig[:, None]
        lo = lo_next
        hi = hi_next

    offs_m = m0 + gl.arange(0, BT, layout=gl.SliceLayout(0, acc_l))
    y = _epilogue(acc, AS_ptr, B_ptr, PTS_ptr, offs_n, offs_m, n_ok, offs_m < M, HAS_BIAS)
    y = gl.convert_layout(y.to(Y_ptr.dtype.element_ty), out_l)  # consecutive channels a thread: 16-byte stores
    on = n0 + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, out_l))
    om = m0 + gl.arange(0, BT, layout=gl.SliceLayout(0, out_l))
    gl.store(Y_ptr + om[None, :].to(gl.int64) * stride_ym + on[:, None], y, mask=(on < N)[:, None] & (om < M)[None, :])


@gluon.jit
def _w4a8_prefill_gluon(
    x_desc, W_ptr, AS_ptr, WS_ptr, B_ptr, PTS_ptr, Y_ptr,
    M, N, K, stride_wn, stride_sn, stride_ym,
    BT: gl.constexpr, STAGES: gl.constexpr, HAS_BIAS: gl.constexpr,
):
    """Program ``(n-tile, m-tile)``: ``y[m0 : m0 + BT, n0 : n0 + 128]`` over all of K (module docstring).

    ``x_desc``: TMA descriptor of ``x̂ (M, K)`` e4m3 in fragment order, block ``[BT, 128]``. ``W``: ``qweight``
    as ``int32 (N, K/8)`` words (row stride ``stride_wn`` words). ``AS``: β (M,). ``WS``: σ e4m3 (N, K/128).
    ``PTS``: n. ``Y``: (M, N). Launched with 4 warps (the first consumer); the second consumer (4 warps) and the
    producer (1 warp) are the worker partitions.
    """
    tiles_n = gl.cdiv(N, BLOCK_N)
    pid = gl.program_id(0)
    n0 = (pid % tiles_n) * BLOCK_N
    m0 = (pid // tiles_n) * BT
    groups = K // GROUP
    x_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BT, GROUP], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # one arrival a warpgroup
    hopper.fence_async_shared()  # the barriers' inits before the async proxy (TMA) uses them
    gl.warp_specialize([
        (_wg_consumer, (x_s, ready, empty, W_ptr, AS_ptr, WS_ptr, B_ptr, PTS_ptr, Y_ptr, M, N, stride_wn, stride_sn,
                        stride_ym, n0, m0, groups, BT, STAGES, HAS_BIAS)),
        (_wg_consumer, (x_s, ready, empty, W_ptr, AS_ptr, WS_ptr, B_ptr, PTS_ptr, Y_ptr, M, N, stride_wn, stride_sn,
                        stride_ym, n0 + WG_ROWS, m0, groups, BT, STAGES, HAS_BIAS)),
        (_x_producer, (x_desc, x_s, ready, empty, m0, groups, BT, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))


def w4a8_gemm_prefill_gluon(
    x_hat: torch.Tensor,
    x_scale: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    pts_exp: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    block_t: int = DEFAULT_BT,
    stages: int = DEFAULT_STAGES,
) -> torch.Tensor:
    """The GEMM alone, ``y = β · 2⁻ⁿ · Σ_g σ_g (x̂_g ŵ_gᵀ) + bias``, from ``x̂`` in fragment order.

    Args:
        x_hat: ``float8_e4m3fn (M, K)``, contiguous, each 128-group in fragment order
            (``quantize_activation_fp8(x, fragment_order=True)``).
        x_scale: ``bfloat16 (M,)``.
        qweight: ``uint8 (N, K/2)``, last dim contiguous.
        scales: ``float8_e4m3fn (N, K/128)``.
        pts_exp: ``int32 ()`` on the device.
        bias: ``(N,)`` or None.
        block_t: tokens per program (wgmma N: a multiple of 8, at most 256).
        stages: x̂ buffers in the ring (≥ 1; from 2 on, loads overlap products).

    Returns:
        ``y (M, N)`` in ``out_dtype``.
    """
    m, k = x_hat.shape
    check_gemm_operands(m, k, qweight, scales)
    check_x_hat(x_hat)
    if block_t % 8 or not 8 <= block_t <= 256 or stages < 1:
        raise ValueError(f"block_t must be a multiple of 8 in [8, 256] and stages ≥ 1, got {block_t}, {stages}")
    n = qweight.shape[0]
    y = torch.empty((m, n), device=x_hat.device, dtype=out_dtype)
    if m == 0 or n == 0:
        return y
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    desc = TensorDescriptor.from_tensor(x_hat, [block_t, GROUP_SIZE], layout)
    grid = (cdiv(n, BLOCK_N.value) * cdiv(m, block_t),)
    _w4a8_prefill_gluon[grid](
        desc, weight_words(qweight), x_scale, scales, x_scale if bias is None else bias, pts_exp, y,
        m, n, k, qweight.stride(0) // 4, scales.stride(0), y.stride(0),
        BT=block_t, STAGES=stages, HAS_BIAS=bias is not None, num_warps=4)
    return y


def w4a8_linear_prefill_gluon(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, pts_exp: torch.Tensor,
                              bias: torch.Tensor | None = None, **options) -> torch.Tensor:
    """The whole layer on ``x (M, K)`` (last dim contiguous) → ``y (M, N)`` in ``x``'s dtype: the quantization
    (:func:`~quantpatch.kernels.w4a8.w4a8_act_quant_triton.quantize_activation_fp8`, fragment order), then
    :func:`w4a8_gemm_prefill_gluon` (``options``: its keywords)."""
    check_gemm_operands(x.shape[0], x.shape[1], qweight, scales)
    x_hat, beta = quantize_activation_fp8(x, fragment_order=True)
    return w4a8_gemm_prefill_gluon(x_hat, beta, qweight, scales, pts_exp, bias, x.dtype, **options)
