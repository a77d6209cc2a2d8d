"""INT8 Q·Kᵀ prefill attention in Gluon (Triton 3.6+, sm_90), one warpgroup a program: occupancy, not ping-pong.

Numerics of ``quant_attn_triton._attn_fwd_kernel`` without smooth Q: sage2 (INT8 Q·Kᵀ with SageAttention2's
per-thread Q and K scales, P̃ → e4m3 at the static 448 scale, FP8 P̃·V of a key block in its own fp32 accumulator
then added to the main one, per-channel V scale applied once at the end, optional V mean) and, as constexpr
variants, int8-flash (per-token Q and K scales, P̂ = rne(127 P̃), INT8 P̂·V, one V scale, ℓ from P̂) and fireq
(FP8 e4m3 Q·Kᵀ with per-token scales into fp32, P̂ = e4m3(448 P̃), FP8 P̂·V accumulated into the main accumulator
by default, one V scale). Causal (bottom-right aligned, any Nk - Nq) or not, any Nq / Nk (tails masked), GQA,
optional LSE, head_dim 64 or 128.

A program is one warpgroup (4 warps) over 64 query rows. Its Q tile sits in shared memory; K and Vᵀ blocks of
``BLOCK_N`` keys come by TMA into ``STAGES``-deep rings, each slot refilled as soon as every warp is done with it.
Per key block::

    wait K_j; S = Q̂·K̂_jᵀ (wgmma, both operands in shared memory); refill K's slot with block j + STAGES
    softmax of block j → P̂_j in registers, already in the register layout of the P·V wgmma's A operand
    wait V_j; R = P̂_j·V̂_j (wgmma, A from registers); acc = α_j acc + R; refill V's slot

No warp waits on another warp of its program, and a program holds about 40–70 KB of shared memory, so three or
four programs share an SM and one's MMAs run under another's softmax (the design of SageAttention's own sm90
kernel). A program takes its key blocks last first: the first (the tail, or causal, the one or two blocks that
cross the diagonal) are the only masked ones, so the main loop holds no mask.

Kernel only, B=4, H=32, bf16 inputs, against SDPA cuDNN in the same run (H200, Triton 3.6, 2 stages, 168 registers
at D=128): D=128 non-causal 1.02 / 1.26 / 1.28 / 1.26 / 1.33× at 1k / 4k / 8k / 16k / 32k keys (the ping-pong kernel
``pingpong_gluon``: 1.15–1.28× from 4k on), causal 0.67 / 1.12 / 1.26 / 1.34 / 1.27×; D=64 non-causal 1.00 / 1.12 /
1.21 / 1.17 / 1.18×, causal 0.44 / 1.07 / 1.12 / 1.15 / 1.13× (the Triton kernel: 0.77–0.93×). One stage (40 KB of
shared memory, as SageAttention's) ran within 2 % from 4k keys on and 0.72× as fast at 1k; K and Vᵀ on one mbarrier
a slot, refilled together after P̂·V, ran 0.90–1.03×.

Per-thread groups make δQ·δK one value a lane and 64-key span (``pingpong_gluon._lane_scale_shape``), so sage2's
softmax (:func:`_softmax_lane_scaled`) folds it into the exp2's multiply-add and scales each lane's raw span maximum
once, as upstream folds its δQ·δK into the softmax scale: 579 SASS instructions a key block instead of 637 (58
FMULs fewer), the same registers. The int8-flash softmax, the key order of P̂ (Vᵀ's keys in
``pingpong_gluon.wgmma_key_order``, what ``quantize_qkv(..., v_key_order=True)`` writes) and the int8-flash
arithmetic are ``pingpong_gluon``'s.
"""

from __future__ import annotations

import functools
import math

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..compiled_launch import LaunchPlans, cdiv, current_stream, specialization
from ..gluon_compat import cta_barrier, tma_load
from .pingpong_gluon import (
    _block_pv,
    _lane_k_scale,
    _lane_scale_shape,
    _log2_p_max,
    _pv_operand,
    _softmax_block,
    _store_lse,
    _store_output,
    _warpgroup_rows,
    check_operand_formats,
)
from .qk_quant_triton import QuantizedQKV
from .quant_attn_triton import LOG2E

