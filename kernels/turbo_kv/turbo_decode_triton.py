"""TurboAttention decode attention over the compressed KV cache (Triton), Algorithm 2 with FlashQ and SAS.

The numerics of :func:`~quantpatch.kernels.turbo_kv.turbo_ref.turbo_decode_attention_ref` (``turbo`` with Q per
token), read straight from the stored layout (no float copy of the cache). Per program: one
(batch, KV head, split of the key blocks); its rows are every query row of the KV head's ``G``
query heads (GQA: each K/V byte is loaded once for ``G · Nq`` rows, ``r = g·NQ_PAD + i``)::

    Q̂ = clamp(rne(q / s_Q), ±119),  s_Q = absmax(q_row) / 119                     (per token, once)
    K̂_j = (X^{q2} + z^int)·s^int  (clamped to ±127 for 2-bit)
    S = (Q̂ K̂_jᵀ) · (s_Q s_Kj) · scale                                             fp16 dot, fp32 accumulate
    m' = max(m, rowmax S),  P̃ = SAS(S − m'),  α = SAS(m − m')                    SAS = LUT[⌊−x⌋]·POLY(frac), n_r = −6
    s_P = max(P̃ over the head's rows and the tile) / 119,  P̂ = clamp(rne(P̃ / s_P), ±119)
    R = (P̂ V̂_j) · s_P · s_Vj,   acc = α·acc + R,   ℓ = α·ℓ + rowsum P̃               fp16 dot, fp32 accumulate

Every dot is integer arithmetic on fp16 operands: all operands are integers ≤ 2048 in magnitude (exact
in fp16), products exact in fp32 and every partial sum an integer < 2²⁴ (``|Q̂ K̂ᵀ| ≤ 128·119·127``,
``|P̂ V̂| ≤ 64·119·127``), so the results equal the INT8 dots of the reference bit for bit. fp16 (not INT8)
because an INT8 ``mma`` operand cannot be transposed by ``ldmatrix``: V's codes (keys × channels) would
go through shared memory one byte at a time.

Channels in 4 parts ``4i + p`` (both widths): code rows, ``s^int`` and ``z^int`` are read as int32 words, so
part ``p`` of an ``s^int`` / ``z^int`` row is byte ``p`` of each word, and ``S = Σ_p Q̂_p K̂_pᵀ`` (no ``(keys, D)``
tile, no reshape of it). 4-bit codes enter the dots as fp16 subnormals: ``w & 0x000F000F`` is the bit pattern of
``code · 2⁻²⁴`` for two channels (``0x00F000F0``: ``16 · code · 2⁻²⁴``, Q̂'s side divided by 16; one shift for two
parts), and the dots' integer sums come back exactly by ``· 2²⁴``; 2-bit codes are ``1024 + code`` (``| 0x6400``).
4-bit blocks need no clamp, so ``Q̂ K̂ᵀ = (Q̂ ⊙ s^int)·Xᵀ + (Q̂ ⊙ s^int)·z^int`` (the second term a per-row bias,
``|s^int z^int| ≤ 127``, exact in fp32; ``|Q̂ ⊙ s^int| ≤ 119·16`` is exact in fp16) and ``P̂ V̂ = s^int ⊙ (P̂ X +
z^int · rowsum P̂)``: the scales act on the small side. P̂: one IEEE reciprocal per row, then Markstein's
correction (``q = P̃·r``, ``q += (P̃ − s_P q)·r`` with FMAs) gives the IEEE quotient ``P̃ / s_P`` itself, so P̂ is
the reference's integer. The INT8 buffer (tokens not compressed yet, one universal scale) is the last tile of
the last split (masked tail). ``Nq ≤ 16`` query tokens are causal bottom-right (query ``i`` sees key ``j ≤ i +
N − Nq``).

Lanes: ``G_PAD·NQ_PAD`` rows are often fewer than the 16 an ``mma`` tile has (4 at q_len 1, 4 query heads per
KV head). Then one tile holds ``LANES`` key blocks: row ``(j, g, i)`` sees block ``t0 + j`` of each group of
``LANES`` consecutive blocks and keeps its own running ``(m, ℓ, acc)``; ``S`` rows of lane ``j`` come from
``K_j``, ``P̂`` masked to lane ``j`` multiplies ``V_j``, and the softmax, the scales and the accumulator update
run once per ``LANES`` blocks. The lanes are merged at the end like splits (below).

Flash-decoding: the key blocks are split over ``NUM_SPLITS`` programs per (batch, KV head); each writes
its ``(m, ℓ, acc)``, and the last of them to finish (a ticket counter per (batch, KV head), zero between calls)
merges them in split order (deterministic) with SAS weights,
``O = Σ_s SAS(m_s − M)·acc_s / Σ_s SAS(m_s − M)·ℓ_s`` (the reference's own rescaling, α = SAS(Δm)).
With one split (one lane) the kernel writes ``acc / ℓ`` itself and follows the reference operation for operation:
the integer parts are exact, every rounding is the reference's (IEEE quotients, no FMA contraction),
and only the float sums (ℓ, the dots' int→float) differ in order. With several splits each split's
P̃ is taken against its own running max, as any split of the reference's sequential loop would.

Mixed precision: heads are grouped by ``(K bits, V bits)`` (one launch per group); a head's codes are
addressed from the group's first head's tensor by a byte offset (``CompressedKV.codes`` holds one
tensor per head).

On sm_90 the code-width groups of a single-token decode step with 4-bit K and V, D = 128 and ≤ 8 query heads per
KV head go to the Gluon kernel :mod:`quantpatch.kernels.turbo_kv.turbo_decode_gluon` (same numerics; 2.4–2.9× SDPA
at B ≥ 8 and N ≥ 16k on an H200, this kernel 1.0–1.1×; :func:`gluon_takes`), the others to this one; ``kernel="triton"``
sends everything here.

Custom op ``quantpatch::turbo_decode_attention`` (with ``register_fake``), launched on the current stream.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from quantpatch.config import AttentionConfig

from ..attention.quant_attn_triton import SAS_THRESHOLD, _sas_exp
from ..compiled_launch import cdiv, next_pow2, stream_key
from ..device import GluonGate
from ..rounding_triton import _rne
from .turbo_compress_triton import KERNEL_BITS
from .turbo_decode_splits import split_count
from .turbo_ref import CompressedKV, Int8Buffer, bit_groups, decode_attention_config

HEAD_DIMS = (64, 128)
MAX_Q_LEN = 16
MAX_ROWS = 128  # G_PAD · NQ_PAD rows of one program
PROGRAMS_PER_SM = 8  # split the sequence until the grid has at most this many programs per SM (whole waves)
NUM_WARPS, NUM_STAGES = 2, 1  # launch of the decode kernel (picked by B=8, N=32k sweeps on an H200)
SUBNORMAL_CODES = True  # 4-bit codes enter the fp16 dots as subnormals (code · 2⁻²⁴); False: as 1024 + code


# --------------------------------------------------------------------------- jit helpers


@triton.jit
def _byte(w, p: tl.constexpr):
    """Signed byte ``p`` of int32 words: an int8 row ``(D,)`` read as words ``i`` gives channels ``4i + p``."""
    if p == 3:
        out = w >> 24
    else:
        out = (w << (24 - 8 * p)) >> 24
    return out


@triton.jit
def _halves(t):
    """int32 words ``(R, W)`` holding two fp16 bit patterns → fp16 ``(R, 2W)`` (low half first)."""
    lo = t.to(tl.int16).to(tl.float16, bitcast=True)
    hi = (t >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    return tl.join(lo, hi)


@triton.jit
def _code_part(w, p: tl.constexpr, BITS: tl.constexpr):
    """``1024 + code`` (fp16, exact) of channels ``4i + p``, ``i`` in order, from packed rows read as int32
    words ``w (R, W)``: ``(R, D / 4)``.

    A word holds ``32 / BITS`` codes, channel ``(32 / BITS)·i + f`` at bits ``BITS·f``. A field moved to the
    bottom of each 16-bit half and or-ed with ``0x6400`` (fp16 1024, whose ulp is 1) reads as ``1024 + code``:
    one shift and one LOP3 per pair. 4-bit: fields ``p`` / ``p + 4`` (channels ``8i + p``, ``8i + 4 + p``);
    2-bit: fields ``p`` / ``p + 8`` and ``p + 4`` / ``p + 12``.
    """
    if BITS == 4:
        x = _halves(((w >> (4 * p)) & 0x000F000F) | 0x64006400)
        out = tl.reshape(x, (x.shape[0], x.shape[1] * 2))
    else:
        a = _halves(((w >> (2 * p)) & 0x00030003) | 0x64006400)
        b = _halves(((w >> (2 * p + 8)) & 0x00030003) | 0x64006400)
        x = tl.join(a, b)  # [r, i, half, a] = channel 16i + 8·half + 4a + p
        out = tl.reshape(x, (x.shape[0], x.shape[1] * 4))
    return out


@triton.jit
def _code_part_subnormal(w, p: tl.constexpr):
    """4-bit codes of channels ``4i + p`` as fp16 subnormals, ``code · 2⁻²⁴ · (16 if p odd else 1)``: the bit
    pattern is the masked word itself (one LOP3 a pair, one shift for two parts); ``(R, D / 4)``."""
    if p >= 2:
        w = w >> 8
    if p % 2 == 0:
        x = _halves(w & 0x000F000F)
    else:
        x = _halves(w & 0x00F000F0)
    return tl.reshape(x, (x.shape[0], x.shape[1] * 2))


@triton.jit
def _dequant(x, z, s, BITS: tl.constexpr):
    """``(code + z^int)·s^int`` in fp16 from ``x = 1024 + code`` (exact: integers ≤ 2048), clamped to ±127 for
    2-bit blocks (4-bit ones cannot pass it)."""
    v = (x + (z.to(tl.float16) - 1024.0)[None, :]) * s.to(tl.float16)[None, :]
    if BITS == 2:
        v = tl.minimum(tl.maximum(v, -127.0), 127.0)
    return v.to(tl.float16)


@triton.jit
def _quantize_p(p, p_scale, PMAX: tl.constexpr):
    """``min(rne(P̃ / s_P), PMAX)`` with one reciprocal per row: Markstein's correction of ``P̃ · RN(1/s_P)``
    (an exact FMA residual, then one FMA) is the IEEE quotient itself (``RN(1/s)`` within ½ ulp, the
    product within 1 ulp), so P̂ is the reference's integer."""
    r = tl.math.div_rn(1.0, p_scale)[:, None]
    q = p * r
    q = tl.math.fma(tl.math.fma(-p_scale[:, None], q, p), r, q)
    return tl.minimum(_rne(q), PMAX * 1.0).to(tl.float16)


