"""Quantized attention forward (Triton): INT8 (or FP8) Q·Kᵀ, FP8 (or INT8) P̃·V, online softmax in exp2.

One kernel serves the prefill numerics of ``sage2`` (INT8/INT4-range Q·K, FP8 P·V),
``int8_flash`` (INT8 Q·K, INT8 P·V with P = rne(127·P̃) and ℓ from the quantized P) and
``fireq`` (FP8 Q·K, FP8 P·V) through constexpr switches. Per key block ``j`` of BLOCK_N keys::

    S   = (Q̂ K̂ⱼᵀ) ⊙ (δQ δKⱼᵀ) + ΔS_raw[b, j] − q̄_b·K̄   int32 (or fp32) accumulate, dequantized in fp32
    S₂  = S · scale · log₂e                             (log₂e folded into the per-row Q scale)
    m'  = max(m, rowmax S₂)     P̃ = 2^(S₂ − m')     α = 2^(m − m')
    P̂   = e4m3(448 P̃)   |  rne(127 P̃)                static scale: P̃ ∈ [0, 1]
    Rⱼ  = P̂ V̂ⱼ                                        own accumulator per block (two-level, §3.4)
    acc = α acc + Rⱼ,   ℓ = α ℓ + rowsum(P̃ | P̂/127)
    O   = acc · δV / pmax / ℓ (+ mean V),   lse = (m + log₂ ℓ) · ln 2

``turbo`` (TurboAttention Alg. 1) takes the same loop with its own softmax and P·V steps
(``TURBO``): S in natural units, P̃ = SAS(S − m') and α = SAS(m − m') (LUT[⌊−x⌋] · cubic, 0 below
n_r = −6), P̂ = rne(P̃ / δP) with the dynamic per-tile δP = max(P̃ over BLOCK_M × BLOCK_N)/119,
Rⱼ = (P̂ V̂ⱼ) · δP · δVⱼ with a per-key-block V scale, ℓ sums P̃, O = acc / ℓ, lse = m + ln ℓ.
So BLOCK_M is the paper's query block and BLOCK_N its key block.

``V̂`` arrives transposed (``(B, Hkv, D, Nk_pad)``, tokens contiguous) because Hopper's 8-bit
wgmma reads both operands K-major. Causal masks are bottom-right aligned (query i sees keys
j ≤ i + Nk − Nq); the key loop runs unmasked over the blocks every row of the tile sees and
masked only over the diagonal and the tail. GQA: query head h reads kv head h // (H / Hkv).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..compiled_launch import LaunchPlans, cdiv, interpreting
from ..rounding_triton import _to_fp8e4m3
from .qk_quant_triton import QuantizedQKV
from .sas_ref import POLY_COEFFS

LOG2E = 1.4426950408889634
MAGIC_F = tl.constexpr(12582912.0)  # 1.5·2²³: x + MAGIC_F puts rne(x) in the low mantissa bits for |x| < 2²²
MAGIC_I = tl.constexpr(0x4B400000)  # its bit pattern

SAS_THRESHOLD = -6.0  # n_r (TurboAttention's) the kernels take; other thresholds run the reference
_N_R, _NEG_LOG2E = tl.constexpr(SAS_THRESHOLD), tl.constexpr(-LOG2E)
_SAS_C3, _SAS_C2, _SAS_C1, _SAS_C0 = (tl.constexpr(c) for c in POLY_COEFFS)


@triton.jit
def _sas_exp(x):
    """TurboAttention's SAS ``exp(x)`` for ``x <= 0`` (``sas_ref.sas_exp``): 0 below n_r and for −∞.

    The integer part's table entry e^{−i} is one ``ex2`` (the special-function unit; within 2 ulp
    of the reference's float32 table, ``sas_ref.sas_lut``): Triton has no register gather, and a
    select chain over the 7 entries cost 12 ALU ops per score, more than the two MMAs (measured
    88 TFLOPS on an H200 that way).
    """
    keep = x >= _N_R
    t = tl.where(keep, -x, 0.0)
    i = tl.floor(t)
    f = t - i
    poly = ((_SAS_C3 * f + _SAS_C2) * f + _SAS_C1) * f + _SAS_C0
    return tl.where(keep, tl.math.exp2(i * _NEG_LOG2E) * poly, 0.0)


@triton.jit
def _mask_scores(s, cols, offs_m, NK, DIAG, CAUSAL: tl.constexpr):
    """``s`` with keys past ``NK`` (and, causal, past row ``i + DIAG``) set to −∞."""
    keep = cols[None, :] < NK
    if CAUSAL:
        keep = keep & (cols[None, :] <= offs_m[:, None] + DIAG)
    return tl.where(keep, s, float("-inf"))


@triton.jit
def _attn_block(
    acc, l_i, m_i, q, qs,
    K_ptr, KS_ptr, VT_ptr, DS_ptr, qk_scale,
    lo, hi, offs_m, NK, DIAG,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, NK_PAD_STRIDE,
    QK_FP8: tl.constexpr, PV_INT8: tl.constexpr, P_MAX: tl.constexpr, L_FROM_P: tl.constexpr,
    SMOOTH_Q: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr, TWO_LEVEL: tl.constexpr,
    EMULATE: tl.constexpr,
):
    """Keys ``[lo, hi)`` in blocks of BLOCK_N; ``MASKED`` adds the causal / tail mask.

    ``l_i`` is kept in units of P_MAX: P_MAX·P̃ = 2^((S − m)·qk_scale + log₂ P_MAX) comes straight out
    of exp2 (no multiply before the FP8/INT8 cast). S and ``m_i`` are raw scores (``qs`` without the softmax
    scale; qk_scale = log₂e/√d enters through the exp2's multiply-add), and with smooth Q S holds ΔS_raw = q̄·K_j
    as stored: its row constant q̄·K̄ shifts a row's scores and its max alike, so P̃ and α are unchanged.
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    LOG2_PMAX: tl.constexpr = math.log2(P_MAX)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k = tl.load(K_ptr + cols[:, None] * HEAD_DIM + offs_d[None, :])
        ks = tl.load(KS_ptr + cols)
        if QK_FP8:
            s = tl.dot(q, tl.trans(k)) * ks[None, :]
        else:
            s_int = tl.dot(q, tl.trans(k), out_dtype=tl.int32)
            s = s_int.to(tl.float32) * ks[None, :]  # Hopper's I2F is fast: the 1.5·2²³ trick gained nothing here
        if SMOOTH_Q:
            s = s * qs[:, None] + tl.load(DS_ptr + cols)[None, :]
        else:
            s = s * qs[:, None]
        if MASKED:
            s = _mask_scores(s, cols, offs_m, NK, DIAG, CAUSAL)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet: 2^-inf = 0, not NaN
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = m_new
        alpha = tl.math.exp2((m_i - m_safe) * qk_scale)
        p = tl.math.exp2(s * qk_scale - (m_safe * qk_scale - LOG2_PMAX)[:, None])  # = P_MAX · P̃
        vt = tl.load(VT_ptr + offs_d[:, None] * NK_PAD_STRIDE + cols[None, :])
        if PV_INT8:
            # P_MAX·P̃ ∈ [0, 127]: adding 1.5·2²³ rounds it half-to-even into the low mantissa bits, so
            # the integer comes out with integer ops instead of the slow float-to-int unit
            p_bits = (p + MAGIC_F).to(tl.int32, bitcast=True) - MAGIC_I
            p_hat = p_bits.to(tl.int8)
            r = tl.dot(p_hat, tl.trans(vt), out_dtype=tl.int32)
            # |R| <= 127² · BLOCK_N < 2²²: the same trick back to float
            r = (r + MAGIC_I).to(tl.float32, bitcast=True) - MAGIC_F
            acc = acc * alpha[:, None] + r
        else:
            p_hat = _to_fp8e4m3(p, EMULATE)
            if TWO_LEVEL:  # R_j in its own (FP22 on Hopper) accumulator, then into the fp32 one
                acc = acc * alpha[:, None] + tl.dot(p_hat, tl.trans(vt))
            else:
                acc = tl.dot(p_hat, tl.trans(vt), acc * alpha[:, None])
        if L_FROM_P and PV_INT8:
            l_add = tl.sum(p_bits.to(tl.float32), 1)
        elif L_FROM_P:
            l_add = tl.sum(p_hat.to(tl.float32), 1)
        else:
            l_add = tl.sum(p, 1)
        l_i = l_i * alpha + l_add
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_block_turbo(
    acc, l_i, m_i, q, qs, K_ptr, KS_ptr, VT_ptr, VS_ptr,
    lo, hi, offs_m, row_ok, NK, DIAG,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, NK_PAD_STRIDE, P_QMAX: tl.constexpr,
    CAUSAL: tl.constexpr, MASKED: tl.constexpr,
):
    """TurboAttention's steps over keys ``[lo, hi)`` (``qs`` carries the natural softmax scale).

    Rows past NQ are zeroed before the tile max, so that δP is the max over real rows only. A row
    that sees no key of a block keeps its state (α = 1), as in ``BlockedAttention``.
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k = tl.load(K_ptr + cols[:, None] * HEAD_DIM + offs_d[None, :])
        s_int = tl.dot(q, tl.trans(k), out_dtype=tl.int32)
        s = s_int.to(tl.float32) * tl.load(KS_ptr + cols)[None, :] * qs[:, None]
        if MASKED:
            s = _mask_scores(s, cols, offs_m, NK, DIAG, CAUSAL)
        block_max = tl.max(s, 1)
        m_new = tl.maximum(m_i, block_max)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = _sas_exp(m_i - m_safe)
        if MASKED:  # a block a row cannot see leaves its state alone (SAS(0) = 0.9996, not 1)
            alpha = tl.where(block_max == float("-inf"), 1.0, alpha)
        p = tl.where(row_ok[:, None], _sas_exp(s - m_safe[:, None]), 0.0)
        p_scale = tl.math.div_rn(tl.max(tl.max(p, 1), 0), P_QMAX)
        p_scale = tl.where(p_scale == 0.0, 1.0, p_scale)
        # one IEEE division per tile; per element a multiply by its reciprocal (within an ulp of P̃ / δP)
        p_q = tl.minimum(p * tl.math.div_rn(1.0, p_scale), P_QMAX)  # P̃ >= 0: only the top clamp can bind
        p_hat = ((p_q + MAGIC_F).to(tl.int32, bitcast=True) - MAGIC_I).to(tl.int8)
        vt = tl.load(VT_ptr + offs_d[:, None] * NK_PAD_STRIDE + cols[None, :])
        r = tl.dot(p_hat, tl.trans(vt), out_dtype=tl.int32)
        r = (r + MAGIC_I).to(tl.float32, bitcast=True) - MAGIC_F  # |R| <= 119² · BLOCK_N < 2²²
        acc = acc * alpha[:, None] + r * p_scale * tl.load(VS_ptr + start_n // BLOCK_N)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["NQ", "NK"])
def _attn_fwd_kernel(
    Q_ptr, K_ptr, VT_ptr, QS_ptr, KS_ptr, DS_ptr, QM_ptr, KM_ptr, VS_ptr, VM_ptr, O_ptr, LSE_ptr,
    stride_ob, stride_oh, stride_om,
    NQ, NK, NK_PAD, H, GROUP, NQB, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, Q_BLOCK: tl.constexpr,
    QK_FP8: tl.constexpr, PV_INT8: tl.constexpr, P_MAX: tl.constexpr, L_FROM_P: tl.constexpr,
    SMOOTH_Q: tl.constexpr, SMOOTH_K: tl.constexpr, SMOOTH_V: tl.constexpr, V_TENSOR: tl.constexpr,
    CAUSAL: tl.constexpr,
    RETURN_LSE: tl.constexpr, TWO_LEVEL: tl.constexpr, EMULATE: tl.constexpr,
    TURBO: tl.constexpr,
):
    """One tile of BLOCK_M query rows of one (batch, head)."""
    LOG2_PMAX: tl.constexpr = math.log2(P_MAX)
    pid_m = tl.program_id(0)
    if CAUSAL:  # the longest rows first: better tail balance
        pid_m = tl.num_programs(0) - 1 - pid_m
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    bh_kv = b * (H // GROUP) + h // GROUP
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < NQ
    q = tl.load(Q_ptr + (pid_bh.to(tl.int64) * NQ + offs_m[:, None]) * HEAD_DIM + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    qs = tl.load(QS_ptr + pid_bh.to(tl.int64) * NQ + offs_m, mask=row_ok, other=0.0)
    k_base = K_ptr + bh_kv.to(tl.int64) * NK_PAD * HEAD_DIM
    ks_base = KS_ptr + bh_kv.to(tl.int64) * NK_PAD
    vt_base = VT_ptr + bh_kv.to(tl.int64) * HEAD_DIM * NK_PAD
    ds_base = DS_ptr
    if SMOOTH_Q:
        ds_base = DS_ptr + (pid_bh.to(tl.int64) * NQB + m0 // Q_BLOCK) * NK_PAD

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    diag = NK - NQ
    if CAUSAL:
        hi = tl.minimum(NK, m0 + BLOCK_M + diag)
        full_hi = tl.minimum(hi, m0 + diag + 1)
    else:
        hi = NK
        full_hi = NK
    hi = tl.maximum(hi, 0)
    full_hi = (tl.maximum(full_hi, 0) // BLOCK_N) * BLOCK_N
    if TURBO:
        vs_base = VS_ptr + bh_kv.to(tl.int64) * (NK_PAD // BLOCK_N)
        acc, l_i, m_i = _attn_block_turbo(
            acc, l_i, m_i, q, qs * qk_scale, k_base, ks_base, vt_base, vs_base, 0, full_hi, offs_m, row_ok, NK, diag,
            HEAD_DIM, BLOCK_N, NK_PAD, P_MAX, CAUSAL, False,
        )
        acc, l_i, m_i = _attn_block_turbo(
            acc, l_i, m_i, q, qs * qk_scale, k_base, ks_base, vt_base, vs_base, full_hi, hi, offs_m, row_ok, NK, diag,
            HEAD_DIM, BLOCK_N, NK_PAD, P_MAX, CAUSAL, True,
        )
        out = acc  # dequantized block by block
    else:
        acc, l_i, m_i = _attn_block(
            acc, l_i, m_i, q, qs, k_base, ks_base, vt_base, ds_base, qk_scale, 0, full_hi, offs_m, NK, diag,
            HEAD_DIM, BLOCK_N, NK_PAD, QK_FP8, PV_INT8, P_MAX, L_FROM_P, SMOOTH_Q, CAUSAL, False, TWO_LEVEL,
            EMULATE,
        )
        acc, l_i, m_i = _attn_block(
            acc, l_i, m_i, q, qs, k_base, ks_base, vt_base, ds_base, qk_scale, full_hi, hi, offs_m, NK,
            diag, HEAD_DIM, BLOCK_N, NK_PAD, QK_FP8, PV_INT8, P_MAX, L_FROM_P, SMOOTH_Q, CAUSAL, True, TWO_LEVEL,
            EMULATE,
        )
        # acc is in units of P_MAX·V̂ and l_i in units of P_MAX: the two P_MAX cancel
        if V_TENSOR:
            out = acc * tl.load(VS_ptr)
        else:
            out = acc * tl.load(VS_ptr + bh_kv * HEAD_DIM + offs_d)[None, :]
    empty = l_i == 0.0
    out = out / tl.where(empty, 1.0, l_i)[:, None]
    if SMOOTH_V:
        out += tl.load(VM_ptr + bh_kv * HEAD_DIM + offs_d)[None, :]
    out = tl.where(empty[:, None], 0.0, out)
    o_ptrs = O_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :]
    tl.store(o_ptrs, out.to(O_ptr.dtype.element_ty), mask=row_ok[:, None])
    if RETURN_LSE:
        if TURBO:  # m and ℓ in natural units
            lse = m_i + tl.log(tl.where(empty, 1.0, l_i))
        else:
            ds_shift = 0.0  # the row constant q̄·K̄ that ΔS_raw holds and the reference's ΔS does not
            if SMOOTH_Q:
                if SMOOTH_K:
                    qm = tl.load(QM_ptr + (pid_bh * NQB + m0 // Q_BLOCK) * HEAD_DIM + offs_d)
                    ds_shift = tl.sum(qm * tl.load(KM_ptr + bh_kv * HEAD_DIM + offs_d), 0)
            lse = (m_i - ds_shift) * qk_scale + tl.math.log2(tl.where(empty, 1.0, l_i)) - LOG2_PMAX
            lse = lse * 0.6931471805599453
        lse = tl.where(empty, float("-inf"), lse)
        tl.store(LSE_ptr + pid_bh.to(tl.int64) * NQ + offs_m, lse, mask=row_ok)


_ATTN_LAUNCH = LaunchPlans(_attn_fwd_kernel)  # later calls of a shape skip JITFunction.run's host work


def attn_qk_int8_pv_fp8(
    x: QuantizedQKV,
    nk: int,
    *,
    is_causal: bool = False,
    sm_scale: float | None = None,
    return_lse: bool = False,
    out_dtype: torch.dtype = torch.bfloat16,
    block_q: int = 128,
    l_from_quantized_p: bool = False,
    two_level_accum: bool = True,
    block_m: int = 128,
    block_n: int = 128,
    num_warps: int = 8,
    num_stages: int = 2,
    maxnreg: int | None = None,
    turbo: bool = False,
    p_qmax: int = 119,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the operands of :func:`~quantpatch.kernels.attention.qk_quant_triton.quantize_qkv` for ``nk``
    keys.

    The operand dtypes choose the numerics: ``q_hat`` int8 → INT8 Q·Kᵀ, float8_e4m3fn → FP8;
    ``v_hat_t`` float8_e4m3fn → FP8 P·V (P̂ = e4m3(448 P̃)), int8 → INT8 P·V (P̂ = rne(127 P̃)).
    ``delta_s`` non-empty adds the smooth-Q bias (its rows are query blocks of ``block_q``).
    ``turbo`` runs TurboAttention's SAS softmax with P̂ = rne(P̃ / (max_tile P̃ / ``p_qmax``)) over
    INT8 V with one scale per key block (``v_scale (B, Hkv, Nk_pad / block_n)``); its P tile is
    ``block_m × block_n``, so ``block_m`` must be the config's ``block_q`` and ``block_n`` its ``block_k``.

    Returns:
        ``o (B, H, Nq, D)`` in ``out_dtype`` and ``lse (B, H, Nq)`` float32 natural log
        (empty when not asked).
    """
    b, h, nq, d = x.q_hat.shape
    hkv, nk_pad = x.k_hat.shape[1], x.k_hat.shape[2]
    if nk_pad % block_n:
        raise ValueError(f"k_hat is padded to {nk_pad} keys, not a multiple of block_n={block_n}")
    smooth_q = x.delta_s.numel() > 0
    if smooth_q and block_q % block_m:
        raise ValueError(f"block_m={block_m} must divide block_q={block_q} when delta_s is given")
    qk_fp8 = x.q_hat.dtype == torch.float8_e4m3fn
    pv_int8 = x.v_hat_t.dtype == torch.int8
    p_max = 127.0 if pv_int8 else 448.0
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    qk_scale = scale * LOG2E  # the exp2 softmax folds log₂e into the scores
    if turbo:
        if qk_fp8 or not pv_int8 or smooth_q or x.v_scale.shape != (b, hkv, nk_pad // block_n) or block_m != block_q:
            raise ValueError("turbo needs INT8 Q/K/V operands, no ΔS, one V scale per key block of block_n "
                             "and block_m = block_q (the P tile)")
        p_max, qk_scale = float(p_qmax), scale  # SAS works on natural-unit scores
    o = torch.empty((b, h, nq, d), device=x.q_hat.device, dtype=out_dtype)
    lse = torch.empty((b, h, nq) if return_lse else (0,), device=o.device, dtype=torch.float32)
    _ATTN_LAUNCH(
        (cdiv(nq, block_m), b * h),
        (x.q_hat, x.k_hat, x.v_hat_t, x.q_scale, x.k_scale, x.delta_s, x.q_mean, x.k_mean, x.v_scale, x.v_mean, o, lse,
         o.stride(0), o.stride(1), o.stride(2),
         nq, nk, nk_pad, h, h // hkv, x.delta_s.shape[2] if smooth_q else 1, qk_scale),
        dict(HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, Q_BLOCK=block_q,
             QK_FP8=qk_fp8, PV_INT8=pv_int8, P_MAX=p_max, L_FROM_P=l_from_quantized_p,
             SMOOTH_Q=smooth_q, SMOOTH_K=x.k_mean.numel() > 0, SMOOTH_V=x.v_mean.numel() > 0,
             V_TENSOR=x.v_scale.numel() == 1, CAUSAL=is_causal,
             RETURN_LSE=return_lse, TWO_LEVEL=two_level_accum, EMULATE=interpreting(), TURBO=turbo),
        num_warps=num_warps, num_stages=num_stages, **({} if maxnreg is None else dict(maxnreg=maxnreg)),
    )
    return o, lse
