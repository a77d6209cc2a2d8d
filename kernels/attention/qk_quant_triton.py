"""Fused Q/K/V preprocessing for the quantized attention kernels (Triton).

One call turns bf16/fp16 ``q (B, H, Nq, D)``, ``k, v (B, Hkv, Nk, D)`` into the operands of
``attn_qk_int8_pv_fp8``; every integer / FP8 value and every scale equals the one of
``quant_ref.quantize_tokens`` / ``quant_attention_ref.quantize_v`` on the same smoothed input::

    K̄ = mean_tokens(K)            γ(K) = K − K̄                          (smooth_k)
    q̄_b = mean(Q rows of block b) γ(Q) = Q − q̄_b                        (smooth_q)
    δ = absmax(group) / qmax (1 for an all-zero group)   X̂ = clamp(rne(X / δ), −qmax, qmax)
    ΔS[b, j] = q̄_b · γ(K_j) = q̄_b · K_j − q̄_b · K̄    (fp32, one row of Nk per query block)
    V̂ = e4m3(V / δV) or clamp(rne(V / δV), ±qmax),  δV = absmax_channel|tensor|block / vmax

Launches (three):

1. ``_q_and_kv_stats_kernel``: programs of two kinds in one grid. Query-block programs
   (``_quant_q_block``: block mean q̄, groups, quantization, in 32-row tiles); statistics programs
   (``_kv_stats_chunk``: column-sum / max / min partials of K and V over 512 tokens, the V absmax).
   The program that finishes a kv head's last chunk (an atomic ticket) reduces that head's partials
   in a fixed order (``_kv_finalize_head``: K̄, V̄, V channel scales), so no launch waits for it, and sets
   the ticket back to 0: partials and tickets are the stream's scratch, kept across calls (no allocation,
   no zero-fill launch a call; fresh while a CUDA graph captures).
2. ``_delta_s_kernel``: ΔS_raw = q̄ · Kᵀ on the *raw* K (K̄ spans all tokens).
3. ``_quant_kv_kernel``: the second pass over K and V: smooth and quantize K, quantize V and
   write it transposed.

ΔS_raw differs from the reference's ΔS = q̄_b · γ(K_j) by the row constant q̄_b · K̄, which moves a row's
scores and its max alike: the attention kernels add ΔS_raw as stored and subtract q̄_b · K̄ from the LSE
only (exact products, one fp32 cancellation of size |q̄ · K̄|).

Numerics: divisions are IEEE (as PyTorch): ``tl.math.div_rn``, or per element one FMA-corrected
product with a per-row / per-channel reciprocal (``_div_by``, the same quotient); rounding is
round-half-even through the 1.5·2²³ trick (exact for |x| < 2²²; values here are ≤ qmax·(1+ε)),
FP8 casts saturate to ±448 then round to nearest even (``cvt.rn.satfinite`` on the GPU; an
exact emulation under ``TRITON_INTERPRET=1``, whose own FP8 cast rounds ties up).

Layouts written (all contiguous): ``q_hat (B, H, Nq, D)``, ``q_scale (B, H, Nq)``,
``k_hat (B, Hkv, Nk_pad, D)``, ``k_scale (B, Hkv, Nk_pad)`` (pad rows are 0), ``v_hat_t
(B, Hkv, D, Nk_pad)``: V transposed, tokens contiguous, because Hopper's 8-bit wgmma reads
both operands K-major; ``delta_s (B, H, ceil(Nq / block_q), Nk_pad)`` = q̄ · Kᵀ (raw K), −inf at the pad
columns (so a kernel adding ΔS needs no key mask); causal calls write only the key tiles a causal kernel reads
(``delta_s_written``). ``Nk_pad`` rounds Nk
up to the attention kernel's key block so its loads need no masks.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..compiled_launch import DevicePointer, LaunchPlans, cdiv, current_stream, interpreting, stream_key
from ..quant_ref import FP8_MAX, cast_fp8, quantize_symmetric, quantize_tokens, symmetric_scale, token_absmax
from ..rounding_triton import _div_by, _rne, _to_fp8e4m3

# Integer ids of the string knobs (constexpr switches compile unused branches out).
GRAN_IDS = {"token": 0, "block": 1, "warp": 2, "thread": 3}
FMT_INT, FMT_FP8 = 0, 1
V_NONE, V_CHANNEL, V_TENSOR, V_BLOCK = 0, 1, 2, 3
V_GRAN_IDS = {"channel": V_CHANNEL, "tensor": V_TENSOR, "block": V_BLOCK}

STATS_TILE = 16  # tokens per load of the K/V statistics pass
STATS_TILES = 32  # loads per program: one partial per STATS_TILES · STATS_TILE tokens (8: 7 % slower at 8k, H200)
# rows a load of the Q pass (at least one warp segment): 64 against 32, the pass of sage2-8b 0.86–0.88× the time at D=64
# from 8k tokens, about 0.96× at D=128 (B=4, H=32, H200; docs/performance.md)
Q_SUB_ROWS = 64
Q_STATS_WARPS = 4  # launch 1 (H200: 8 warps 1.3–1.4× slower at 2k–32k)
# launch of the ΔS GEMM: query-block tiles of 64, or of 16 for calls of at most short_nqb query blocks (H200,
# the ΔS launch alone: 16 is 1.3× as fast at 1k and 2k, even at 4k; 64 is 1.4× as fast from 8k on)
DS_TUNING = dict(block_n=128, qb_tile=64, num_warps=4, num_stages=2, qb_tile_short=16, short_nqb=32)


# --------------------------------------------------------------------------- jit helpers


@triton.jit
def _group_absmax(amax, T: tl.constexpr, GRAN: tl.constexpr, ROLE_Q: tl.constexpr, GBLOCK: tl.constexpr,
                  WARPS: tl.constexpr):
    """Absmax of each token's group (``quant_ref.token_group_index``) for a tile of ``T`` rows.

    ``amax`` is the per-row absmax ``[T]`` of a tile starting at a multiple of ``GBLOCK``
    (``T`` a multiple of ``GBLOCK`` or of its warp segment).
    """
    if GRAN == 0:  # token
        out = amax
    elif GRAN == 1 or (GRAN == 2 and not ROLE_Q):  # block (K's warp groups are its blocks)
        g = tl.max(tl.reshape(amax, [T // GBLOCK, GBLOCK]), 1)
        out = tl.reshape(tl.broadcast_to(g[:, None], [T // GBLOCK, GBLOCK]), [T])
    elif GRAN == 2:  # warp: Q block split in WARPS segments
        SEG: tl.constexpr = GBLOCK // WARPS
        g = tl.max(tl.reshape(amax, [T // SEG, SEG]), 1)
        out = tl.reshape(tl.broadcast_to(g[:, None], [T // SEG, SEG]), [T])
    elif ROLE_Q:  # thread, Q: rows 8k + i of a warp segment share group i
        SEG: tl.constexpr = GBLOCK // WARPS
        g = tl.max(tl.reshape(amax, [T // SEG, SEG // 8, 8]), 1)
        out = tl.reshape(tl.broadcast_to(g[:, None, :], [T // SEG, SEG // 8, 8]), [T])
    else:  # thread, K: rows 8k + 2i and 8k + 2i + 1 of a block share group i
        g = tl.max(tl.max(tl.reshape(amax, [T // GBLOCK, GBLOCK // 8, 4, 2]), 3), 1)
        out = tl.reshape(tl.broadcast_to(g[:, None, :, None], [T // GBLOCK, GBLOCK // 8, 4, 2]), [T])
    return out


@triton.jit
def _quantize_rows(x, gmax, QMAX: tl.constexpr, FMT: tl.constexpr, EMULATE: tl.constexpr):
    """``(x̂, δ)`` for a tile ``x [T, D]`` (fp32) and its group absmax ``gmax [T]``."""
    scale = tl.math.div_rn(gmax, QMAX)
    scale = tl.where(scale == 0.0, 1.0, scale)
    y = _div_by(x, scale[:, None])
    if FMT == 0:
        xq = tl.minimum(tl.maximum(_rne(y), -QMAX), QMAX).to(tl.int8)
    else:
        xq = _to_fp8e4m3(y, EMULATE)
    return xq, scale


# --------------------------------------------------------------------------- kernels


@triton.jit
def _split_bf16(x):
    """``x`` (fp32) as ``hi + mid + lo`` in bf16 (24 significant bits: exact up to rounding of ``lo``)."""
    hi = x.to(tl.bfloat16)
    r = x - hi.to(tl.float32)
    mid = r.to(tl.bfloat16)
    lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
    return hi, mid, lo


@triton.jit
def _dot_bf16(a, b, acc, EMULATE: tl.constexpr):
    """``acc + a · bᵀ`` for bf16 ``a``, ``b`` with fp32 accumulation (the interpreter's own bf16 dot
    multiplies raw bit patterns, so there the exact bf16 values are widened to fp32 first)."""
    if EMULATE:
        return tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(a, tl.trans(b), acc)


@triton.jit
def _q_tile(x_base, rows, stride_xn, offs_d, N, mean, SMOOTH: tl.constexpr):
    """Rows ``rows [SUB]`` of a query block as fp32 ``[SUB, D]``, zero past ``N``; minus ``mean [D]`` if SMOOTH."""
    mask = rows[:, None] < N
    x = tl.load(x_base + rows[:, None] * stride_xn + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    if SMOOTH:
        x = tl.where(mask, x - mean[None, :], 0.0)
    return x


@triton.jit
def _quant_q_block(
    X_ptr, XQ_ptr, XS_ptr, XM_ptr, pid_n, pid_bh,
    stride_xb, stride_xh, stride_xn,
    N, H, NB,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, SUB: tl.constexpr, GRAN: tl.constexpr, WARPS: tl.constexpr,
    QMAX: tl.constexpr, FMT: tl.constexpr, SMOOTH: tl.constexpr, EMULATE: tl.constexpr,
):
    """Query block ``pid_n`` (BLOCK = block_q rows) of head ``pid_bh``: optional block-mean smoothing, grouped
    quantization, in SUB-row tiles (a multiple of the warp segment, so no quantization group spans two):
    a pass for the block mean, one for a per-block absmax, then one that quantizes. The later passes re-read
    the block from cache; tiles of SUB rows keep few registers, so many programs overlap their loads."""
    b = pid_bh // H
    h = pid_bh % H
    offs_d = tl.arange(0, HEAD_DIM)
    x_base = X_ptr + b * stride_xb + h * stride_xh
    row0 = pid_n * BLOCK
    mean = tl.zeros([HEAD_DIM], dtype=tl.float32)
    if SMOOTH:
        col_sum = tl.zeros([SUB, HEAD_DIM], dtype=tl.float32)
        for t in tl.range(0, BLOCK // SUB, num_stages=2):
            col_sum += _q_tile(x_base, row0 + t * SUB + tl.arange(0, SUB), stride_xn, offs_d, N, mean, False)
        mean = tl.math.div_rn(tl.sum(col_sum, 0), tl.minimum(N - row0, BLOCK).to(tl.float32))
        tl.store(XM_ptr + (pid_bh * NB + pid_n) * HEAD_DIM + offs_d, mean)
    if GRAN == 1:  # one group for the whole block
        block_max = tl.zeros([SUB], dtype=tl.float32)
        for t in tl.range(0, BLOCK // SUB, num_stages=2):
            x = _q_tile(x_base, row0 + t * SUB + tl.arange(0, SUB), stride_xn, offs_d, N, mean, SMOOTH)
            block_max = tl.maximum(block_max, tl.max(tl.abs(x), 1))
        block_max = tl.max(block_max, 0)
    for t in tl.range(0, BLOCK // SUB, num_stages=2):
        rows = row0 + t * SUB + tl.arange(0, SUB)
        x = _q_tile(x_base, rows, stride_xn, offs_d, N, mean, SMOOTH)
        if GRAN == 1:
            gmax = tl.full([SUB], 0.0, dtype=tl.float32) + block_max
        else:
            gmax = _group_absmax(tl.max(tl.abs(x), 1), SUB, GRAN, True, BLOCK, WARPS)
        xq, scale = _quantize_rows(x, gmax, QMAX, FMT, EMULATE)
        tl.store(XQ_ptr + (pid_bh * N + rows[:, None]) * HEAD_DIM + offs_d[None, :], xq, mask=rows[:, None] < N)
        tl.store(XS_ptr + pid_bh * N + rows, scale, mask=rows < N)


@triton.jit
def _kv_stats_chunk(
    K_ptr, V_ptr, KSUM_ptr, VSUM_ptr, VMAX_ptr, VMIN_ptr, VABS_ptr, pid_c, pid_bh,
    stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    NK, HKV, NCHUNK,
    HEAD_DIM: tl.constexpr, TILE: tl.constexpr, TILES: tl.constexpr,
    DO_K: tl.constexpr, DO_VSUM: tl.constexpr, DO_VMINMAX: tl.constexpr, DO_VABS: tl.constexpr,
):
    """Chunk ``pid_c`` (TILES · TILE tokens) of kv head ``pid_bh``: column-sum partials of K and V, column
    max/min partials of V, and the global absmax of V (atomic max: order-free, exact). Element-wise
    accumulators over the TILES loads (pipelined), one reduction over the TILE rows at the end: a fixed
    order for a given shape."""
    b = pid_bh // HKV
    hk = pid_bh % HKV
    offs_d = tl.arange(0, HEAD_DIM)
    k_sum = tl.zeros([TILE, HEAD_DIM], dtype=tl.float32)
    v_sum = tl.zeros([TILE, HEAD_DIM], dtype=tl.float32)
    v_max = tl.full([TILE, HEAD_DIM], float("-inf"), dtype=tl.float32)
    v_min = tl.full([TILE, HEAD_DIM], float("inf"), dtype=tl.float32)
    for t in tl.range(0, TILES, num_stages=3):
        rows = (pid_c * TILES + t) * TILE + tl.arange(0, TILE)
        mask = rows[:, None] < NK
        if DO_K:
            k_sum += tl.load(K_ptr + b * stride_kb + hk * stride_kh + rows[:, None] * stride_kn + offs_d[None, :],
                             mask=mask, other=0.0).to(tl.float32)
        if DO_VSUM or DO_VMINMAX or DO_VABS:
            vt = tl.load(V_ptr + b * stride_vb + hk * stride_vh + rows[:, None] * stride_vn + offs_d[None, :],
                         mask=mask, other=0.0).to(tl.float32)
            v_max = tl.maximum(v_max, tl.where(mask, vt, float("-inf")))
            v_min = tl.minimum(v_min, tl.where(mask, vt, float("inf")))
            v_sum += vt
    out = (pid_bh * NCHUNK + pid_c) * HEAD_DIM + offs_d
    if DO_K:
        tl.store(KSUM_ptr + out, tl.sum(k_sum, 0))
    if DO_VSUM:
        tl.store(VSUM_ptr + out, tl.sum(v_sum, 0))
    if DO_VMINMAX:
        tl.store(VMAX_ptr + out, tl.max(v_max, 0))
        tl.store(VMIN_ptr + out, tl.min(v_min, 0))
    if DO_VABS:
        tl.atomic_max(VABS_ptr, tl.max(tl.maximum(tl.max(v_max, 0), -tl.min(v_min, 0)), 0))


@triton.jit
def _kv_finalize_head(
    KSUM_ptr, VSUM_ptr, VMAX_ptr, VMIN_ptr, KM_ptr, VM_ptr, VS_ptr, pid_bh,
    NCHUNK, NK_F,
    HEAD_DIM: tl.constexpr, RTILE: tl.constexpr, V_QMAX: tl.constexpr,
    SMOOTH_K: tl.constexpr, SMOOTH_V: tl.constexpr, V_CHANNEL: tl.constexpr,
):
    """Kv head ``pid_bh``: reduce the statistics partials in a fixed order (deterministic) into K̄, V̄ and
    the per-channel V scale absmax(V − V̄) / vmax (1 for an all-zero channel). The partials were written
    by other programs of the same launch: they are read from L2 (``.cg``), past this SM's L1."""
    offs_c = tl.arange(0, RTILE)
    offs_d = tl.arange(0, HEAD_DIM)
    base = pid_bh * NCHUNK * HEAD_DIM
    k_sum = tl.zeros([HEAD_DIM], dtype=tl.float32)
    v_sum = tl.zeros([HEAD_DIM], dtype=tl.float32)
    v_max = tl.full([HEAD_DIM], float("-inf"), dtype=tl.float32)
    v_min = tl.full([HEAD_DIM], float("inf"), dtype=tl.float32)
    for c0 in range(0, NCHUNK, RTILE):
        ptrs = base + (c0 + offs_c)[:, None] * HEAD_DIM + offs_d[None, :]
        m = (c0 + offs_c)[:, None] < NCHUNK
        if SMOOTH_K:
            k_sum += tl.sum(tl.load(KSUM_ptr + ptrs, mask=m, other=0.0, cache_modifier=".cg"), 0)
        if SMOOTH_V:
            v_sum += tl.sum(tl.load(VSUM_ptr + ptrs, mask=m, other=0.0, cache_modifier=".cg"), 0)
        if V_CHANNEL:
            v_max = tl.maximum(v_max, tl.max(tl.load(VMAX_ptr + ptrs, mask=m, other=float("-inf"),
                                                     cache_modifier=".cg"), 0))
            v_min = tl.minimum(v_min, tl.min(tl.load(VMIN_ptr + ptrs, mask=m, other=float("inf"),
                                                     cache_modifier=".cg"), 0))
    if SMOOTH_K:
        tl.store(KM_ptr + pid_bh * HEAD_DIM + offs_d, tl.math.div_rn(k_sum, NK_F))
    if SMOOTH_V:
        v_mean = tl.math.div_rn(v_sum, NK_F)
        tl.store(VM_ptr + pid_bh * HEAD_DIM + offs_d, v_mean)
    if V_CHANNEL:
        # |v − v̄| peaks at the channel max or min (fp32 subtraction is monotonic)
        if SMOOTH_V:
            amax = tl.maximum(v_max - v_mean, v_mean - v_min)
        else:
            amax = tl.maximum(v_max, -v_min)
        v_scale = tl.math.div_rn(amax, V_QMAX)
        tl.store(VS_ptr + pid_bh * HEAD_DIM + offs_d, tl.where(v_scale == 0.0, 1.0, v_scale))