@triton.jit
def _softmax(s_int, qk_scale, keep, m_i, l_i, sm_scale,
             HEADS: tl.constexpr, NQ_PAD: tl.constexpr, PMAX: tl.constexpr, MASK: tl.constexpr):
    """SAS online softmax of one key tile: ``(P̂ (fp16), s_P, α, ℓ, m)``; P̂'s scale is per query head (rows
    ``HEADS × NQ_PAD``)."""
    s = s_int * qk_scale[:, None] * sm_scale
    if MASK:
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet: SAS(−∞) = 0, not NaN
    alpha = _sas_exp(m_i - m_safe)
    p = _sas_exp(s - m_safe[:, None])
    # P̂ scale: max over the tile's rows of one query head (the reference's block_q tile holds all its Nq rows)
    row_max = tl.max(p, 1)
    if NQ_PAD > 1:
        head_max = tl.max(tl.reshape(row_max, (HEADS, NQ_PAD)), 1)
        row_max = tl.reshape(tl.broadcast_to(head_max[:, None], (HEADS, NQ_PAD)), (HEADS * NQ_PAD,))
    p_scale = tl.math.div_rn(row_max, PMAX * 1.0)
    p_scale = tl.where(p_scale == 0.0, 1.0, p_scale)
    return _quantize_p(p, p_scale, PMAX), p_scale, alpha, l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def _accumulate(acc, r, alpha, p_scale, v_scale):
    """``α·acc + R·s_P·s_V`` for one channel part (``v_scale``: per row)."""
    return acc * alpha[:, None] + r * p_scale[:, None] * v_scale[:, None]


