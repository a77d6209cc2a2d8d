"""TurboAttention decode attention over the compressed KV cache (Triton), Algorithm 2 with FlashQ and SAS.

The numerics of :func:`~quantpatch.kernels.turbo_ref.turbo_decode_attention_ref` (``turbo`` with Q per
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

Channels by code position: byte ``j`` of a packed row holds channels ``k·j + i`` (``k = 8 / bits``) at
bits ``bits·i``, so the codes at position ``i`` of every byte form a ``(keys, D/k)`` tile with one shift
and one mask, and the head dim is split into those ``k`` parts (Q̂, the scales, the output accumulator):
``S = Σ_i Q̂_i K̂_iᵀ`` (no ``(keys, D)`` tile is ever built, no reshape). 4-bit blocks need no clamp, so
``Q̂ K̂ᵀ = (Q̂ ⊙ s^int)·(X^{q2} + z^int)ᵀ`` (``|Q̂ ⊙ s^int| ≤ 119·16`` is exact in fp16) and
``P̂ V̂ = s^int ⊙ (P̂ X^{q2} + z^int · rowsum P̂)``: the scales act on the small side (Q's 16 rows, the
``(rows, D)`` result) and the codes go to the dots as they are. P̂: one IEEE reciprocal per row, then
Markstein's correction (``q = P̃·r``, ``q += (P̃ − s_P q)·r`` with FMAs) gives the IEEE quotient
``P̃ / s_P`` itself, so P̂ is the reference's integer. The INT8 buffer (tokens not compressed yet, one
universal scale) is the last tile of the last split (masked tail). ``Nq ≤ 16`` query tokens are causal
bottom-right (query ``i`` sees key ``j ≤ i + N − Nq``).

Flash-decoding: the key blocks are split over ``NUM_SPLITS`` programs per (batch, KV head); each writes
its ``(m, ℓ, acc)`` and ``_turbo_combine_kernel`` merges them with SAS weights,
``O = Σ_s SAS(m_s − M)·acc_s / Σ_s SAS(m_s − M)·ℓ_s`` (the reference's own rescaling, α = SAS(Δm)).
With one split the kernel writes ``acc / ℓ`` itself and follows the reference operation for operation:
the integer parts are exact, every rounding is the reference's (IEEE quotients, no FMA contraction),
and only the float sums (ℓ, the dots' int→float) differ in order. With several splits each split's
P̃ is taken against its own running max, as any split of the reference's sequential loop would.

Mixed precision: heads are grouped by ``(K bits, V bits)`` (one launch per group); a head's codes are
addressed from the group's first head's tensor by a byte offset (``CompressedKV.codes`` holds one
tensor per head).

Custom op ``quantpatch::turbo_decode_attention`` (with ``register_fake``), launched on the current stream.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from quantpatch.config import AttentionConfig

from .attn_qk_int8_pv_fp8_triton import SAS_THRESHOLD, _sas_exp
from .qk_quant_triton import _rne
from .turbo_compress_triton import KERNEL_BITS, bit_groups
from .turbo_ref import CompressedKV, Int8Buffer, decode_attention_config

HEAD_DIMS = (64, 128)
MAX_Q_LEN = 16
MAX_ROWS = 128  # G_PAD · NQ_PAD rows of one program
PROGRAMS_PER_SM = 16  # split the sequence until the grid has about this many programs per SM
MIN_BLOCKS_PER_SPLIT = 4  # ≥ 256 keys per split: the partial (m, ℓ, acc) written stays small next to the codes read
NUM_WARPS, NUM_STAGES = 2, 2  # launch of the decode kernel (the B=8, N=32k sweep on an H200: bench_decode NOTES.md)


# --------------------------------------------------------------------------- jit helpers


@triton.jit
def _codes(packed, p: tl.constexpr, BITS: tl.constexpr):
    """The codes at position ``p`` of each byte of ``packed``: channel ``(8 / BITS)·j + p`` for byte ``j``."""
    return (packed >> (BITS * p)) & (2**BITS - 1)


@triton.jit
def _channel_parts(ptr, HEAD_DIM: tl.constexpr, PB: tl.constexpr):
    """The ``(HEAD_DIM,)`` vector at ``ptr`` (one load) in ``PB`` parts: part ``p`` = channels ``PB·j + p``."""
    v = tl.load(ptr + tl.arange(0, HEAD_DIM))
    if PB == 2:
        parts = tl.split(tl.reshape(v, (HEAD_DIM // 2, 2)))
    else:
        even, odd = tl.split(tl.reshape(v, (HEAD_DIM // 4, 2, 2)))  # [j, a] = channel 4j + 2a (+ 1)
        p0, p2 = tl.split(even)
        p1, p3 = tl.split(odd)
        parts = (p0, p1, p2, p3)
    return parts


@triton.jit
def _dequant(x, z, s, BITS: tl.constexpr):
    """``(x + z^int)·s^int`` in fp16 (exact: integers ≤ 2048), clamped to ±127 for 2-bit blocks (4-bit ones
    cannot pass it)."""
    v = (x.to(tl.float16) + z.to(tl.float16)[None, :]) * s.to(tl.float16)[None, :]
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
             G_PAD: tl.constexpr, NQ_PAD: tl.constexpr, PMAX: tl.constexpr, MASK: tl.constexpr):
    """SAS online softmax of one key tile: ``(P̂ (fp16), s_P, α, ℓ, m)``; P̂'s scale is per query head."""
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
        head_max = tl.max(tl.reshape(row_max, (G_PAD, NQ_PAD)), 1)
        row_max = tl.reshape(tl.broadcast_to(head_max[:, None], (G_PAD, NQ_PAD)), (G_PAD * NQ_PAD,))
    p_scale = tl.math.div_rn(row_max, PMAX * 1.0)
    p_scale = tl.where(p_scale == 0.0, 1.0, p_scale)
    return _quantize_p(p, p_scale, PMAX), p_scale, alpha, l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def _accumulate(acc, r, alpha, p_scale, v_scale):
    """``α·acc + R·s_P·s_V`` for one channel part."""
    return acc * alpha[:, None] + r * p_scale[:, None] * v_scale