@triton.jit(do_not_specialize=["NK", "DIAG"])
def _delta_s_kernel(
    K_ptr, QM_ptr, DS_ptr,
    stride_kb, stride_kh, stride_kn,
    NK, NK_PAD, HKV, GROUP, NQB, DIAG,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, QB_TILE: tl.constexpr, Q_BLOCK: tl.constexpr,
    K_BF16: tl.constexpr, CAUSAL: tl.constexpr, EMULATE: tl.constexpr,
):
    """ΔS_raw[b, h, qb, j] = q̄[b, h, qb] · K[b, h // G, j] for BLOCK_N keys of a kv head and every query block
    of its G query heads; −inf at the padding keys Nk ≤ j < Nk_pad. CAUSAL: only for the query blocks that see
    one of these keys (``j0 < (qb + 1) · Q_BLOCK + DIAG`` for the tile's first key ``j0``, ``DIAG = Nk − Nq``).

    A small GEMM (M = query blocks, N = keys, K = head_dim) on the raw K, exact in bf16 where K − K̄ would
    not be; ΔS_raw keeps the row constant q̄ · K̄ (see the module docstring). It runs on bf16 tensor cores
    over exact splits (q̄ = hi + mid + lo; K exact in bf16, or hi + lo from fp16): every product is exact,
    the sums are fp32.
    """
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)  # offsets of large tensors exceed int32
    b = pid_bh // HKV
    hk = pid_bh % HKV
    key0 = pid_n * BLOCK_N
    rows = key0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    qb_first = 0
    if CAUSAL:  # the first query block whose last row sees key0
        qb_first = tl.maximum(key0 - DIAG, 0) // Q_BLOCK
    k_in = tl.load(K_ptr + b * stride_kb + hk * stride_kh + rows[:, None] * stride_kn + offs_d[None, :],
                   mask=rows[:, None] < NK, other=0.0)
    if K_BF16:
        k_hi = k_in
        k_lo = k_in  # unused
    else:
        kt = k_in.to(tl.float32)
        k_hi = kt.to(tl.bfloat16)
        k_lo = (kt - k_hi.to(tl.float32)).to(tl.bfloat16)
    offs_qb = tl.arange(0, QB_TILE)
    for g in range(GROUP):
        bh_q = b * HKV * GROUP + hk * GROUP + g
        for qb0 in range(qb_first // QB_TILE * QB_TILE, NQB, QB_TILE):
            qb = qb0 + offs_qb
            qm = tl.load(QM_ptr + (bh_q * NQB + qb[:, None]) * HEAD_DIM + offs_d[None, :],
                         mask=qb[:, None] < NQB, other=0.0)
            q_hi, q_mid, q_lo = _split_bf16(qm)
            ds = _dot_bf16(q_hi, k_hi, tl.zeros([QB_TILE, BLOCK_N], dtype=tl.float32), EMULATE)
            ds = _dot_bf16(q_mid, k_hi, ds, EMULATE)
            ds = _dot_bf16(q_lo, k_hi, ds, EMULATE)
            if not K_BF16:
                ds = _dot_bf16(q_hi, k_lo, ds, EMULATE)
                ds = _dot_bf16(q_mid, k_lo, ds, EMULATE)
                ds = _dot_bf16(q_lo, k_lo, ds, EMULATE)
            ds = tl.where(rows[None, :] < NK, ds, float("-inf"))
            tl.store(DS_ptr + (bh_q * NQB + qb[:, None]) * NK_PAD + rows[None, :], ds,
                     mask=(qb[:, None] < NQB) & (qb[:, None] >= qb_first) & (rows[None, :] < NK_PAD))


@triton.jit(do_not_specialize=["NK"])
def _quant_kv_kernel(
    K_ptr, V_ptr, KQ_ptr, KS_ptr, KM_ptr, VT_ptr, VS_ptr, VM_ptr, VABS_ptr,
    stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    NK, NK_PAD, HKV, NKB,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, GRAN: tl.constexpr, QMAX: tl.constexpr,
    K_FMT: tl.constexpr, SMOOTH_K: tl.constexpr,
    V_MODE: tl.constexpr, V_FMT: tl.constexpr, V_QMAX: tl.constexpr, SMOOTH_V: tl.constexpr,
    V_KEY_ORDER: tl.constexpr, EMULATE: tl.constexpr,
):
    """BLOCK key rows of one kv head (rows past Nk, up to Nk_pad, are written as zeros): smooth + quantize K,
    quantize V and write it transposed (statistics from the first launch); with ``V_KEY_ORDER`` the keys of
    each 32 in the Gluon kernel's order (``pingpong_gluon.wgmma_key_order``)."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)  # offsets of large tensors exceed int32
    b = pid_bh // HKV
    hk = pid_bh % HKV
    rows = pid_n * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    valid = rows[:, None] < NK

    k = tl.load(K_ptr + b * stride_kb + hk * stride_kh + rows[:, None] * stride_kn + offs_d[None, :],
                mask=valid, other=0.0).to(tl.float32)
    if SMOOTH_K:
        k = tl.where(valid, k - tl.load(KM_ptr + pid_bh * HEAD_DIM + offs_d)[None, :], 0.0)
    gmax = _group_absmax(tl.max(tl.abs(k), 1), BLOCK, GRAN, False, BLOCK, 1)
    kq, k_scale = _quantize_rows(k, gmax, QMAX, K_FMT, EMULATE)
    tl.store(KQ_ptr + (pid_bh * NK_PAD + rows[:, None]) * HEAD_DIM + offs_d[None, :], kq)
    tl.store(KS_ptr + pid_bh * NK_PAD + rows, tl.where(rows < NK, k_scale, 0.0))

    if V_MODE != 0:  # V, written transposed: VT[b, hk, d, token]
        v_rows = rows
        if V_KEY_ORDER:  # column 32g + k holds key 32g + 16k₄ + 8k₁ + 4k₃ + 2k₂ + k₀: rows read in that order
            v_rows = (rows & ~15) | (rows & 1) | ((rows & 2) << 2) | ((rows & 12) >> 1)
        v_valid = v_rows[:, None] < NK
        v = tl.load(V_ptr + b * stride_vb + hk * stride_vh + v_rows[:, None] * stride_vn + offs_d[None, :],
                    mask=v_valid, other=0.0).to(tl.float32)
        if SMOOTH_V:
            v = tl.where(v_valid, v - tl.load(VM_ptr + pid_bh * HEAD_DIM + offs_d)[None, :], 0.0)
        if V_MODE == 1:  # per channel (scale from the first launch)
            y = _div_by(v, tl.load(VS_ptr + pid_bh * HEAD_DIM + offs_d)[None, :])
        elif V_MODE == 2:  # one scale for the whole tensor
            v_scale = tl.math.div_rn(tl.load(VABS_ptr), V_QMAX)
            v_scale = tl.where(v_scale == 0.0, 1.0, v_scale)
            if (pid_n == 0) & (pid_bh == 0):
                tl.store(VS_ptr, v_scale)
            y = _div_by(v, v_scale)
        else:  # one scale per BLOCK tokens (BLOCK = block_k)
            v_scale = tl.math.div_rn(tl.max(tl.max(tl.abs(v), 1), 0), V_QMAX)
            v_scale = tl.where(v_scale == 0.0, 1.0, v_scale)
            tl.store(VS_ptr + pid_bh * NKB + pid_n, v_scale)
            y = _div_by(v, v_scale)
        if V_FMT == 0:
            vq = tl.minimum(tl.maximum(_rne(y), -V_QMAX), V_QMAX).to(tl.int8)
        else:
            vq = _to_fp8e4m3(y, EMULATE)
        tl.store(VT_ptr + (pid_bh * HEAD_DIM + offs_d[None, :]) * NK_PAD + rows[:, None], vq)


@triton.jit(do_not_specialize=["NQ", "NK"])
def _q_and_kv_stats_kernel(
    Q_ptr, QQ_ptr, QS_ptr, QM_ptr,
    K_ptr, V_ptr, KSUM_ptr, VSUM_ptr, VMAX_ptr, VMIN_ptr, VABS_ptr, TICKET_ptr, KM_ptr, VM_ptr, VS_ptr,
    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    NQ, H, NQB, STATS_PROGRAMS, NK, HKV, NCHUNK, NK_F,
    HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, Q_SUB: tl.constexpr, GRAN: tl.constexpr, WARPS: tl.constexpr,
    QMAX: tl.constexpr, QK_FMT: tl.constexpr, SMOOTH_Q: tl.constexpr, SMOOTH_K: tl.constexpr, SMOOTH_V: tl.constexpr,
    V_CHANNEL: tl.constexpr, V_ABS: tl.constexpr, V_QMAX: tl.constexpr, FINALIZE: tl.constexpr,
    TILE: tl.constexpr, TILES: tl.constexpr, RTILE: tl.constexpr, EMULATE: tl.constexpr,
):
    """First launch. Programs ``[0, STATS_PROGRAMS)``: one statistics chunk each (``_kv_stats_chunk``), first in
    the grid because each streams many tokens: the short query-block programs fill the SMs around them. The program
    that finishes a kv head's last chunk (a ticket: an acq_rel atomic counter per head, 0 at the launch, after a CTA
    barrier that orders every thread's partial stores before it) reduces that head's partials
    (``_kv_finalize_head``) and sets the ticket back to 0. The rest: one query block each (``_quant_q_block``)."""
    pid = tl.program_id(0)
    if pid >= STATS_PROGRAMS:
        q_pid = pid - STATS_PROGRAMS
        _quant_q_block(Q_ptr, QQ_ptr, QS_ptr, QM_ptr, q_pid % NQB, (q_pid // NQB).to(tl.int64),
                       stride_qb, stride_qh, stride_qn, NQ, H, NQB,
                       HEAD_DIM, BLOCK_Q, Q_SUB, GRAN, WARPS, QMAX, QK_FMT, SMOOTH_Q, EMULATE)
    else:
        pid_bh = (pid // NCHUNK).to(tl.int64)  # offsets of large tensors exceed int32
        _kv_stats_chunk(K_ptr, V_ptr, KSUM_ptr, VSUM_ptr, VMAX_ptr, VMIN_ptr, VABS_ptr, pid % NCHUNK, pid_bh,
                        stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, NK, HKV, NCHUNK,
                        HEAD_DIM, TILE, TILES, SMOOTH_K, SMOOTH_V, V_CHANNEL, V_ABS)
        if FINALIZE:
            tl.debug_barrier()
            if tl.atomic_add(TICKET_ptr + pid_bh, 1, sem="acq_rel") == NCHUNK - 1:
                _kv_finalize_head(KSUM_ptr, VSUM_ptr, VMAX_ptr, VMIN_ptr, KM_ptr, VM_ptr, VS_ptr, pid_bh,
                                  NCHUNK, NK_F, HEAD_DIM, RTILE, V_QMAX, SMOOTH_K, SMOOTH_V, V_CHANNEL)
                # every program of the head has taken its ticket: back to 0 for the next launch on this stream
                tl.store(TICKET_ptr + pid_bh, 0)


# --------------------------------------------------------------------------- launcher

_STATS_LAUNCH = LaunchPlans(_q_and_kv_stats_kernel)  # later calls of a shape skip JITFunction.run's host work
_DELTA_S_LAUNCH = LaunchPlans(_delta_s_kernel)
_KV_LAUNCH = LaunchPlans(_quant_kv_kernel)


class QuantizedQKV(NamedTuple):
    """Operands of the quantized attention kernels (see the module docstring for layouts).

    Unused fields are empty tensors (custom ops return tensors only).
    """

    q_hat: torch.Tensor
    q_scale: torch.Tensor
    q_mean: torch.Tensor
    k_hat: torch.Tensor
    k_scale: torch.Tensor
    k_mean: torch.Tensor
    delta_s: torch.Tensor
    v_hat_t: torch.Tensor
    v_scale: torch.Tensor
    v_mean: torch.Tensor


def _delta_s_tile(pad_to: int) -> int:
    """Keys of a ΔS program (a divisor of every attention kernel's key block)."""
    return min(DS_TUNING["block_n"], pad_to)


def delta_s_written(nq: int, nk: int, *, block_q: int, pad_to: int, is_causal: bool,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """The entries ``(ceil(Nq / block_q), Nk_pad)`` of ``delta_s`` that :func:`quantize_qkv` writes (bool): all, or
    with ``is_causal`` a query block ``qb``'s key tiles (of ``min(128, pad_to)`` keys) that start before
    ``(qb + 1) · block_q + Nk − Nq``, every key block a bottom-right aligned causal kernel reads."""
    nk_pad = cdiv(nk, pad_to) * pad_to
    if not is_causal:
        return torch.ones(cdiv(nq, block_q), nk_pad, dtype=torch.bool, device=device)
    tile = _delta_s_tile(pad_to)
    key0 = torch.arange(0, nk_pad, device=device) // tile * tile
    qb = torch.arange(cdiv(nq, block_q), device=device)
    return key0[None, :] < (qb[:, None] + 1) * block_q + (nk - nq)


def _fmt_id(fmt: str) -> int:
    if fmt in ("int8", "int4"):
        return FMT_INT
    if fmt == "fp8_e4m3":
        return FMT_FP8
    raise ValueError(f"unsupported operand format {fmt!r}; the kernels take int8, int4 or fp8_e4m3")


def _check_inputs(q, k, v):
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"expected q (B, H, Nq, D), k/v (B, Hkv, Nk, D); got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if q.dtype not in (torch.float16, torch.bfloat16) or not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must share dtype float16 or bfloat16, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[-1] not in (64, 128) or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"head_dim must be 64 or 128 for q and k, got {q.shape[-1]}, {k.shape[-1]}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} not a multiple of kv heads {k.shape[1]}")


class _Recipe(NamedTuple):
    """What :func:`quantize_qkv` derives from its options, head_dim and dtype alone (:func:`_recipe`)."""

    qk_dtype: torch.dtype
    v_dtype: torch.dtype
    v_mode: int
    need_stats: bool  # launch 1 has statistics programs
    need_vabs: bool  # V's absmax (a per-tensor V scale), an atomic max into a zeroed float
    stats_constexprs: dict
    delta_s_constexprs: dict  # QB_TILE (by the number of query blocks, DS_TUNING) → the ΔS launch's constexprs
    kv_constexprs: dict


@functools.cache
def _recipe(d: int, dtype: torch.dtype, qk_format: str, qk_granularity: str, qk_qmax: int, smooth_q: bool,
            smooth_k: bool, smooth_v: bool, pv_format: str, pv_qmax: int, v_granularity: str, block_q: int,
            block_k: int, warps: int, pad_to: int, v_key_order: bool, is_causal: bool) -> _Recipe:
    """The options checked and turned into the launches' constexprs, once per combination (a bad one raises on
    every call: exceptions are not cached)."""
    if qk_granularity not in GRAN_IDS:
        raise ValueError(f"qk_granularity {qk_granularity!r} not supported by the kernels; valid: {list(GRAN_IDS)}")
    for name, blk in (("block_q", block_q), ("block_k", block_k)):
        if blk & (blk - 1) or blk < 16:
            raise ValueError(f"{name}={blk} must be a power of two >= 16")
    if pad_to % block_k:
        raise ValueError(f"pad_to={pad_to} must be a multiple of block_k={block_k}")
    if v_key_order and (block_k < 32 or v_granularity == "block"):
        raise ValueError("v_key_order reorders keys within 32: it needs block_k >= 32 and V scales that are not "
                         f"per block (got block_k={block_k}, v_granularity={v_granularity!r})")
    qk_fmt = _fmt_id(qk_format)
    v_fmt = _fmt_id(pv_format)
    q_max = FP8_MAX["fp8_e4m3"] if qk_fmt == FMT_FP8 else float(qk_qmax)
    v_max = FP8_MAX["fp8_e4m3"] if v_fmt == FMT_FP8 else float(pv_qmax)
    v_mode = V_GRAN_IDS[v_granularity]
    need_vminmax = v_mode == V_CHANNEL
    need_vabs = v_mode == V_TENSOR
    if smooth_v and need_vabs:
        raise ValueError("smooth_v with a per-tensor V scale is not supported by the kernels")
    emulate = interpreting()
    gran = GRAN_IDS[qk_granularity]
    return _Recipe(
        qk_dtype=torch.int8 if qk_fmt == FMT_INT else torch.float8_e4m3fn,
        v_dtype=torch.int8 if v_fmt == FMT_INT else torch.float8_e4m3fn,
        v_mode=v_mode,
        need_stats=smooth_k or smooth_v or need_vminmax or need_vabs,
        need_vabs=need_vabs,
        stats_constexprs=dict(
            HEAD_DIM=d, BLOCK_Q=block_q, Q_SUB=min(block_q, max(block_q // warps, Q_SUB_ROWS)), GRAN=gran,
            WARPS=warps, QMAX=q_max, QK_FMT=qk_fmt, SMOOTH_Q=smooth_q, SMOOTH_K=smooth_k, SMOOTH_V=smooth_v,
            V_CHANNEL=need_vminmax, V_ABS=need_vabs, V_QMAX=v_max, FINALIZE=smooth_k or smooth_v or need_vminmax,
            TILE=STATS_TILE, TILES=STATS_TILES, RTILE=32, EMULATE=emulate),
        delta_s_constexprs={
            qb_tile: dict(HEAD_DIM=d, BLOCK_N=_delta_s_tile(pad_to), QB_TILE=qb_tile, Q_BLOCK=block_q,
                          K_BF16=dtype == torch.bfloat16, CAUSAL=is_causal, EMULATE=emulate)
            for qb_tile in (DS_TUNING["qb_tile_short"], DS_TUNING["qb_tile"])},
        kv_constexprs=dict(HEAD_DIM=d, BLOCK=block_k, GRAN=gran, QMAX=q_max, K_FMT=qk_fmt, SMOOTH_K=smooth_k,
                           V_MODE=v_mode, V_FMT=v_fmt, V_QMAX=v_max, SMOOTH_V=smooth_v, V_KEY_ORDER=v_key_order,
                           EMULATE=emulate),
    )


class _StatsScratch(NamedTuple):
    """Launch 1's scratch: the chunks' column partials (K sums, V sums, V maxima, V minima; rows of one float32
    allocation, each 128-byte aligned), one int32 ticket a kv head (0 between launches), and an empty float32
    tensor for the pointers a launch does not use."""

    ksum: torch.Tensor
    vsum: torch.Tensor
    vmax: torch.Tensor
    vmin: torch.Tensor
    tickets: torch.Tensor
    empty: torch.Tensor

    @staticmethod
    def new(device: torch.device, part: int, heads: int) -> _StatsScratch:
        rows = torch.empty((4, cdiv(part, 32) * 32), device=device, dtype=torch.float32).unbind(0)
        return _StatsScratch(*rows, torch.zeros(heads, device=device, dtype=torch.int32),
                             torch.empty(0, device=device, dtype=torch.float32))


_STATS_SCRATCH: dict[tuple, _StatsScratch] = {}  # stream_key → the scratch of launches on that stream


def stats_scratch(device: torch.device, part: int, heads: int) -> _StatsScratch:
    """Launch 1's scratch for the current stream, at least ``part`` floats a partial row and ``heads`` tickets: made
    once and kept (launches on one stream run one after the other; each head's finalizing program resets its ticket),
    grown when a call needs more. While a CUDA graph captures, a fresh one (from the graph's pool), never kept."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return _StatsScratch.new(device, part, heads)
    key = stream_key(device)
    scratch = _STATS_SCRATCH.get(key)
    if scratch is None or scratch.ksum.numel() < part or scratch.tickets.numel() < heads:
        if scratch is not None:  # grown to the larger of both needs, so that two shapes do not take turns
            part, heads = max(part, scratch.ksum.numel()), max(heads, scratch.tickets.numel())
        scratch = _STATS_SCRATCH[key] = _StatsScratch.new(device, part, heads)
    return scratch


class QuantizePlan:
    """:func:`quantize_qkv` for one call signature: the inputs' shapes, strides, dtype and options checked, the
    launches' recipe and the outputs' layout made once; :meth:`launch` fills given outputs (tensors, or the
    :class:`~quantpatch.kernels.compiled_launch.DevicePointer` s of :meth:`carve`, where the launch plans exist)."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, qk_format: str = "int8",
                 qk_granularity: str = "thread", qk_qmax: int = 127, smooth_q: bool = True, smooth_k: bool = True,
                 smooth_v: bool = False, pv_format: str = "fp8_e4m3", pv_qmax: int = 127,
                 v_granularity: str = "channel", block_q: int = 128, block_k: int = 64, warps: int = 4,
                 pad_to: int = 128, v_key_order: bool = False, is_causal: bool = False):
        _check_inputs(q, k, v)
        b, h, nq, d = q.shape
        hkv, nk = k.shape[1], k.shape[2]
        r = self.recipe = _recipe(d, q.dtype, qk_format, qk_granularity, qk_qmax, smooth_q, smooth_k, smooth_v,
                                  pv_format, pv_qmax, v_granularity, block_q, block_k, warps, pad_to, v_key_order,
                                  is_causal)
        self.smooth_q = smooth_q
        nk_pad = cdiv(nk, pad_to) * pad_to
        nqb = cdiv(nq, block_q)
        nkb = nk_pad // block_k
        f32 = torch.float32
        v_scale = (b, hkv, d) if r.v_mode == V_CHANNEL else (b, hkv, nkb) if r.v_mode == V_BLOCK else (1,)
        # QuantizedQKV's fields in order: (shape, dtype), shape (0,) where a field is unused
        self.layout = QuantizedQKV(
            ((b, h, nq, d), r.qk_dtype), ((b, h, nq), f32), ((b, h, nqb, d) if smooth_q else (0,), f32),
            ((b, hkv, nk_pad, d), r.qk_dtype), ((b, hkv, nk_pad), f32), ((b, hkv, d) if smooth_k else (0,), f32),
            ((b, h, nqb, nk_pad) if smooth_q else (0,), f32), ((b, hkv, d, nk_pad), r.v_dtype), (v_scale, f32),
            ((b, hkv, d) if smooth_v else (0,), f32))
        self.offsets, self.nbytes = [], 0
        for shape, dtype in self.layout:  # each field 256-byte aligned, as an allocation of its own is
            self.offsets.append(self.nbytes)
            self.nbytes += cdiv(math.prod(shape) * dtype.itemsize, 256) * 256
        nchunk = cdiv(nk, STATS_TILE * STATS_TILES)
        self.scratch_size = (b * hkv * nchunk * d, b * hkv)
        # the launches' grids and integer arguments (the inputs' strides are this signature's)
        kv_strides = k.stride()[:3] + v.stride()[:3]
        stats_programs = nchunk * b * hkv if r.need_stats else 0
        self.stats_ints = q.stride()[:3] + kv_strides + (nq, h, nqb, stats_programs, nk, hkv, nchunk, float(nk))
        short = interpreting() or nqb <= DS_TUNING["short_nqb"]
        self.delta_s_ints = k.stride()[:3] + (nk, nk_pad, hkv, h // hkv, nqb, nk - nq)
        self.kv_ints = kv_strides + (nk, nk_pad, hkv, nkb)
        # the launches' (plans, grid, constexprs, options) in order; the ΔS launch only with smooth Q
        delta_s = ((_DELTA_S_LAUNCH, (cdiv(nk_pad, _delta_s_tile(pad_to)), b * hkv),
                    r.delta_s_constexprs[DS_TUNING["qb_tile_short"] if short else DS_TUNING["qb_tile"]],
                    dict(num_warps=DS_TUNING["num_warps"], num_stages=DS_TUNING["num_stages"])),) if smooth_q else ()
        self.specs = (
            (_STATS_LAUNCH, (stats_programs + nqb * b * h,), r.stats_constexprs, dict(num_warps=Q_STATS_WARPS)),
            *delta_s,
            (_KV_LAUNCH, (nkb, b * hkv), r.kv_constexprs, dict(num_warps=4)),
        )
        self.bound = None  # the launches' BoundLaunch es once bind() found their plans
        # what the launches' specialization follows from (LaunchPlans' plan_key): every int argument derives from
        # the inputs' shapes and strides, pad_to and the constexprs; every other pointer is an output, 256-byte
        # aligned, or a row of the scratch, 128-byte aligned
        self.plan_key = (q.shape, k.shape, q.stride(), k.stride(), v.stride(), q.dtype, pad_to,
                         q.data_ptr() % 16 == 0, k.data_ptr() % 16 == 0, v.data_ptr() % 16 == 0)

    def allocate(self, device: torch.device) -> QuantizedQKV:
        """Outputs as tensors of their own (the custom op's outputs may not alias one another, empty ones included)."""
        return QuantizedQKV(*(torch.empty(shape, device=device, dtype=dtype) for shape, dtype in self.layout))

    def carve(self, device: torch.device) -> tuple[torch.Tensor, QuantizedQKV]:
        """Outputs as addresses in one allocation (``uint8``, returned: it must live until the launches that read
        the outputs are enqueued)."""
        workspace = torch.empty(self.nbytes, device=device, dtype=torch.uint8)
        base = workspace.data_ptr()
        return workspace, QuantizedQKV(*[DevicePointer(base + off) for off in self.offsets])

    def quantize(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> QuantizedQKV:
        """The operands of ``q, k, v`` (inputs of this plan's signature) in tensors of their own (:meth:`allocate`),
        launched on the current stream with its statistics scratch."""
        x = self.allocate(q.device)
        self.launch(q, k, v, x, stats_scratch(q.device, *self.scratch_size))
        return x

    def bind(self, device: int) -> None:
        """Bind the launches' plans on CUDA device ``device`` (made by a first :meth:`launch`), so that later
        launches skip the plan lookup; a launch whose plan is not made stays unbound (:meth:`launch` then looks it
        up, and makes it)."""
        bound = tuple(plans.bound(grid, consts, plan_key=self.plan_key, device=device, **options)
                      for plans, grid, consts, options in self.specs)
        if None not in bound:
            self.bound = bound

    def launch(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: QuantizedQKV,
               scratch: _StatsScratch) -> None:
        """The two or three launches into ``x``, on the current stream (inputs of this plan's signature)."""
        r = self.recipe
        vabs = torch.zeros(1, device=q.device, dtype=torch.float32) if r.need_vabs else scratch.empty
        args = (
            # launch 1: Q (block mean, smoothing, grouped quantization) beside the K/V statistics; each kv head's
            # last statistics program reduces its partials into K̄, V̄ and the per-channel V scale
            (q, x.q_hat, x.q_scale, x.q_mean, k, v, scratch.ksum, scratch.vsum, scratch.vmax, scratch.vmin, vabs,
             scratch.tickets, x.k_mean, x.v_mean, x.v_scale) + self.stats_ints,
            # with smooth Q, ΔS_raw = q̄ · Kᵀ on the raw K (needs q̄ only)
            *(((k, x.q_mean, x.delta_s) + self.delta_s_ints,) if self.smooth_q else ()),
            # then K and V (needs the statistics of launch 1)
            (k, v, x.k_hat, x.k_scale, x.k_mean, x.v_hat_t, x.v_scale, x.v_mean, vabs) + self.kv_ints,
        )
        if self.bound is not None:
            stream = current_stream(q.device.index)
            for bound, launch_args in zip(self.bound, args):
                bound(stream, launch_args)
            return
        for (plans, grid, consts, options), launch_args in zip(self.specs, args):
            plans(grid, launch_args, consts, plan_key=self.plan_key, **options)


def quantize_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    qk_format: str = "int8",
    qk_granularity: str = "thread",
    qk_qmax: int = 127,
    smooth_q: bool = True,
    smooth_k: bool = True,
    smooth_v: bool = False,
    pv_format: str = "fp8_e4m3",
    pv_qmax: int = 127,
    v_granularity: str = "channel",
    block_q: int = 128,
    block_k: int = 64,
    warps: int = 4,
    pad_to: int = 128,
    v_key_order: bool = False,
    is_causal: bool = False,
) -> QuantizedQKV:
    """Quantize ``q (B, H, Nq, D)``, ``k, v (B, Hkv, Nk, D)`` (fp16/bf16, last dim contiguous).

    Args mirror :class:`quantpatch.config.AttentionConfig`; ``pad_to`` is the key block of the
    attention kernel (``Nk_pad = ceil(Nk / pad_to) · pad_to``, a multiple of ``block_k``);
    ``v_key_order``: ``v_hat_t``'s keys in the Gluon kernel's order (``pingpong_gluon.permute_v_keys``),
    for :func:`~quantpatch.kernels.attention.pingpong_gluon.attn_qk_int8_gluon` only; ``is_causal``: ``delta_s`` only
    where a causal (bottom-right aligned) kernel reads it (:func:`delta_s_written`), the rest left unwritten.

    Returns:
        :class:`QuantizedQKV` on ``q``'s device, launched on the current stream.
    """
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    # the plan checks the inputs
    plan = QuantizePlan(q, k, v, qk_format=qk_format, qk_granularity=qk_granularity, qk_qmax=qk_qmax,
                        smooth_q=smooth_q, smooth_k=smooth_k, smooth_v=smooth_v, pv_format=pv_format, pv_qmax=pv_qmax,
                        v_granularity=v_granularity, block_q=block_q, block_k=block_k, warps=warps, pad_to=pad_to,
                        v_key_order=v_key_order, is_causal=is_causal)
    return plan.quantize(q, k, v)


# --------------------------------------------------------------------------- reference


def quantize_qkv_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    qk_format: str = "int8",
    qk_granularity: str = "thread",
    qk_qmax: int = 127,
    smooth_q: bool = True,
    smooth_k: bool = True,
    smooth_v: bool = False,
    pv_format: str = "fp8_e4m3",
    pv_qmax: int = 127,
    v_granularity: str = "channel",
    block_q: int = 128,
    block_k: int = 64,
    warps: int = 4,
    pad_to: int = 128,
    means: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None] | None = None,
    dtype: torch.dtype = torch.float32,
) -> QuantizedQKV:
    """:func:`quantize_qkv` in plain PyTorch through ``quant_ref`` (same layouts and padding).

    ``dtype`` is float32 by default, the kernels' arithmetic, so integer and FP8 outputs match
    bit for bit; float64 gives the ideal quantizer. ``means = (q_mean, k_mean, v_mean)`` (the
    kernel's, shaped as in :class:`QuantizedQKV`) replaces the reference's own means: a mean
    is a sum whose rounding depends on the summation order, while everything after it is exact.
    """
    from .quant_attention_ref import block_mean

    _check_inputs(q, k, v)
    b, h, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    nk_pad = cdiv(nk, pad_to) * pad_to
    qf, kf, vf = (t.to(dtype) for t in (q, k, v))
    qm_in, km_in, vm_in = means if means is not None else (None, None, None)
    empty = torch.empty(0, device=q.device, dtype=dtype)
    if qk_format == "fp8_e4m3":
        def quant(x, role, blk):
            absmax = token_absmax(x, qk_granularity, role=role, block=blk, warps=warps)
            scale = symmetric_scale(absmax, FP8_MAX["fp8_e4m3"])
            return cast_fp8(x / scale, "fp8_e4m3").to(torch.float8_e4m3fn), scale
    else:
        def quant(x, role, blk):
            xq, scale = quantize_tokens(x, qk_granularity, role=role, qmax=qk_qmax, block=blk, warps=warps)
            return xq.to(torch.int8), scale

    q_mean = empty
    if smooth_q:
        if qm_in is None:
            q_mean = block_mean(qf, block_q)[..., ::block_q, :].contiguous()
        else:
            q_mean = qm_in.to(dtype)
        qf = qf - q_mean.repeat_interleave(block_q, dim=-2)[..., :nq, :]
    q_hat, q_scale = quant(qf, "q", block_q)

    k_raw = kf
    k_mean = empty
    if smooth_k:
        k_mean = kf.mean(dim=-2) if km_in is None else km_in.to(dtype)
        kf = kf - k_mean.unsqueeze(-2)
    k_hat, k_scale = quant(kf, "k", block_k)
    pad = nk_pad - nk
    k_hat = torch.nn.functional.pad(k_hat.view(torch.int8), (0, 0, 0, pad)).view(k_hat.dtype)
    k_scale = torch.nn.functional.pad(k_scale.squeeze(-1), (0, pad))

    delta_s = empty
    if smooth_q:
        g = h // hkv
        delta_s = torch.matmul(q_mean, k_raw.repeat_interleave(g, dim=1).transpose(-1, -2))
        delta_s = torch.nn.functional.pad(delta_s, (0, pad), value=float("-inf"))

    v_mean = empty
    if smooth_v:
        v_mean = vf.mean(dim=-2) if vm_in is None else vm_in.to(dtype)
        vf = vf - v_mean.unsqueeze(-2)
    v_max = FP8_MAX["fp8_e4m3"] if pv_format == "fp8_e4m3" else float(pv_qmax)
    if v_granularity == "channel":
        absmax = vf.abs().amax(dim=-2, keepdim=True)
    elif v_granularity == "tensor":
        absmax = vf.abs().amax().reshape(1, 1, 1, 1)
    else:
        absmax = token_absmax(vf, "block", role="k", block=block_k)
    v_scale_full = symmetric_scale(absmax, v_max)
    y = vf / v_scale_full
    if pv_format == "fp8_e4m3":
        v_hat = cast_fp8(y, "fp8_e4m3").to(torch.float8_e4m3fn)
    else:
        v_hat = quantize_symmetric(y, torch.ones((), dtype=dtype, device=q.device), pv_qmax).to(torch.int8)
    v_hat_t = torch.nn.functional.pad(v_hat.view(torch.int8).transpose(-1, -2), (0, pad)).view(v_hat.dtype)
    if v_granularity == "channel":
        v_scale = v_scale_full.squeeze(-2)
    elif v_granularity == "tensor":
        v_scale = v_scale_full.reshape(1)
    else:
        per_block = v_scale_full[..., ::block_k, 0]
        v_scale = torch.nn.functional.pad(per_block, (0, nk_pad // block_k - per_block.shape[-1]), value=1.0)
    return QuantizedQKV(q_hat, q_scale.squeeze(-1), q_mean, k_hat, k_scale, k_mean, delta_s,
                        v_hat_t.contiguous(), v_scale, v_mean)