@triton.jit(do_not_specialize=["NQ", "T", "NB", "BLOCKS_PER_SPLIT", "NUM_SPLITS"])
def _turbo_decode_kernel(
    Q_ptr, stride_qb, stride_qh, stride_qm,
    KC_ptr, stride_kcb, KS_ptr, KZ_ptr, KBS_ptr,
    VC_ptr, stride_vcb, VS_ptr, VZ_ptr, VBS_ptr,
    KB_ptr, KBSC_ptr, VB_ptr, VBSC_ptr,
    META_ptr,
    O_ptr, stride_ob, stride_oh, stride_om,
    MP_ptr, LP_ptr, ACC_ptr, CNT_ptr,
    NQ, T, NB, HKV, HG, BLOCKS_PER_SPLIT, NUM_SPLITS, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr, NQ_PAD: tl.constexpr,
    LANES: tl.constexpr, BITS_K: tl.constexpr, BITS_V: tl.constexpr, CAUSAL: tl.constexpr,
    ROW_MASK: tl.constexpr, DIRECT: tl.constexpr, QMAX: tl.constexpr, PMAX: tl.constexpr, SUB: tl.constexpr,
    S_CHUNK: tl.constexpr,
):
    """Split ``program_id(0)`` of (batch, group slot) ``program_id(1)``; META = (kv head, K / V code word offsets).

    Codes, ``s^int`` and ``z^int`` come as int32 words (``KC``/``VC`` rows of ``HEAD_DIM·BITS/32`` words,
    ``stride_*cb`` in words). Rows ``r = lane·RPL + g·NQ_PAD + i``: lane ``j`` takes the blocks ``≡ j`` of
    each group of ``LANES`` consecutive blocks, with its own running state, merged at the end.
    """
    RPL: tl.constexpr = G_PAD * NQ_PAD  # rows of one lane
    BLOCK_M: tl.constexpr = LANES * RPL
    DP: tl.constexpr = HEAD_DIM // 4  # channels of one part (4i + p)
    WK: tl.constexpr = HEAD_DIM * BITS_K // 32  # int32 words of a K code row
    WV: tl.constexpr = HEAD_DIM * BITS_V // 32
    MASK: tl.constexpr = CAUSAL or ROW_MASK or (LANES > 1)
    K_SCALE_ON_Q: tl.constexpr = BITS_K == 4  # 2-bit blocks need the clamp on K̂ itself
    SUB_K: tl.constexpr = SUB and BITS_K == 4  # 4-bit codes as fp16 subnormals (else 1024 + code)
    SUB_V: tl.constexpr = SUB and BITS_V == 4
    pid_s = tl.program_id(0)
    pid = tl.program_id(1)
    b = pid // HG
    slot = pid % HG
    h = tl.load(META_ptr + slot).to(tl.int32)
    k_off = tl.multiple_of(tl.load(META_ptr + HG + slot), 4)
    v_off = tl.multiple_of(tl.load(META_ptr + 2 * HG + slot), 4)
    bh = b * HKV + h

    # Q: per-token INT8 (absmax / QMAX), rows r = lane·RPL + g·NQ_PAD + i of query head h·GROUP + g, in 4 parts
    offs_m = tl.arange(0, BLOCK_M)
    lane = offs_m // RPL
    g = (offs_m % RPL) // NQ_PAD
    qi = offs_m % NQ_PAD
    row_ok = (g < GROUP) & (qi < NQ)
    offs_i = tl.arange(0, DP)
    q_rows = Q_ptr + b.to(tl.int64) * stride_qb + (h * GROUP + g)[:, None] * stride_qh + qi[:, None] * stride_qm
    q = ()
    q_abs = tl.zeros([BLOCK_M], dtype=tl.float32)
    for p in tl.static_range(4):
        q_p = tl.load(q_rows + (offs_i * 4 + p)[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        q = q + (q_p,)
        q_abs = tl.maximum(q_abs, tl.max(tl.abs(q_p), 1))
    qs = tl.math.div_rn(q_abs, QMAX * 1.0)
    qs = tl.where(qs == 0.0, 1.0, qs)
    q_hat = ()
    for p in tl.static_range(4):
        q_p = tl.minimum(tl.maximum(_rne(tl.math.div_rn(q[p], qs[:, None])), -QMAX * 1.0), QMAX * 1.0)
        q_hat = q_hat + (q_p.to(tl.float16),)

    nk = T * BLOCK_N + NB
    diag = qi + nk - NQ  # query i sees keys j <= i + N − Nq
    offs_n = tl.arange(0, BLOCK_N)
    offs_wk = tl.arange(0, WK)
    offs_wv = tl.arange(0, WV)
    kc_base = KC_ptr + k_off + b.to(tl.int64) * stride_kcb
    vc_base = VC_ptr + v_off + b.to(tl.int64) * stride_vcb
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = ()
    for p in tl.static_range(4):
        acc = acc + (tl.zeros([BLOCK_M, DP], dtype=tl.float32),)
    lo = pid_s * BLOCKS_PER_SPLIT
    hi = tl.minimum(lo + BLOCKS_PER_SPLIT, T)
    for t0 in range(lo, hi, LANES):
        t_row = tl.minimum(t0 + lane, hi - 1)  # each row's block (rows of blocks past hi are masked)
        sz_row = (bh * T + t_row).to(tl.int64) * DP  # word offset of the row's s^int / z^int vectors
        if K_SCALE_ON_Q:  # Q̂·K̂ᵀ = (Q̂ ⊙ s^int)·(X^{q2} + z^int)ᵀ: s^int goes to Q's side (rows: their block's)
            ks_rows = tl.load(KS_ptr + sz_row[:, None] + offs_i[None, :])
            kz_rows = tl.load(KZ_ptr + sz_row[:, None] + offs_i[None, :])
            q_op = ()
            bias = tl.zeros([BLOCK_M], dtype=tl.float32)  # (Q̂ ⊙ s^int)·z^int: |s^int z^int| ≤ 127, exact in fp32
            for p in tl.static_range(4):
                ks_p = _byte(ks_rows, p).to(tl.float16)
                q_sp = q_hat[p] * ks_p
                if SUB_K and p % 2 == 1:  # odd parts hold 16·code: Q̂ ⊙ s^int / 16 (exact, an integer < 2048 / 16)
                    q_op = q_op + (q_hat[p] * (ks_p * 0.0625),)
                else:
                    q_op = q_op + (q_sp,)
                bias += tl.sum(q_sp.to(tl.float32) * _byte(kz_rows, p).to(tl.float32), 1)
        else:
            q_op = q_hat
        s_int = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for j in tl.static_range(LANES):
            tj = tl.minimum(t0 + j, hi - 1)
            pk = tl.load(kc_base + (tj * BLOCK_N + offs_n)[:, None] * WK + offs_wk[None, :])
            if not K_SCALE_ON_Q:
                sz = (bh * T + tj).to(tl.int64) * DP
                kz = tl.load(KZ_ptr + sz + offs_i)
                ks = tl.load(KS_ptr + sz + offs_i)
            s_j = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for p in tl.static_range(4):
                if SUB_K:
                    k = _code_part_subnormal(pk, p)
                elif K_SCALE_ON_Q:
                    k = _code_part(pk, p, BITS_K) - 1024.0
                else:
                    k = _dequant(_code_part(pk, p, BITS_K), _byte(kz, p), _byte(ks, p), BITS_K)
                s_j = tl.dot(q_op[p], tl.trans(k), s_j)
            if LANES == 1:
                s_int = s_j
            else:
                s_int = tl.where((lane == j)[:, None], s_j, s_int)
        if SUB_K:  # the dots summed code · 2⁻²⁴ (exact: integers < 2²⁴ times a power of two)
            s_int = s_int * 16777216.0 + bias[:, None]
        elif K_SCALE_ON_Q:
            s_int += bias[:, None]
        keep = (row_ok & (t0 + lane < hi))[:, None]
        if CAUSAL:
            keep = keep & ((t_row * BLOCK_N)[:, None] + offs_n[None, :] <= diag[:, None])
        p_hat, p_scale, alpha, l_i, m_i = _softmax(
            s_int, qs * tl.load(KBS_ptr + bh * T + t_row), keep, m_i, l_i, sm_scale,
            LANES * G_PAD, NQ_PAD, PMAX, MASK,
        )
        r = ()
        for p in tl.static_range(4):
            r = r + (tl.zeros([BLOCK_M, DP], dtype=tl.float32),)
        for j in tl.static_range(LANES):
            tj = tl.minimum(t0 + j, hi - 1)
            pv = tl.load(vc_base + (tj * BLOCK_N + offs_n)[:, None] * WV + offs_wv[None, :])
            if LANES == 1:
                p_j = p_hat
            else:
                p_j = tl.where((lane == j)[:, None], p_hat, 0.0).to(tl.float16)
            if BITS_V == 2:
                sz = (bh * T + tj).to(tl.int64) * DP
                vz = tl.load(VZ_ptr + sz + offs_i)
                vs = tl.load(VS_ptr + sz + offs_i)
            new = ()
            for p in tl.static_range(4):
                if SUB_V:
                    x = _code_part_subnormal(pv, p)
                else:
                    x = _code_part(pv, p, BITS_V)
                if BITS_V == 2:
                    x = _dequant(x, _byte(vz, p), _byte(vs, p), BITS_V)
                new = new + (tl.dot(p_j, x, r[p]),)
            r = new
        if BITS_V == 4:  # P̂·V̂ = (P̂·(1024 + X^{q2}) + (z^int − 1024)·rowsum P̂) ⊙ s^int, exact (< 2²⁴)
            p_sum = tl.sum(p_hat.to(tl.float32), 1)
            vz_rows = tl.load(VZ_ptr + sz_row[:, None] + offs_i[None, :])
            vs_rows = tl.load(VS_ptr + sz_row[:, None] + offs_i[None, :])
            new = ()
            for p in tl.static_range(4):
                if SUB_V:  # r = Σ P̂ · code · 2⁻²⁴ (· 16 for odd parts), exact
                    rp = tl.math.fma(_byte(vz_rows, p).to(tl.float32), p_sum[:, None],
                                     r[p] * (1048576.0 if p % 2 == 1 else 16777216.0))
                else:
                    rp = tl.math.fma((_byte(vz_rows, p).to(tl.float32) - 1024.0), p_sum[:, None], r[p])
                new = new + (rp * _byte(vs_rows, p).to(tl.float32),)
            r = new
        v_scale = tl.load(VBS_ptr + bh * T + t_row)
        new = ()
        for p in tl.static_range(4):
            new = new + (_accumulate(acc[p], r[p], alpha, p_scale, v_scale),)
        acc = new
    if (pid_s == NUM_SPLITS - 1) & (NB > 0):  # the INT8 buffer: the newest keys, universal scale per head; lane 0
        buf = bh.to(tl.int64) * NB * HEAD_DIM + offs_n[:, None] * HEAD_DIM
        in_buf = offs_n[:, None] < NB
        s_int = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for p in tl.static_range(4):
            kb = tl.load(KB_ptr + buf + (offs_i * 4 + p)[None, :], mask=in_buf, other=0)
            s_int = tl.dot(q_hat[p], tl.trans(kb.to(tl.float16)), s_int)
        keep = (row_ok & (lane == 0))[:, None] & (offs_n[None, :] < NB)
        if CAUSAL:
            keep = keep & ((T * BLOCK_N + offs_n)[None, :] <= diag[:, None])
        p_hat, p_scale, alpha, l_i, m_i = _softmax(
            s_int, qs * tl.load(KBSC_ptr + bh), keep, m_i, l_i, sm_scale, LANES * G_PAD, NQ_PAD, PMAX, True,
        )
        v_scale = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(VBSC_ptr + bh)
        new = ()
        for p in tl.static_range(4):
            vb = tl.load(VB_ptr + buf + (offs_i * 4 + p)[None, :], mask=in_buf, other=0)
            new = new + (_accumulate(acc[p], tl.dot(p_hat, vb.to(tl.float16)), alpha, p_scale, v_scale),)
        acc = new
    if LANES > 1:  # merge the lanes of each row: w = SAS(m_lane − max m), as the combine step merges splits
        m2 = tl.reshape(m_i, (LANES, RPL))
        m_max = tl.max(m2, 0)
        w = _sas_exp(m2 - tl.where(m_max == float("-inf"), 0.0, m_max)[None, :])
        l_i = tl.sum(w * tl.reshape(l_i, (LANES, RPL)), 0)
        m_i = m_max
        new = ()
        for p in tl.static_range(4):
            new = new + (tl.sum(tl.reshape(acc[p], (LANES, RPL, DP)) * w[:, :, None], 0),)
        acc = new
        offs_r = tl.arange(0, RPL)
        g = offs_r // NQ_PAD
        qi = offs_r % NQ_PAD
        row_ok = (g < GROUP) & (qi < NQ)
    o_rows = O_ptr + b.to(tl.int64) * stride_ob + (h * GROUP + g)[:, None] * stride_oh + qi[:, None] * stride_om
    if DIRECT:
        empty = l_i == 0.0
        for p in tl.static_range(4):
            out = tl.where(empty[:, None], 0.0, acc[p] / tl.where(empty, 1.0, l_i)[:, None])
            tl.store(o_rows + (offs_i * 4 + p)[None, :], out.to(O_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        row0 = ((b * HKV * GROUP + h * GROUP + g) * NQ + qi).to(tl.int64) * NUM_SPLITS  # partials (B, H, Nq, S)
        tl.store(MP_ptr + row0 + pid_s, m_i, mask=row_ok)
        tl.store(LP_ptr + row0 + pid_s, l_i, mask=row_ok)
        for p in tl.static_range(4):  # acc partial of a (row, split): part-major, [4, D / 4], contiguous
            tl.store(ACC_ptr + ((row0 + pid_s) * HEAD_DIM + p * DP)[:, None] + offs_i[None, :], acc[p],
                     mask=row_ok[:, None])
        # The last split of (batch, KV head) to finish merges them all, in split order (deterministic): every
        # thread's partials are written (barrier) before the ticket is taken (release), read after it (acquire).
        tl.debug_barrier()
        ticket = tl.atomic_add(CNT_ptr + bh, 1, sem="acq_rel")
        if ticket == NUM_SPLITS - 1:
            tl.atomic_xchg(CNT_ptr + bh, 0)  # the counter is zero again for the next call
            acc, l_i = _merge_splits(MP_ptr, LP_ptr, ACC_ptr, row0, row_ok, NUM_SPLITS, HEAD_DIM, RPL, S_CHUNK)
            empty = l_i == 0.0
            for p in tl.static_range(4):
                out = tl.where(empty[:, None], 0.0, acc[p] / tl.where(empty, 1.0, l_i)[:, None])
                tl.store(o_rows + (offs_i * 4 + p)[None, :], out.to(O_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _merge_splits(MP_ptr, LP_ptr, ACC_ptr, row0, row_ok, NUM_SPLITS, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr,
                  S_CHUNK: tl.constexpr):
    """``(Σ_s w_s acc_s, Σ_s w_s ℓ_s)`` over the splits' partials of ``ROWS`` rows, ``w_s = SAS(m_s − max m)``
    (the reference's rescaling, α = SAS(Δm)), ``S_CHUNK`` splits at a time; loads bypass L1 (``.cg``: the
    partials were written by other programs)."""
    DP: tl.constexpr = HEAD_DIM // 4
    offs_c = tl.arange(0, S_CHUNK)
    offs_i = tl.arange(0, DP)
    m_max = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    for s0 in range(0, NUM_SPLITS, S_CHUNK):
        ok = row_ok[:, None] & (s0 + offs_c < NUM_SPLITS)[None, :]
        m = tl.load(MP_ptr + row0[:, None] + s0 + offs_c[None, :], mask=ok, other=float("-inf"), cache_modifier=".cg")
        m_max = tl.maximum(m_max, tl.max(m, 1))
    m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)
    ell = tl.zeros([ROWS], dtype=tl.float32)
    acc = ()
    for p in tl.static_range(4):
        acc = acc + (tl.zeros([ROWS, DP], dtype=tl.float32),)
    for s0 in range(0, NUM_SPLITS, S_CHUNK):
        ok = row_ok[:, None] & (s0 + offs_c < NUM_SPLITS)[None, :]
        part = row0[:, None] + s0 + offs_c[None, :]
        w = _sas_exp(tl.load(MP_ptr + part, mask=ok, other=float("-inf"), cache_modifier=".cg") - m_ref[:, None])
        ell += tl.sum(w * tl.load(LP_ptr + part, mask=ok, other=0.0, cache_modifier=".cg"), 1)
        new = ()
        for p in tl.static_range(4):
            a = tl.load(ACC_ptr + (part * HEAD_DIM + p * DP)[:, :, None] + offs_i[None, None, :], mask=ok[:, :, None],
                        other=0.0, cache_modifier=".cg")
            new = new + (acc[p] + tl.sum(w[:, :, None] * a, 1),)
        acc = new
    return acc, ell


# --------------------------------------------------------------------------- launcher


def _row_tile(group: int, nq: int, lanes: int = 1) -> tuple[int, int]:
    """``(G_PAD, NQ_PAD)``: powers of two, ``lanes·G_PAD·NQ_PAD ≥ 16`` (the smallest ``tl.dot`` M)."""
    nq_pad = next_pow2(nq)
    return max(next_pow2(group), next_pow2(math.ceil(16 / (lanes * nq_pad)))), nq_pad


def _lanes(group: int, nq: int, direct: bool) -> int:
    """Key blocks stacked in one 16-row tile (rows of different blocks are different lanes): 1 for the
    one-split path, which follows the reference's sequential loop."""
    return 1 if direct else max(1, 16 // (next_pow2(group) * next_pow2(nq)))


@functools.lru_cache(maxsize=256)
def _meta_tensor(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def default_num_splits(batch: int, kv_heads: int, n_blocks: int, device: torch.device) -> int:
    """Splits of the key blocks: :func:`~quantpatch.kernels.turbo_kv.turbo_decode_splits.split_count` with
    ``PROGRAMS_PER_SM`` programs per SM."""
    return split_count(batch, kv_heads, n_blocks, device, PROGRAMS_PER_SM)


@functools.lru_cache(maxsize=1)
def _reference_config() -> AttentionConfig:
    return decode_attention_config()


@functools.lru_cache(maxsize=64)
def _turbo_decode_numerics(cfg: AttentionConfig) -> bool:
    """``cfg`` is the decode numerics up to what the kernel takes as arguments (cached: checked every step)."""
    ref = _reference_config()
    same = cfg.replace(block_q=ref.block_q, qk_qmax=ref.qk_qmax, pv_qmax=ref.pv_qmax,
                       v_granularity=ref.v_granularity, two_level_accum=ref.two_level_accum, warps=ref.warps)
    return same == ref and cfg.sas_threshold == SAS_THRESHOLD and max(cfg.pv_qmax, cfg.qk_qmax) <= 127


def decode_unsupported(
    q: torch.Tensor,
    k_cache: CompressedKV,
    v_cache: CompressedKV,
    k_buffer: Int8Buffer | None,
    v_buffer: Int8Buffer | None,
    cfg: AttentionConfig | None = None,
) -> str | None:
    """Why the decode kernel cannot take this call (None if it can)."""
    cfg = _reference_config() if cfg is None else cfg
    b, h, nq, d = q.shape
    if d not in HEAD_DIMS or k_cache.head_dim != d or v_cache.head_dim != d:
        return f"head_dim {d} (the decode kernel takes {HEAD_DIMS})"
    if nq > MAX_Q_LEN:
        return f"q_len {nq} > {MAX_Q_LEN} (the decode kernel is for decode steps and short chunks)"
    if h % k_cache.kv_heads:
        return f"{h} query heads are not a multiple of {k_cache.kv_heads} KV heads"
    g_pad, nq_pad = _row_tile(h // k_cache.kv_heads, nq)
    if g_pad * nq_pad > MAX_ROWS:
        return f"{h // k_cache.kv_heads} query heads per KV head × q_len {nq} exceed {MAX_ROWS} rows"
    if any(w not in KERNEL_BITS for w in (*k_cache.bits, *v_cache.bits)):
        return f"code widths {sorted(set(k_cache.bits + v_cache.bits))} (the kernel unpacks {list(KERNEL_BITS)})"
    if k_cache.block != 64 or v_cache.block != 64 or cfg.block_k != 64:
        return f"cache block {k_cache.block} / key tile {cfg.block_k} (the kernel takes 64)"
    if (k_buffer is None) != (v_buffer is None) or (k_buffer is not None and k_buffer.n_tokens >= k_cache.block):
        return "K and V buffers must both be given and hold fewer than a block"
    if not _turbo_decode_numerics(cfg) or cfg.block_q < nq:
        return "attention numerics other than turbo decode (Q per token, SAS, P INT8 per tile, no smoothing)"
    if k_cache.n_blocks == 0 and (k_buffer is None or k_buffer.n_tokens == 0):
        return "empty cache"
    for cache in (k_cache, v_cache):
        for c in cache.codes:
            if c.stride(-1) != 1 or c.stride(-2) != c.shape[-1] or c.data_ptr() % 16:
                return "code tensors are not row-contiguous and 16-byte aligned"
    return None


def _group_offsets(heads: tuple[int, ...], k_codes, v_codes) -> tuple[int, ...]:
    """``(KV heads…, int32-word offset of each head's K codes from the group's first…, same for V…)``."""
    k0, v0 = k_codes[heads[0]].data_ptr(), v_codes[heads[0]].data_ptr()
    return (*heads, *((k_codes[h].data_ptr() - k0) // 4 for h in heads),
            *((v_codes[h].data_ptr() - v0) // 4 for h in heads))


def _regular_steps(offsets: tuple[int, ...]) -> tuple[int, int] | None:
    """``(K step, V step)`` in int32 words where the group's heads (:func:`_group_offsets`) are consecutive and their
    code tensors evenly spaced by multiples of 16 bytes (``turbo_compress_blocks`` lays a width's heads out so),
    else None."""
    n = len(offsets) // 3
    heads, k_offs, v_offs = offsets[:n], offsets[n:2 * n], offsets[2 * n:]
    if heads != tuple(range(heads[0], heads[0] + n)):
        return None
    steps = []
    for offs in (k_offs, v_offs):
        step = offs[1] if n > 1 else 0
        if step % 4 or any(o != i * step for i, o in enumerate(offs)):
            return None
        steps.append(step)
    return steps[0], steps[1]


def _words(x: torch.Tensor) -> torch.Tensor:
    """A uint8 / int8 tensor with unit last stride read as int32 words (last dim / 4), in place (the code tensors'
    offsets from one another are kernel arguments); other layouts are copied first."""
    if x.stride(-1) != 1 or x.data_ptr() % 16 or any(st % 4 for st in x.stride()[:-1]):
        x = x.contiguous().clone()
    return x.view(torch.int32)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Launch of one call shape (cached): what depends only on shapes, widths and options."""

    splits: int
    per_split: int
    lanes: int
    g_pad: int
    nq_pad: int
    s_chunk: int  # splits merged at once by the last program
    groups: tuple[tuple[int, int, tuple[int, ...]], ...]  # (K bits, V bits, KV heads), one launch each

    @property
    def direct(self) -> bool:
        return self.splits == 1

    @property
    def variant(self) -> tuple:
        """What the kernel's constexprs take from the plan (its compiled variant), the split sizes left out."""
        return self.direct, self.lanes, self.g_pad, self.nq_pad, self.s_chunk


@functools.lru_cache(maxsize=256)
def _plan(group: int, nq: int, t: int, k_bits: tuple[int, ...], v_bits: tuple[int, ...], num_splits: int,
          lanes: int) -> _Plan:
    splits = max(1, min(num_splits, t))
    direct = splits == 1
    lanes = lanes or _lanes(group, nq, direct)
    if direct and lanes != 1:
        raise ValueError("one split takes the blocks in order (lanes=1)")
    g_pad, nq_pad = _row_tile(group, nq, lanes)
    per_split = lanes * math.ceil(t / splits / lanes) if t else 0
    splits = math.ceil(t / per_split) if t else 1
    # ≤ 16 splits and ≤ 64 (row, split) pairs at a time: Triton 3.6 fails to compile the [4, 32, 32] reduction
    # at 2 warps (TritonGPUOptimizeThreadLocality, on an H200); the same chunk for any split count (the merge masks
    # the splits past it), so that a cache growing into more splits compiles no new variant
    s_chunk = max(2, min(16, 64 // (g_pad * nq_pad)))
    groups = tuple((kw, vw, tuple(heads)) for (kw, vw), heads in bit_groups(k_bits, v_bits))
    return _Plan(splits, per_split, lanes, g_pad, nq_pad, s_chunk, groups)


_WORKSPACES: dict[tuple, tuple[torch.Tensor, ...]] = {}
MAX_WORKSPACES = 16


def _workspace(device: torch.device, parts: int, d: int, counters: int) -> tuple[torch.Tensor, ...]:
    """``(m, ℓ, acc, counters)`` for the splits' partials, kept per (device, stream, size): the counters are
    zero between calls (the last split of each (batch, KV head) resets its own), so they are allocated once;
    per stream, so that calls on two streams never share one (a CUDA-graph capture reuses its stream's). ``m``, ``ℓ``
    and ``acc`` start on 16-byte boundaries whatever ``parts`` (their alignment is part of a compiled kernel's key,
    and ``parts`` follows the split count)."""
    key = (*stream_key(device), parts, d, counters)
    ws = _WORKSPACES.get(key)
    if ws is None:
        if len(_WORKSPACES) >= MAX_WORKSPACES:
            _WORKSPACES.pop(next(iter(_WORKSPACES)))
        stride = cdiv(parts, 4) * 4
        flat = torch.empty(2 * stride + parts * d, dtype=torch.float32, device=device)
        ws = (flat[:parts], flat[stride:stride + parts], flat[2 * stride:],
              torch.zeros(counters, dtype=torch.int32, device=device))
        _WORKSPACES[key] = ws
    return ws


def _launcher(
    q: torch.Tensor, k_codes: list[torch.Tensor], k_sint: torch.Tensor, k_zint: torch.Tensor, k_bscale: torch.Tensor,
    v_codes: list[torch.Tensor], v_sint: torch.Tensor, v_zint: torch.Tensor, v_bscale: torch.Tensor,
    k_bits: list[int], v_bits: list[int], is_causal: bool, sm_scale: float, num_splits: int, out_dtype: torch.dtype,
    qk_qmax: int, pv_qmax: int, num_warps: int, num_stages: int, lanes: int, kernel: str,
) -> Callable[..., torch.Tensor]:
    """What a decode call over these blocks launches, decided once: ``run(q, k_buf, k_buf_scale, v_buf,
    v_buf_scale) -> out`` for queries shaped like ``q`` and any INT8 buffers (see :func:`_decode`). One launch per
    code-width group (one in all for a uniform cache); the splits merge in the kernel. With ``kernel="auto"`` a group
    the Gluon kernel takes (:func:`gluon_takes`) goes to it; ``num_splits`` 0: each kernel's default."""
    b, h, nq, d = q.shape
    device = q.device
    hkv, t = k_sint.shape[1], k_sint.shape[2]
    splits = num_splits or default_num_splits(b, hkv, t, device)
    plan = _plan(h // hkv, nq, t, tuple(k_bits), tuple(v_bits), splits, lanes)

    def workspace(n_splits: int) -> tuple[torch.Tensor, ...]:
        return _workspace(device, b * h * nq * n_splits, d, b * hkv)

    gluon_groups, triton_groups = [], []
    for kw, vw, heads in plan.groups:
        offsets = _group_offsets(heads, k_codes, v_codes)
        if kernel == "auto" and gluon_takes(device, h // hkv, nq, d, kw, vw, t):
            steps = _regular_steps(offsets)
            gluon_groups.append((kw, vw, heads, offsets, None if steps else _meta_tensor(offsets, device), steps))
        else:
            triton_groups.append((kw, vw, heads, _meta_tensor(offsets, device)))
    words = [_words(x) for x in (k_sint, k_zint, v_sint, v_zint)]

    def triton_launch(kw: int, vw: int, heads: tuple[int, ...], meta: torch.Tensor, q: torch.Tensor, k_buf,
                      k_buf_scale, v_buf, v_buf_scale, nb: int, out: torch.Tensor) -> None:
        # never read with one split: any valid address
        m_part, l_part, acc_part, counters = (out,) * 4 if plan.direct else workspace(plan.splits)
        k_sint, k_zint, v_sint, v_zint = words
        kc, vc = (k_codes[heads[0]].view(torch.int32), v_codes[heads[0]].view(torch.int32)) if t else (k_sint, v_sint)
        _turbo_decode_kernel[(plan.splits, b * len(heads))](
            q, q.stride(0), q.stride(1), q.stride(2),
            kc, kc.stride(0), k_sint, k_zint, k_bscale,
            vc, vc.stride(0), v_sint, v_zint, v_bscale,
            k_buf, k_buf_scale, v_buf, v_buf_scale, meta,
            out, out.stride(0), out.stride(1), out.stride(2),
            m_part, l_part, acc_part, counters,
            nq, t, nb, hkv, len(heads), plan.per_split, plan.splits, sm_scale,
            HEAD_DIM=d, BLOCK_N=64, GROUP=h // hkv, G_PAD=plan.g_pad, NQ_PAD=plan.nq_pad, LANES=plan.lanes,
            BITS_K=kw, BITS_V=vw, CAUSAL=is_causal and nq > 1, ROW_MASK=nq < plan.nq_pad, DIRECT=plan.direct,
            QMAX=qk_qmax, PMAX=pv_qmax, SUB=SUBNORMAL_CODES, S_CHUNK=plan.s_chunk,
            num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=False,
        )

    def run(q: torch.Tensor, k_buf: torch.Tensor, k_buf_scale: torch.Tensor, v_buf: torch.Tensor,
            v_buf_scale: torch.Tensor) -> torch.Tensor:
        nb = k_buf.shape[-2]
        out = torch.empty((b, h, nq, d), dtype=out_dtype, device=device)
        # Tensors never read (no buffer, no blocks) still need a valid address for the launcher.
        k_buf, v_buf = (k_buf, v_buf) if nb else (k_sint, v_sint)
        for kw, vw, heads, offsets, meta, steps in gluon_groups:
            try:
                _gluon.launch(q, heads, meta, steps, k_codes[heads[0]], v_codes[heads[0]], k_sint, k_zint, k_bscale,
                              v_sint, v_zint, v_bscale, k_buf, k_buf_scale, v_buf, v_buf_scale, nb, out, workspace,
                              sm_scale, qk_qmax, pv_qmax, num_splits)
            except triton.CompilationError as err:  # a Triton whose Gluon API differs: warn once, Triton serves
                GLUON.close(device, err)
                triton_launch(kw, vw, heads, meta if meta is not None else _meta_tensor(offsets, device), q, k_buf,
                              k_buf_scale, v_buf, v_buf_scale, nb, out)
        for kw, vw, heads, meta in triton_groups:
            triton_launch(kw, vw, heads, meta, q, k_buf, k_buf_scale, v_buf, v_buf_scale, nb, out)
        return out

    return run


def _decode(
    q: torch.Tensor, k_codes: list[torch.Tensor], k_sint: torch.Tensor, k_zint: torch.Tensor, k_bscale: torch.Tensor,
    v_codes: list[torch.Tensor], v_sint: torch.Tensor, v_zint: torch.Tensor, v_bscale: torch.Tensor,
    k_buf: torch.Tensor, k_buf_scale: torch.Tensor, v_buf: torch.Tensor, v_buf_scale: torch.Tensor,
    k_bits: list[int], v_bits: list[int], is_causal: bool, sm_scale: float, num_splits: int, out_dtype: torch.dtype,
    qk_qmax: int, pv_qmax: int, num_warps: int, num_stages: int, lanes: int, kernel: str,
) -> torch.Tensor:
    """The decode kernels' launches for one call (:func:`_launcher`, then its run on the buffers)."""
    run = _launcher(q, k_codes, k_sint, k_zint, k_bscale, v_codes, v_sint, v_zint, v_bscale, k_bits, v_bits,
                    is_causal, sm_scale, num_splits, out_dtype, qk_qmax, pv_qmax, num_warps, num_stages, lanes, kernel)
    return run(q, k_buf, k_buf_scale, v_buf, v_buf_scale)


# Custom-op form over the tensors of the ``CompressedKV`` and ``Int8Buffer``: what ``torch.compile`` traces
# (eager calls go to ``_decode`` directly).
turbo_decode_attention_op = torch.library.custom_op("quantpatch::turbo_decode_attention", _decode, mutates_args=())


@turbo_decode_attention_op.register_fake
def _(q, k_codes, k_sint, k_zint, k_bscale, v_codes, v_sint, v_zint, v_bscale, k_buf, k_buf_scale, v_buf,
      v_buf_scale, k_bits, v_bits, is_causal, sm_scale, num_splits, out_dtype, qk_qmax, pv_qmax, num_warps,
      num_stages, lanes, kernel):
    return q.new_empty(q.shape, dtype=out_dtype)


def turbo_decode_attention(
    q: torch.Tensor,
    k_cache: CompressedKV,
    v_cache: CompressedKV,
    k_buffer: Int8Buffer | None = None,
    v_buffer: Int8Buffer | None = None,
    *,
    cfg: AttentionConfig | None = None,
    is_causal: bool = True,
    scale: float | None = None,
    num_splits: int | None = None,
    out_dtype: torch.dtype | None = None,
    num_warps: int = NUM_WARPS,
    num_stages: int = NUM_STAGES,
    lanes: int = 0,
    kernel: str = "auto",
    check: bool = True,
) -> torch.Tensor:
    """Decode attention of ``q`` over a compressed cache: the kernel form of ``turbo_decode_attention_ref``.

    Args:
        q: ``(B, H, Nq, D)``, ``Nq ≤ 16``, the newest tokens (already in the cache), any float dtype;
            ``D`` in :data:`HEAD_DIMS`, ``H`` a multiple of ``Hkv``.
        k_cache / v_cache: ``CompressedKV`` ``(B, Hkv, T blocks of 64)``, 2- or 4-bit per head.
        k_buffer / v_buffer: ``Int8Buffer`` ``(B, Hkv, Nb < 64, D)`` or None.
        cfg: the decode numerics (default ``decode_attention_config()``); see :func:`decode_unsupported`.
        is_causal: bottom-right causal among the ``Nq`` query tokens.
        num_splits: splits of the key blocks (default: :func:`default_num_splits` for the Triton kernel,
            ``turbo_decode_gluon.default_num_splits`` for the Gluon one); 1 = the kernel follows the
            reference's sequential loop, more = the last split of each (batch, KV head) merges them.
        out_dtype: default ``q.dtype``.
        num_warps / num_stages: launch of the decode kernel (benchmarks sweep them).
        lanes: key blocks stacked in one tile (0: as many as fill 16 rows; 1 with one split).
        kernel: ``"auto"`` (the Gluon kernel for the code-width groups it takes on sm_90, :func:`gluon_takes`;
            the Triton one for the rest) or ``"triton"`` (the Triton kernel for all).
        check: False where the caller has just run :func:`decode_unsupported` on the same arguments.

    Returns:
        ``o (B, H, Nq, D)`` in ``out_dtype``.
    """
    if check and (reason := decode_unsupported(q, k_cache, v_cache, k_buffer, v_buffer, cfg)) is not None:
        raise ValueError(f"turbo decode kernel: {reason}")
    if kernel not in ("auto", "triton"):
        raise ValueError(f"kernel={kernel!r}: choose 'auto' or 'triton'")
    b, d = q.shape[0], q.shape[-1]
    if k_buffer is None:
        hkv = k_cache.kv_heads
        empty = torch.zeros((b, hkv, 0, d), dtype=torch.int8, device=q.device)
        k_buffer = v_buffer = Int8Buffer(empty, torch.ones((b, hkv, 1, 1), device=q.device))
    args = (q, *_block_args(k_cache, v_cache), *_buffer_args(k_buffer, v_buffer),
            *_options(q, k_cache, v_cache, cfg, is_causal, scale, num_splits, out_dtype, num_warps, num_stages, lanes,
                      kernel))
    # The custom op is what torch.compile traces; eagerly its dispatch costs more host time than the launch.
    return turbo_decode_attention_op(*args) if torch.compiler.is_compiling() else _decode(*args)


def _block_args(k_cache: CompressedKV, v_cache: CompressedKV) -> tuple:
    """The blocks' tensors as :func:`_decode` takes them."""
    return (list(k_cache.codes), _as(k_cache.int_scale, torch.int8), _as(k_cache.int_zero, torch.int8),
            _as(k_cache.block_scale, torch.float32),
            list(v_cache.codes), _as(v_cache.int_scale, torch.int8), _as(v_cache.int_zero, torch.int8),
            _as(v_cache.block_scale, torch.float32))


def _buffer_args(k_buffer: Int8Buffer, v_buffer: Int8Buffer) -> tuple:
    """The buffers' tensors as :func:`_decode` takes them."""
    return (_as(k_buffer.values, torch.int8), _as(k_buffer.scale, torch.float32),
            _as(v_buffer.values, torch.int8), _as(v_buffer.scale, torch.float32))


def _options(q: torch.Tensor, k_cache: CompressedKV, v_cache: CompressedKV, cfg: AttentionConfig | None,
             is_causal: bool, scale: float | None, num_splits: int | None, out_dtype: torch.dtype | None,
             num_warps: int, num_stages: int, lanes: int, kernel: str) -> tuple:
    """:func:`turbo_decode_attention`'s options as :func:`_decode` takes them."""
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    cfg = _reference_config() if cfg is None else cfg
    return (list(k_cache.bits), list(v_cache.bits), is_causal, sm_scale, num_splits or 0, out_dtype or q.dtype,
            cfg.qk_qmax, cfg.pv_qmax, num_warps, num_stages, lanes, kernel)


def decode_plan(q: torch.Tensor, k_cache: CompressedKV, v_cache: CompressedKV, *, cfg: AttentionConfig | None = None,
                is_causal: bool = True, scale: float | None = None) -> Callable[..., torch.Tensor]:
    """:func:`turbo_decode_attention` over these blocks with its decisions made once: ``run(q, k_buffer, v_buffer)
    -> o`` for queries of ``q``'s shape, dtype and device and any buffers (``Int8Buffer`` of fewer than a block), with
    no checks (the caller has run :func:`decode_unsupported` on a call of the same blocks and layout)."""
    run = _launcher(q, *_block_args(k_cache, v_cache),
                    *_options(q, k_cache, v_cache, cfg, is_causal, scale, None, None, NUM_WARPS, NUM_STAGES, 0, "auto"))

    def planned(q: torch.Tensor, k_buffer: Int8Buffer, v_buffer: Int8Buffer) -> torch.Tensor:
        return run(q, *_buffer_args(k_buffer, v_buffer))

    return planned


def gluon_takes(device: torch.device, group: int, nq: int, d: int, k_bits: int, v_bits: int, n_blocks: int) -> bool:
    """Whether a code-width group of a call goes to the Gluon kernel (:mod:`.turbo_decode_gluon`): where
    :data:`GLUON` opens on ``device`` and the kernel takes the shape (``turbo_decode_gluon.group_unsupported``)."""
    return GLUON.unsupported(device) is None and _gluon.group_unsupported(group, nq, d, k_bits, v_bits,
                                                                          n_blocks) is None


# blocks: a longer cache launches the decode-kernel variants of this length (from 8 blocks on each kernel splits the
# keys whenever it ever does, and the Triton kernel's 16 lanes fill 2 splits from 32 blocks on; only the split sizes
# grow, which are not specialized)
VARIANT_HORIZON = 64


def _variants(batch: int, group: int, k_bits: tuple[int, ...], v_bits: tuple[int, ...], d: int, t: int,
              device: torch.device) -> tuple:
    """The compiled variants that a single-token decode call over ``t`` blocks launches (default splits): per
    code-width group, the Gluon kernel's (one split or several) or the Triton kernel's (its plan's)."""
    plan = _plan(group, 1, t, k_bits, v_bits, default_num_splits(batch, len(k_bits), t, device), 0)
    return tuple(("gluon", _gluon.launch_splits(batch, len(heads), t, 0, device)[0] == 1)
                 if gluon_takes(device, group, 1, d, kw, vw, t) else ("triton", kw, vw, plan.variant)
                 for kw, vw, heads in plan.groups)


@functools.lru_cache(maxsize=256)
def decode_variant_blocks(batch: int, group: int, k_bits: tuple[int, ...], v_bits: tuple[int, ...], d: int,
                          n_blocks: int, device: torch.device) -> tuple[int, ...]:
    """Cache sizes, in blocks, whose single-token decode calls (``group`` query heads per KV head, default splits)
    launch between them every kernel variant that the calls over a cache of ``n_blocks`` blocks or more launch, each
    the smallest size of its variant: the sizes a cache compiles its decode steps' kernels on before they run.

    ``decode_variant_blocks(1, 4, (4,) * 8, (4,) * 8, 128, 0, cuda)`` on an H200 is ``(0, 1, 8)``: the Triton kernel
    over the buffer alone, the Gluon kernel with one split, with several (from 8 blocks)."""
    variants = [_variants(batch, group, k_bits, v_bits, d, t, device) for t in range(VARIANT_HORIZON + 1)]
    first: dict[tuple, int] = {}
    for t, variant in enumerate(variants):
        first.setdefault(variant, t)
    return tuple(sorted({first[variant] for variant in variants[min(n_blocks, VARIANT_HORIZON):]}))


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in ``dtype``, contiguous (itself when it already is)."""
    return x if x.dtype == dtype and x.is_contiguous() else x.to(dtype).contiguous()


__all__ = ["decode_plan", "decode_unsupported", "decode_variant_blocks", "default_num_splits", "gluon_takes",
           "turbo_decode_attention"]

# last: the Gluon kernel (Triton 3.6+'s triton.experimental.gluon) serves the groups it takes on sm_90
try:
    from . import turbo_decode_gluon as _gluon

    _GLUON_IMPORT_ERROR = None
except ImportError as _err:
    _gluon, _GLUON_IMPORT_ERROR = None, str(_err)
GLUON = GluonGate("TurboAttention decode (4-bit, q_len 1)", "the Triton decode kernel", _GLUON_IMPORT_ERROR)