BLOCK_M = 64  # query rows of a program (one warpgroup, wgmma M)
HEAD_DIMS = (64, 128)
DEFAULT_STAGES = 2  # K/Vᵀ ring depth
# ptxas register cap by head_dim: three programs an SM at D=128 (uncapped, causal programs took 197 registers, two an
# SM, and ran 0.85–0.90× as fast at 16k–32k keys; H200), four at D=64 (uncapped, sage2 took 145 registers non-causal
# and 163 causal, int8-flash's causal program 212, which ran 0.87× as fast; capped, no spills with Triton 3.6)
MAXNREG = {64: 128, 128: 168}


@gluon.jit
def _load_kv(k_desc, vt_desc, ks_desc, k_s, v_s, ks_s, k_bar, v_bar, slot, k_row, v_row, key0,
             HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, TOKEN_SCALES: gl.constexpr):
    """K block (with its per-token scales for int8-flash) and Vᵀ block from ``key0`` on into ring slot ``slot``."""
    if TOKEN_SCALES:
        mbarrier.expect(k_bar.index(slot), BLOCK_N * HEAD_DIM + BLOCK_N * 4)
        tma_load(ks_desc, [k_row + key0], k_bar.index(slot), ks_s.index(slot))
    else:
        mbarrier.expect(k_bar.index(slot), BLOCK_N * HEAD_DIM)
    tma_load(k_desc, [k_row + key0, 0], k_bar.index(slot), k_s.index(slot))
    mbarrier.expect(v_bar.index(slot), BLOCK_N * HEAD_DIM)
    tma_load(vt_desc, [v_row, key0], v_bar.index(slot), v_s.index(slot))


@gluon.jit
def _key_block(j, n_blocks, BLOCK_N: gl.constexpr):
    """First key of the block a program takes j-th: last first."""
    return (n_blocks - 1 - j) * BLOCK_N


@gluon.jit
def _softmax_lane_scaled(s_int, scale7, qk_scale, key0, m_i, l_i, last_key, BLOCK_N: gl.constexpr,
                         MASKED: gl.constexpr, col_s: gl.constexpr, row_s: gl.constexpr, p_op: gl.constexpr):
    """Online softmax of the key block from ``key0`` on under per-thread groups (sage2):
    S = (Q̂·K̂ᵀ) δQ δK, P̃ = 2^((S − m)·qk_scale), P̂ = e4m3(448 P̃), with δQ δK ``scale7`` one value a lane and
    64-key span (:func:`~quantpatch.kernels.attention.pingpong_gluon._lane_scale_shape`) and ``qk_scale`` = log₂e/√d.

    S is never formed: δQ δK enters the exp2's multiply-add as δQ δK·qk_scale, and the row max is taken on each
    lane's raw int32 products of a span, scaled once (δQ δK > 0 and rounding are monotone, so this max is the max of
    S). ``s_int (64, BLOCK_N)`` the int32 Q̂·K̂ᵀ (exact in fp32), ``m_i`` / the returned max in units of S.
    ``MASKED``: keys past ``last_key (64,)`` of each row are −inf. Returns ``p_hat`` (the A operand of P̂·V), the
    rescale ``alpha (64,)`` and the new running max and sum ℓ (in units of 448)."""
    LOG2_PMAX: gl.constexpr = _log2_p_max(False)
    ROWS: gl.constexpr = s_int.shape[0]
    s_mma: gl.constexpr = s_int.type.layout
    s = s_int.to(gl.float32)
    if MASKED:
        keys = key0 + gl.arange(0, BLOCK_N, layout=col_s)
        s = gl.where(keys[None, :] <= last_key[:, None], s, float("-inf"))
        # a span of padding keys has δK = 0, and −inf · 0 is NaN: the smallest normal scale keeps masked keys at −inf
        # (a valid key under δK = 0 has a zero product either way)
        scale7 = gl.maximum(scale7, 1.1754943508222875e-38)
    s7 = gl.reshape(s, _lane_scale_shape(BLOCK_N))  # (warp, row half, lane row, span, key reg, lane group, key bit)
    lane_scale = gl.max(gl.max(scale7, 6), 4)  # the size-1 dims dropped: (4, 1, 8, spans, 4)
    span_max = gl.max(gl.max(s7, 6), 4) * lane_scale  # (4, 2, 8, spans, 4): registers only
    block_max = gl.max(gl.max(span_max, 3), 3)  # over the spans (registers), then the lane group's 4 lanes
    m_new = gl.maximum(m_i, gl.convert_layout(gl.reshape(block_max, [ROWS]), row_s))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2((m_i - m_safe) * qk_scale)
    shift = gl.convert_layout(gl.reshape(m_safe * qk_scale - LOG2_PMAX, [4, 2, 8]), block_max.type.layout)
    shift7 = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(shift, 3), 3), 4), 6)  # the reductions undone
    p7 = gl.exp2(s7 * (scale7 * qk_scale) - shift7)  # = 448 · P̃, one multiply-add an element
    p = gl.convert_layout(gl.reshape(p7, [ROWS, BLOCK_N]), s_mma)  # same registers: no data movement
    l_i = l_i * alpha + gl.sum(p, 1)
    return _pv_operand(p.to(gl.float8e4nv), p_op), alpha, m_new, l_i