@triton.jit(do_not_specialize=["NQ", "T", "NB", "BLOCKS_PER_SPLIT", "NUM_SPLITS"])
def _turbo_decode_kernel(
    Q_ptr, stride_qb, stride_qh, stride_qm,
    KC_ptr, stride_kcb, stride_kcn, KS_ptr, KZ_ptr, KBS_ptr,
    VC_ptr, stride_vcb, stride_vcn, VS_ptr, VZ_ptr, VBS_ptr,
    KB_ptr, KBSC_ptr, VB_ptr, VBSC_ptr,
    META_ptr,
    O_ptr, stride_ob, stride_oh, stride_om,
    MP_ptr, LP_ptr, ACC_ptr,
    NQ, T, NB, HKV, HG, BLOCKS_PER_SPLIT, NUM_SPLITS, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr, NQ_PAD: tl.constexpr,
    BITS_K: tl.constexpr, BITS_V: tl.constexpr, CAUSAL: tl.constexpr, ROW_MASK: tl.constexpr,
    DIRECT: tl.constexpr, QMAX: tl.constexpr, PMAX: tl.constexpr,
):
    """Split ``program_id(0)`` of (batch, group slot) ``program_id(1)``; META = (kv head, K / V code byte offsets)."""
    BLOCK_M: tl.constexpr = G_PAD * NQ_PAD
    PK: tl.constexpr = 8 // BITS_K  # channel parts of K (code positions in a byte)
    PV: tl.constexpr = 8 // BITS_V
    MASK: tl.constexpr = CAUSAL or ROW_MASK
    pid_s = tl.program_id(0)
    pid = tl.program_id(1)
    b = pid // HG
    slot = pid % HG
    h = tl.load(META_ptr + slot).to(tl.int32)
    k_off = tl.multiple_of(tl.load(META_ptr + HG + slot), 16)
    v_off = tl.multiple_of(tl.load(META_ptr + 2 * HG + slot), 16)
    bh = b * HKV + h

    # Q: per-token INT8 (absmax / QMAX), rows r = g·NQ_PAD + i of query head h·GROUP + g, in K's channel parts
    offs_m = tl.arange(0, BLOCK_M)
    g = offs_m // NQ_PAD
    qi = offs_m % NQ_PAD
    row_ok = (g < GROUP) & (qi < NQ)
    offs_jk = tl.arange(0, HEAD_DIM // PK)
    offs_jv = tl.arange(0, HEAD_DIM // PV)
    q_rows = Q_ptr + b.to(tl.int64) * stride_qb + (h * GROUP + g)[:, None] * stride_qh + qi[:, None] * stride_qm
    q = ()
    q_abs = tl.zeros([BLOCK_M], dtype=tl.float32)
    for p in tl.static_range(PK):
        q_p = tl.load(q_rows + (offs_jk * PK + p)[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        q = q + (q_p,)
        q_abs = tl.maximum(q_abs, tl.max(tl.abs(q_p), 1))
    qs = tl.math.div_rn(q_abs, QMAX * 1.0)
    qs = tl.where(qs == 0.0, 1.0, qs)
    q_hat = ()
    for p in tl.static_range(PK):
        q_p = tl.minimum(tl.maximum(_rne(tl.math.div_rn(q[p], qs[:, None])), -QMAX * 1.0), QMAX * 1.0)
        q_hat = q_hat + (q_p.to(tl.float16),)

    nk = T * BLOCK_N + NB
    diag = qi + nk - NQ  # query i sees keys j <= i + N − Nq
    offs_n = tl.arange(0, BLOCK_N)
    kc_base = KC_ptr + k_off + b.to(tl.int64) * stride_kcb
    vc_base = VC_ptr + v_off + b.to(tl.int64) * stride_vcb
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = ()
    for p in tl.static_range(PV):
        acc = acc + (tl.zeros([BLOCK_M, HEAD_DIM // PV], dtype=tl.float32),)
    lo = pid_s * BLOCKS_PER_SPLIT
    hi = tl.minimum(lo + BLOCKS_PER_SPLIT, T)
    for t in range(lo, hi):
        rows = t * BLOCK_N + offs_n
        sz = (bh * T + t).to(tl.int64) * HEAD_DIM
        pk = tl.load(kc_base + rows[:, None] * stride_kcn + offs_jk[None, :])
        pv = tl.load(vc_base + rows[:, None] * stride_vcn + offs_jv[None, :])
        ks = _channel_parts(KS_ptr + sz, HEAD_DIM, PK)
        kz = _channel_parts(KZ_ptr + sz, HEAD_DIM, PK)
        s_int = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for p in tl.static_range(PK):
            x = _codes(pk, p, BITS_K)
            if BITS_K == 4:  # Q̂·K̂ᵀ = (Q̂ ⊙ s^int)·(X^{q2} + z^int)ᵀ: s^int goes to Q's side, no clamp on 4-bit blocks
                k = x.to(tl.float16) + kz[p].to(tl.float16)[None, :]
                s_int = tl.dot(q_hat[p] * ks[p].to(tl.float16)[None, :], tl.trans(k), s_int)
            else:
                s_int = tl.dot(q_hat[p], tl.trans(_dequant(x, kz[p], ks[p], BITS_K)), s_int)
        keep = row_ok[:, None]
        if CAUSAL:
            keep = keep & (rows[None, :] <= diag[:, None])
        p_hat, p_scale, alpha, l_i, m_i = _softmax(
            s_int, qs * tl.load(KBS_ptr + bh * T + t), keep, m_i, l_i, sm_scale,
            G_PAD, NQ_PAD, PMAX, MASK,
        )
        v_scale = tl.load(VBS_ptr + bh * T + t)
        p_sum = tl.sum(p_hat.to(tl.float32), 1)
        vs = _channel_parts(VS_ptr + sz, HEAD_DIM, PV)
        vz = _channel_parts(VZ_ptr + sz, HEAD_DIM, PV)
        new = ()
        for p in tl.static_range(PV):
            x = _codes(pv, p, BITS_V)
            if BITS_V == 4:  # P̂·V̂ = (P̂·X^{q2} + z^int · rowsum P̂) ⊙ s^int (no clamp acts on 4-bit blocks)
                r = tl.math.fma(vz[p].to(tl.float32)[None, :], p_sum[:, None], tl.dot(p_hat, x.to(tl.float16)))
                r = r * vs[p].to(tl.float32)[None, :]
            else:
                r = tl.dot(p_hat, _dequant(x, vz[p], vs[p], BITS_V))
            new = new + (_accumulate(acc[p], r, alpha, p_scale, v_scale),)
        acc = new
    if (pid_s == NUM_SPLITS - 1) & (NB > 0):  # the INT8 buffer: the newest keys, universal scale per head
        buf = bh.to(tl.int64) * NB * HEAD_DIM + offs_n[:, None] * HEAD_DIM
        in_buf = offs_n[:, None] < NB
        s_int = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for p in tl.static_range(PK):
            kb = tl.load(KB_ptr + buf + (offs_jk * PK + p)[None, :], mask=in_buf, other=0)
            s_int = tl.dot(q_hat[p], tl.trans(kb.to(tl.float16)), s_int)
        keep = row_ok[:, None] & (offs_n[None, :] < NB)
        if CAUSAL:
            keep = keep & ((T * BLOCK_N + offs_n)[None, :] <= diag[:, None])
        p_hat, p_scale, alpha, l_i, m_i = _softmax(
            s_int, qs * tl.load(KBSC_ptr + bh), keep, m_i, l_i, sm_scale, G_PAD, NQ_PAD, PMAX, True,
        )
        v_scale = tl.load(VBSC_ptr + bh)
        new = ()
        for p in tl.static_range(PV):
            vb = tl.load(VB_ptr + buf + (offs_jv * PV + p)[None, :], mask=in_buf, other=0)
            new = new + (_accumulate(acc[p], tl.dot(p_hat, vb.to(tl.float16)), alpha, p_scale, v_scale),)
        acc = new
    part = ((b * HKV * GROUP + h * GROUP + g) * NQ + qi).to(tl.int64) * NUM_SPLITS + pid_s  # (B, H, Nq, S)
    if not DIRECT:
        tl.store(MP_ptr + part, m_i, mask=row_ok)
        tl.store(LP_ptr + part, l_i, mask=row_ok)
    empty = l_i == 0.0
    o_rows = O_ptr + b.to(tl.int64) * stride_ob + (h * GROUP + g)[:, None] * stride_oh + qi[:, None] * stride_om
    for p in tl.static_range(PV):
        cols = (offs_jv * PV + p)[None, :]
        if DIRECT:
            out = tl.where(empty[:, None], 0.0, acc[p] / tl.where(empty, 1.0, l_i)[:, None])
            tl.store(o_rows + cols, out.to(O_ptr.dtype.element_ty), mask=row_ok[:, None])
        else:
            tl.store(ACC_ptr + part[:, None] * HEAD_DIM + cols, acc[p], mask=row_ok[:, None])


@triton.jit
def _turbo_combine_kernel(
    MP_ptr, LP_ptr, ACC_ptr, O_ptr, stride_ob, stride_oh, stride_om, H, NQ, NUM_SPLITS,
    HEAD_DIM: tl.constexpr, S_PAD: tl.constexpr,
):
    """Row ``program_id(0)`` of ``(B, H, Nq)``: ``O = Σ w_s acc_s / Σ w_s ℓ_s``, ``w_s = SAS(m_s − max m)``."""
    pid = tl.program_id(0)
    qi = pid % NQ
    bh = pid // NQ
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = offs_s < NUM_SPLITS
    part = pid.to(tl.int64) * NUM_SPLITS + offs_s
    m = tl.load(MP_ptr + part, mask=ok, other=float("-inf"))
    ell = tl.load(LP_ptr + part, mask=ok, other=0.0)
    acc = tl.load(ACC_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=ok[:, None], other=0.0)
    m_max = tl.max(m, 0)
    w = _sas_exp(m - tl.where(m_max == float("-inf"), 0.0, m_max))
    ell = tl.sum(w * ell, 0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(ell == 0.0, 1.0, ell)
    out = tl.where(ell == 0.0, 0.0, out)
    o_ptrs = O_ptr + (bh // H).to(tl.int64) * stride_ob + (bh % H) * stride_oh + qi * stride_om + offs_d
    tl.store(o_ptrs, out.to(O_ptr.dtype.element_ty))


# --------------------------------------------------------------------------- launcher


def _next_pow2(x: int) -> int:
    return 1 << max(x - 1, 0).bit_length()


def _row_tile(group: int, nq: int) -> tuple[int, int]:
    """``(G_PAD, NQ_PAD)``: powers of two, ``G_PAD·NQ_PAD ≥ 16`` (the smallest ``tl.dot`` M)."""
    nq_pad = _next_pow2(nq)
    return max(_next_pow2(group), 16 // min(nq_pad, 16)), nq_pad


@functools.lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=256)
def _meta_tensor(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def default_num_splits(batch: int, kv_heads: int, n_blocks: int, device: torch.device) -> int:
    """Splits of the key blocks: about ``PROGRAMS_PER_SM`` programs per SM, ≥ ``MIN_BLOCKS_PER_SPLIT`` blocks each."""
    sms = _sm_count(device) if device.type == "cuda" else 1
    want = math.ceil(PROGRAMS_PER_SM * sms / max(batch * kv_heads, 1))
    return max(1, min(want, n_blocks // MIN_BLOCKS_PER_SPLIT))


def decode_unsupported(
    q: torch.Tensor,
    k_cache: CompressedKV,
    v_cache: CompressedKV,
    k_buffer: Int8Buffer | None,
    v_buffer: Int8Buffer | None,
    cfg: AttentionConfig | None = None,
) -> str | None:
    """Why the decode kernel cannot take this call (None if it can)."""
    ref = decode_attention_config()
    cfg = ref if cfg is None else cfg
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
    same = cfg.replace(block_q=ref.block_q, qk_qmax=ref.qk_qmax,
                       pv_qmax=ref.pv_qmax, v_granularity=ref.v_granularity, two_level_accum=ref.two_level_accum,
                       warps=ref.warps)
    if same != ref or cfg.block_q < nq or cfg.sas_threshold != SAS_THRESHOLD or max(cfg.pv_qmax, cfg.qk_qmax) > 127:
        return "attention numerics other than turbo decode (Q per token, SAS, P INT8 per tile, no smoothing)"
    if k_cache.n_blocks == 0 and (k_buffer is None or k_buffer.n_tokens == 0):
        return "empty cache"
    for cache in (k_cache, v_cache):
        for c in cache.codes:
            if c.stride(-1) != 1 or c.stride(-2) != c.shape[-1] or c.data_ptr() % 16:
                return "code tensors are not row-contiguous and 16-byte aligned"
    return None


def _group_meta(heads: list[int], k_codes, v_codes, device) -> torch.Tensor:
    """int64 ``(3, H_g)``: KV head, byte offset of its K codes from the group's first, same for V."""
    k0, v0 = k_codes[heads[0]].data_ptr(), v_codes[heads[0]].data_ptr()
    values = (*heads, *(k_codes[h].data_ptr() - k0 for h in heads), *(v_codes[h].data_ptr() - v0 for h in heads))
    return _meta_tensor(values, device)


@torch.library.custom_op("quantpatch::turbo_decode_attention", mutates_args=())
def turbo_decode_attention_op(
    q: torch.Tensor, k_codes: list[torch.Tensor], k_sint: torch.Tensor, k_zint: torch.Tensor, k_bscale: torch.Tensor,
    v_codes: list[torch.Tensor], v_sint: torch.Tensor, v_zint: torch.Tensor, v_bscale: torch.Tensor,
    k_buf: torch.Tensor, k_buf_scale: torch.Tensor, v_buf: torch.Tensor, v_buf_scale: torch.Tensor,
    k_bits: list[int], v_bits: list[int], is_causal: bool, sm_scale: float, num_splits: int, out_dtype: torch.dtype,
    qk_qmax: int, pv_qmax: int, num_warps: int, num_stages: int,
) -> torch.Tensor:
    """Custom-op form of :func:`turbo_decode_attention` over the tensors of the ``CompressedKV`` and ``Int8Buffer``."""
    b, h, nq, d = q.shape
    hkv, t = k_sint.shape[1], k_sint.shape[2]
    group = h // hkv
    nb = k_buf.shape[-2]
    g_pad, nq_pad = _row_tile(group, nq)
    splits = max(1, min(num_splits, t))
    per_split = math.ceil(t / splits) if t else 0
    splits = math.ceil(t / per_split) if t else 1
    out = torch.empty((b, h, nq, d), dtype=out_dtype, device=q.device)
    direct = splits == 1
    parts = (b, h, nq, splits) if not direct else (0,)
    m_part = torch.empty(parts, dtype=torch.float32, device=q.device)
    l_part = torch.empty_like(m_part)
    acc_part = torch.empty((*parts, d) if not direct else (0,), dtype=torch.float32, device=q.device)
    # Tensors never read (no buffer, no blocks) still need a valid address for the launcher.
    k_buf, v_buf = (k_buf, v_buf) if nb else (k_sint, v_sint)
    for (kw, vw), heads in bit_groups(k_bits, v_bits):
        kc, vc = k_codes[heads[0]], v_codes[heads[0]]
        meta = _group_meta(heads, k_codes, v_codes, q.device)
        kc, vc = (kc, vc) if t else (k_sint, v_sint)
        _turbo_decode_kernel[(splits, b * len(heads))](
            q, q.stride(0), q.stride(1), q.stride(2),
            kc, kc.stride(0), kc.stride(-2), k_sint, k_zint, k_bscale,
            vc, vc.stride(0), vc.stride(-2), v_sint, v_zint, v_bscale,
            k_buf, k_buf_scale, v_buf, v_buf_scale,
            meta,
            out, out.stride(0), out.stride(1), out.stride(2),
            m_part, l_part, acc_part,
            nq, t, nb, hkv, len(heads), per_split, splits, sm_scale,
            HEAD_DIM=d, BLOCK_N=64, GROUP=group, G_PAD=g_pad, NQ_PAD=nq_pad, BITS_K=kw, BITS_V=vw,
            CAUSAL=is_causal and nq > 1, ROW_MASK=nq < nq_pad, DIRECT=direct, QMAX=qk_qmax, PMAX=pv_qmax,
            num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=False,
        )
    if not direct:
        _turbo_combine_kernel[(b * h * nq,)](
            m_part, l_part, acc_part, out, out.stride(0), out.stride(1), out.stride(2), h, nq, splits,
            HEAD_DIM=d, S_PAD=_next_pow2(splits), num_warps=4, enable_fp_fusion=False,
        )
    return out


@turbo_decode_attention_op.register_fake
def _(q, k_codes, k_sint, k_zint, k_bscale, v_codes, v_sint, v_zint, v_bscale, k_buf, k_buf_scale, v_buf,
      v_buf_scale, k_bits, v_bits, is_causal, sm_scale, num_splits, out_dtype, qk_qmax, pv_qmax, num_warps,
      num_stages):
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
) -> torch.Tensor:
    """Decode attention of ``q`` over a compressed cache: the kernel form of ``turbo_decode_attention_ref``.

    Args:
        q: ``(B, H, Nq, D)``, ``Nq ≤ 16``, the newest tokens (already in the cache), any float dtype;
            ``D`` in :data:`HEAD_DIMS`, ``H`` a multiple of ``Hkv``.
        k_cache / v_cache: ``CompressedKV`` ``(B, Hkv, T blocks of 64)``, 2- or 4-bit per head.
        k_buffer / v_buffer: ``Int8Buffer`` ``(B, Hkv, Nb < 64, D)`` or None.
        cfg: the decode numerics (default ``decode_attention_config()``); see :func:`decode_unsupported`.
        is_causal: bottom-right causal among the ``Nq`` query tokens.
        num_splits: splits of the key blocks (default :func:`default_num_splits`); 1 = no combine step.
        out_dtype: default ``q.dtype``.
        num_warps / num_stages: launch of the decode kernel (benchmarks sweep them).

    Returns:
        ``o (B, H, Nq, D)`` in ``out_dtype``.
    """
    reason = decode_unsupported(q, k_cache, v_cache, k_buffer, v_buffer, cfg)
    if reason is not None:
        raise ValueError(f"turbo decode kernel: {reason}")
    cfg = decode_attention_config() if cfg is None else cfg
    b, h, nq, d = q.shape
    hkv = k_cache.kv_heads
    if k_buffer is None:
        empty = torch.zeros((b, hkv, 0, d), dtype=torch.int8, device=q.device)
        k_buffer = v_buffer = Int8Buffer(empty, torch.ones((b, hkv, 1, 1), device=q.device))
    if num_splits is None:
        num_splits = default_num_splits(b, hkv, k_cache.n_blocks, q.device)
    sm_scale = 1.0 / math.sqrt(d) if scale is None else float(scale)

    def contiguous(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return x.to(dtype).contiguous()

    return turbo_decode_attention_op(
        q, list(k_cache.codes), contiguous(k_cache.int_scale, torch.int8), contiguous(k_cache.int_zero, torch.int8),
        contiguous(k_cache.block_scale, torch.float32),
        list(v_cache.codes), contiguous(v_cache.int_scale, torch.int8), contiguous(v_cache.int_zero, torch.int8),
        contiguous(v_cache.block_scale, torch.float32),
        contiguous(k_buffer.values, torch.int8), contiguous(k_buffer.scale, torch.float32),
        contiguous(v_buffer.values, torch.int8), contiguous(v_buffer.scale, torch.float32),
        list(k_cache.bits), list(v_cache.bits), is_causal, sm_scale, num_splits, out_dtype or q.dtype,
        cfg.qk_qmax, cfg.pv_qmax, num_warps, num_stages,
    )


__all__ = ["decode_unsupported", "default_num_splits", "turbo_decode_attention"]