@gluon.jit
def _attend_block(j, q_s, k_s, v_s, ks_s, k_bar, v_bar, k_desc, vt_desc, ks_desc, KS_ptr, k_row, v_row, n_blocks,
                  qs, qk_scale, last_key, m_i, l_i, acc, zero_s, zero_o, lane7: gl.constexpr,
                  HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, TOKEN_SCALES: gl.constexpr,
                  PV_INT8: gl.constexpr, TWO_LEVEL: gl.constexpr, MASKED: gl.constexpr, col_s: gl.constexpr,
                  row_s: gl.constexpr, row_o: gl.constexpr, p_op: gl.constexpr):
    """Key block j of the program (:func:`_key_block`): S, softmax, P̂·V, ``acc = α acc + P̂·V`` (``TWO_LEVEL``:
    P̂·V in its own accumulator, then added; else the wgmma accumulates into α acc); refills both ring slots with
    block j + STAGES. ``MASKED``: keys past ``last_key`` of a row are masked."""
    slot = j % STAGES
    phase = (j // STAGES) & 1
    key0 = _key_block(j, n_blocks, BLOCK_N)
    scale = qs
    # this lane's δK, loaded while Q·K runs (loaded a block ahead instead, the loop-carried values cost 2 spills at
    # D=128 and ran 0.95× as fast, H200)
    if not TOKEN_SCALES:
        scale = qs * _lane_k_scale(KS_ptr, k_row + key0, lane7, BLOCK_N)
    mbarrier.wait(k_bar.index(slot), phase)
    s_tok = hopper.warpgroup_mma(q_s, k_s.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    s_int = hopper.warpgroup_mma_wait(0, deps=[s_tok])
    # a refill overwrites a slot that every warp's wgmma has read: Triton's shared-memory hazard analysis puts a CTA
    # barrier before each TMA issue (and its expect), so no warp's reads are pending (checked in the PTX)
    refill = j + STAGES < n_blocks
    if TOKEN_SCALES:
        # δK of each key comes from the ring: S scaled by it first, so the K slot is refilled before the softmax
        # (refilled after it, fireq ran 0.88–0.92× as fast at 8k–16k keys, H200)
        s_scaled = s_int.to(gl.float32) * ks_s.index(slot).load(col_s)[None, :]
        if refill:
            mbarrier.expect(k_bar.index(slot), BLOCK_N * HEAD_DIM + BLOCK_N * 4)
            tma_load(ks_desc, [k_row + key0 - STAGES * BLOCK_N], k_bar.index(slot), ks_s.index(slot))
            tma_load(k_desc, [k_row + key0 - STAGES * BLOCK_N, 0], k_bar.index(slot), k_s.index(slot))
        p_hat, alpha, m_i, l_i = _softmax_block(s_scaled, scale, None, None, qk_scale, key0, m_i, l_i, last_key, None,
                                                False, BLOCK_N, False, TOKEN_SCALES, PV_INT8, MASKED, col_s, row_s,
                                                p_op)
    else:
        if refill:
            mbarrier.expect(k_bar.index(slot), BLOCK_N * HEAD_DIM)
            tma_load(k_desc, [k_row + key0 - STAGES * BLOCK_N, 0], k_bar.index(slot), k_s.index(slot))
        if PV_INT8:
            p_hat, alpha, m_i, l_i = _softmax_block(s_int, scale, None, None, qk_scale, key0, m_i, l_i, last_key,
                                                    None, False, BLOCK_N, False, TOKEN_SCALES, PV_INT8, MASKED, col_s,
                                                    row_s, p_op)
        else:
            p_hat, alpha, m_i, l_i = _softmax_lane_scaled(s_int, scale, qk_scale, key0, m_i, l_i, last_key, BLOCK_N,
                                                          MASKED, col_s, row_s, p_op)
    mbarrier.wait(v_bar.index(slot), phase)
    alpha_o = gl.convert_layout(alpha, row_o)[:, None]
    if TWO_LEVEL:  # a block's P̂·V, then acc
        r_tok = hopper.warpgroup_mma(p_hat, v_s.index(slot).permute((1, 0)), zero_o, use_acc=False, is_async=True)
        r = hopper.warpgroup_mma_wait(0, deps=[r_tok])
        acc = acc * alpha_o + _block_pv(r)
    else:  # one level: the FP8 wgmma adds P̂·V to α acc in its own accumulator
        acc_tok = hopper.warpgroup_mma(p_hat, v_s.index(slot).permute((1, 0)), acc * alpha_o, is_async=True)
        acc = hopper.warpgroup_mma_wait(0, deps=[acc_tok])
    if refill:
        mbarrier.expect(v_bar.index(slot), BLOCK_N * HEAD_DIM)
        tma_load(vt_desc, [v_row, key0 - STAGES * BLOCK_N], v_bar.index(slot), v_s.index(slot))
    return m_i, l_i, acc


@gluon.jit
def _attn_sm90_kernel(
    Q_ptr, k_desc, vt_desc, ks_desc, QS_ptr, KS_ptr, VS_ptr, VM_ptr, O_ptr, LSE_ptr,
    stride_ob, stride_oh, stride_om,
    NQ, NK, NK_PAD, H, GROUP, qk_scale,
    HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
    SMOOTH_V: gl.constexpr, RETURN_LSE: gl.constexpr, TOKEN_SCALES: gl.constexpr, QK_FP8: gl.constexpr,
    PV_INT8: gl.constexpr, V_TENSOR: gl.constexpr, TWO_LEVEL: gl.constexpr,
):
    """Program ``(q block of 64 rows, b·H + h)`` (causal: the last q block first, it has the most keys), 4 warps."""
    WG_ROWS: gl.constexpr = 64
    LOG2_PMAX: gl.constexpr = _log2_p_max(PV_INT8)
    s_mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, BLOCK_N, 32])
    o_mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, HEAD_DIM, 32])
    p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_mma, k_width=4)
    row_s: gl.constexpr = gl.SliceLayout(1, s_mma)
    col_s: gl.constexpr = gl.SliceLayout(0, s_mma)
    row_o: gl.constexpr = gl.SliceLayout(1, o_mma)
    col_o: gl.constexpr = gl.SliceLayout(0, o_mma)
    ld: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[32 * 16 // HEAD_DIM,
                                        HEAD_DIM // 16], warps_per_cta=[4, 1], order=[1, 0])

    pid_m = gl.program_id(0)
    if CAUSAL:
        pid_m = gl.num_programs(0) - 1 - pid_m
    pid_bh = gl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    bh_kv = b * (H // GROUP) + h // GROUP
    m0 = pid_m * WG_ROWS
    k_row = bh_kv * NK_PAD  # key 0 of this kv head in the (B·Hkv·Nk_pad, D) view and the flat K scales
    v_row = bh_kv * HEAD_DIM  # channel 0 in the (B·Hkv·D, Nk_pad) view

    n_blocks = NK_PAD // BLOCK_N
    n_masked = 1  # the first block taken holds the tail
    if CAUSAL:  # row r attends keys ≤ r + Nk - Nq: the program needs blocks up to its last row's last key, and
        # masks those past its first row's last key (one or two blocks)
        n_blocks = gl.minimum(gl.maximum(gl.cdiv(m0 + WG_ROWS + NK - NQ, BLOCK_N), 1), n_blocks)
        n_masked = gl.minimum(gl.maximum(n_blocks - gl.maximum(m0 + NK - NQ + 1, 0) // BLOCK_N, 1), n_blocks)

    k_s = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_s = gl.allocate_shared_memory(vt_desc.dtype, [STAGES, HEAD_DIM, BLOCK_N], vt_desc.layout)
    ks_s = gl.allocate_shared_memory(gl.float32, [STAGES if TOKEN_SCALES else 1, BLOCK_N], ks_desc.layout)
    k_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bar.index(i), count=1)
        mbarrier.init(v_bar.index(i), count=1)
    hopper.fence_async_shared()
    for i in gl.static_range(STAGES):
        if i < n_blocks:
            _load_kv(k_desc, vt_desc, ks_desc, k_s, v_s, ks_s, k_bar, v_bar, i, k_row, v_row,
                     _key_block(i, n_blocks, BLOCK_N), HEAD_DIM, BLOCK_N, TOKEN_SCALES)

    # the Q tile (int8 or e4m3, as K) into shared memory, under the first K/V loads
    q_s = gl.allocate_shared_memory(k_desc.dtype, [WG_ROWS, HEAD_DIM], k_desc.layout)
    rows_ld = m0 + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, ld))
    d_ld = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ld))
    q_s.store(gl.load(Q_ptr + (pid_bh.to(gl.int64) * NQ + rows_ld[:, None]) * HEAD_DIM + d_ld[None, :],
                      mask=rows_ld[:, None] < NQ, other=0.0))
    hopper.fence_async_shared()
    cta_barrier()

    lane7: gl.constexpr = gl.reshape(gl.zeros([WG_ROWS, BLOCK_N], gl.float32, layout=s_mma),
                                     _lane_scale_shape(BLOCK_N)).type.layout
    rows, last_key, qs, qk_scale = _warpgroup_rows(m0, NQ, NK, QS_ptr, pid_bh, qk_scale, row_s, lane7, CAUSAL,
                                                   TOKEN_SCALES)

    zero_s = gl.zeros([WG_ROWS, BLOCK_N], gl.float32 if QK_FP8 else gl.int32, layout=s_mma)
    zero_o = gl.zeros([WG_ROWS, HEAD_DIM], gl.int32 if PV_INT8 else gl.float32, layout=o_mma)
    m_i = gl.full([WG_ROWS], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([WG_ROWS], gl.float32, layout=row_s)
    acc = gl.zeros([WG_ROWS, HEAD_DIM], gl.float32, layout=o_mma)
    for j in range(n_masked):
        m_i, l_i, acc = _attend_block(j, q_s, k_s, v_s, ks_s, k_bar, v_bar, k_desc, vt_desc, ks_desc, KS_ptr, k_row,
                                      v_row, n_blocks, qs, qk_scale, last_key, m_i, l_i, acc, zero_s, zero_o, lane7,
                                      HEAD_DIM, BLOCK_N, STAGES, TOKEN_SCALES, PV_INT8, TWO_LEVEL, True, col_s,
                                      row_s, row_o, p_op)
    for j in range(n_masked, n_blocks):
        m_i, l_i, acc = _attend_block(j, q_s, k_s, v_s, ks_s, k_bar, v_bar, k_desc, vt_desc, ks_desc, KS_ptr, k_row,
                                      v_row, n_blocks, qs, qk_scale, last_key, m_i, l_i, acc, zero_s, zero_o, lane7,
                                      HEAD_DIM, BLOCK_N, STAGES, TOKEN_SCALES, PV_INT8, TWO_LEVEL, False, col_s,
                                      row_s, row_o, p_op)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_bar.index(i))
        mbarrier.invalidate(v_bar.index(i))

    _store_output(acc, l_i, VS_ptr, VM_ptr, O_ptr, bh_kv, b, h, m0, stride_ob, stride_oh, stride_om, NQ, HEAD_DIM,
                  WG_ROWS, SMOOTH_V, V_TENSOR, col_o, row_o)
    if RETURN_LSE:
        _store_lse(m_i, l_i, qk_scale, LSE_ptr, pid_bh, rows, NQ, LOG2_PMAX)


_LAUNCH = LaunchPlans(_attn_sm90_kernel)


@functools.cache
def shared_layouts(head_dim: int, block_n: int) -> tuple:
    """The shared-memory layouts of the K, Vᵀ and K-scale TMA blocks (``(block_n, D)`` int8, ``(D, block_n)``
    8-bit, ``(block_n,)`` float32), made once per ``(head_dim, block_n)``: a layout object costs µs to build."""
    return (gl.NVMMASharedLayout(swizzle_byte_width=min(128, head_dim), element_bitwidth=8, rank=2),
            gl.NVMMASharedLayout(swizzle_byte_width=min(128, block_n), element_bitwidth=8, rank=2),
            gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1))


def compile_options(head_dim: int) -> dict:
    """The kernel's launch options: 4 warps, and the register cap of :data:`MAXNREG`."""
    return dict(num_warps=4, maxnreg=MAXNREG[head_dim])


def operand_numerics(x: QuantizedQKV, qk_granularity: str) -> tuple[bool, bool, bool]:
    """The numerics family of ``x``'s operand formats, checked: ``(qk_fp8, pv_int8, v_tensor)``. Those of
    :func:`~quantpatch.kernels.attention.pingpong_gluon.check_operand_formats` (sage2, int8-flash), and FireQ's: e4m3
    Q/K with per-token scales, e4m3 V with one scale."""
    if x.q_hat.dtype != torch.float8_e4m3fn:
        pv_int8 = check_operand_formats(x, qk_granularity, "attn_qk_int8_pv_fp8_sm90")
        return False, pv_int8, pv_int8
    if (x.k_hat.dtype != torch.float8_e4m3fn or x.v_hat_t.dtype != torch.float8_e4m3fn or x.v_scale.numel() != 1
            or qk_granularity != "token"):
        raise ValueError("attn_qk_int8_pv_fp8_sm90 takes e4m3 Q/K with per-token scales and e4m3 V with one scale "
                         f"(fireq); got K̂ {x.k_hat.dtype}, V̂ {x.v_hat_t.dtype} with {x.v_scale.numel()} scales, "
                         f"qk_granularity={qk_granularity!r}")
    return True, False, True


def _rebased(desc: TensorDescriptor, base) -> TensorDescriptor:
    """``desc`` over another base of its dtype and alignment (checked when ``desc`` was made, not again)."""
    out = object.__new__(TensorDescriptor)
    out.__dict__.update(desc.__dict__, base=base)
    return out


class Sm90Launch:
    """One launch signature of :func:`attn_qk_int8_pv_fp8_sm90` (the operands' shapes, dtypes and alignment, ``nk``
    and the options): its checks, grid, integer arguments, constexprs, TMA descriptors and launch-plan key made
    once from operands ``x``; :meth:`__call__` launches over operands of that signature, as tensors or as
    :class:`~quantpatch.kernels.compiled_launch.DevicePointer` s once a launch with tensors made the plan."""

    def __init__(self, x: QuantizedQKV, nk: int, *, qk_granularity: str = "thread", is_causal: bool = False,
                 sm_scale: float | None = None, return_lse: bool = False, out_dtype: torch.dtype = torch.bfloat16,
                 block_n: int = 128, stages: int = DEFAULT_STAGES, two_level_accum: bool = True):
        b, h, nq, d = x.q_hat.shape
        hkv, nk_pad = x.k_hat.shape[1], x.k_hat.shape[2]
        qk_fp8, pv_int8, v_tensor = operand_numerics(x, qk_granularity)
        if x.delta_s.numel():
            raise ValueError("attn_qk_int8_pv_fp8_sm90 has no smooth Q (ΔS): quantize with smooth_q=False")
        if d not in HEAD_DIMS or nk_pad % block_n or h % hkv:
            raise ValueError(f"head_dim {d} (takes {HEAD_DIMS}), Nk_pad={nk_pad} (a multiple of block_n={block_n}), "
                             f"H={h} (a multiple of Hkv={hkv})")
        if (x.k_hat.shape != (b, hkv, nk_pad, d) or x.v_hat_t.shape != (b, hkv, d, nk_pad)
                or x.k_scale.shape != (b, hkv, nk_pad)
                or not (x.k_hat.is_contiguous() and x.v_hat_t.is_contiguous() and x.k_scale.is_contiguous())):
            raise ValueError(f"K̂ {tuple(x.k_hat.shape)}, V̂ᵀ {tuple(x.v_hat_t.shape)}, K scales "
                             f"{tuple(x.k_scale.shape)} for Q̂ {tuple(x.q_hat.shape)}: TMA reads contiguous (B, Hkv, "
                             "Nk_pad, D), (B, Hkv, D, Nk_pad) and (B, Hkv, Nk_pad)")
        scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
        self.out_shape, self.out_dtype = (b, h, nq, d), out_dtype
        self.lse_shape = (b, h, nq) if return_lse else (0,)
        k_layout, v_layout, vec_layout = shared_layouts(d, block_n)
        # the descriptors name the (contiguous) operands as 2-D / 1-D by shape and strides (no view made per call),
        # checked on x's operands, then kept without a base: a kept launch holds no operand alive
        self.descriptors = tuple(_rebased(desc, None) for desc in (
            TensorDescriptor(x.k_hat, [b * hkv * nk_pad, d], [d, 1], [block_n, d], k_layout),
            TensorDescriptor(x.v_hat_t, [b * hkv * d, nk_pad], [nk_pad, 1], [d, block_n], v_layout),
            TensorDescriptor(x.k_scale, [b * hkv * nk_pad], [1], [block_n], vec_layout)))
        # o is contiguous (B, H, Nq, D), allocated by the caller in out_shape
        self.ints = (h * nq * d, nq * d, d, nq, nk, nk_pad, h, h // hkv)
        self.qk_scale = scale * LOG2E
        self.grid = (cdiv(nq, BLOCK_M), b * h)
        self.constexprs = dict(HEAD_DIM=d, BLOCK_N=block_n, STAGES=stages, CAUSAL=is_causal,
                               SMOOTH_V=x.v_mean.numel() > 0, RETURN_LSE=return_lse,
                               TOKEN_SCALES=qk_granularity == "token", QK_FP8=qk_fp8, PV_INT8=pv_int8,
                               V_TENSOR=v_tensor, TWO_LEVEL=two_level_accum or pv_int8)
        # Triton specializes a descriptor on its dtype, block shape and layout (the constexprs and these dtypes): the
        # key is the specialization of the other arguments (o and lse are allocated by the caller; qk_scale a float)
        tensors = (x.q_hat, x.q_scale, x.k_scale, x.v_scale, x.v_mean)
        self.plan_key = (out_dtype, x.k_hat.dtype, x.v_hat_t.dtype, specialization(tensors + self.ints))
        self.options = compile_options(d)
        self.bound = None  # the launch's BoundLaunch once bind() found its plan

    def bind(self, device: int) -> None:
        """Bind the launch's plan on CUDA device ``device`` (made by a first call), so that later calls skip the plan
        lookup (unbound while no call made it)."""
        self.bound = _LAUNCH.bound(self.grid, self.constexprs, plan_key=self.plan_key, device=device, **self.options)

    def outputs(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``o`` and ``lse`` of a call, empty."""
        return (torch.empty(self.out_shape, device=device, dtype=self.out_dtype),
                torch.empty(self.lse_shape, device=device, dtype=torch.float32))

    def __call__(self, x: QuantizedQKV, o: torch.Tensor, lse: torch.Tensor, device: int | None = None) -> None:
        """Attend over ``x`` into ``o`` and ``lse`` (of :meth:`outputs`) on the current stream; ``device``: the CUDA
        device index where ``x`` holds addresses."""
        k_desc, vt_desc, ks_desc = self.descriptors
        args = (x.q_hat, _rebased(k_desc, x.k_hat), _rebased(vt_desc, x.v_hat_t), _rebased(ks_desc, x.k_scale),
                x.q_scale, x.k_scale, x.v_scale, x.v_mean, o, lse, *self.ints, self.qk_scale)
        if self.bound is not None:
            self.bound(current_stream(o.device.index if device is None else device), args)
            return
        _LAUNCH(self.grid, args, self.constexprs, plan_key=self.plan_key, device=device, **self.options)


def attn_qk_int8_pv_fp8_sm90(
    x: QuantizedQKV,
    nk: int,
    *,
    qk_granularity: str = "thread",
    is_causal: bool = False,
    sm_scale: float | None = None,
    return_lse: bool = False,
    out_dtype: torch.dtype = torch.bfloat16,
    block_n: int = 128,
    stages: int = DEFAULT_STAGES,
    two_level_accum: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """sage2 (without smooth Q), int8-flash or fireq attention over
    :func:`~quantpatch.kernels.attention.qk_quant_triton.quantize_qkv` operands quantized with ``v_key_order=True``
    (``x.v_hat_t``'s keys in ``pingpong_gluon.wgmma_key_order``); causal is bottom-right aligned, as the reference.
    The operands pick the numerics, as in the Triton kernel: INT8 Q/K with FP8 V and per-channel V scales →
    P̂ = e4m3(448 P̃) (sage2); INT8 V with one scale → P̂ = rne(127 P̃) and ℓ from P̂ (int8-flash); e4m3 Q/K and V with
    one V scale → FP8 Q̂·K̂ᵀ in fp32, P̂ = e4m3(448 P̃) (fireq).

    ``qk_granularity``: ``"thread"``, SageAttention2's per-thread groups (``block_q / warps`` a multiple of 16,
    ``block_k`` of 64), read as one δQ·δK a lane; ``"token"``: one scale a token (int8-flash, fireq), δK brought
    with K. ``two_level_accum``: an FP8 P̂·V in its own accumulator, added to the main one (SageAttention2 §3.4), or
    accumulated into it (fireq's default). ``stages``: depth of the K and Vᵀ rings; the ptxas register cap (more
    programs an SM): :func:`compile_options`.
    Returns ``o (B, H, Nq, D)`` in ``out_dtype`` and ``lse (B, H, Nq)`` float32 (natural log; empty unless asked).
    """
    launch = Sm90Launch(x, nk, qk_granularity=qk_granularity, is_causal=is_causal, sm_scale=sm_scale,
                        return_lse=return_lse, out_dtype=out_dtype, block_n=block_n, stages=stages,
                        two_level_accum=two_level_accum)
    o, lse = launch.outputs(x.q_hat.device)
    launch(x, o, lse)
    return o, lse
