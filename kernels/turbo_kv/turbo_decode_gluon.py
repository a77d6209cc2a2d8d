"""TurboAttention decode over a 4-bit compressed cache in Gluon (Triton 3.6+, sm_90): the codes enter the
tensor-core dots straight from the registers their loads filled.

Same numerics as :mod:`quantpatch.kernels.turbo_kv.turbo_decode_triton` (Algorithm 2 with FlashQ and SAS: Q̂ per token,
``K̂ = (X + z^int)·s^int``, SAS online softmax per 64-key block, P̂ INT8 per block and query head, every dot an
exact integer sum on fp16 operands with fp32 accumulation), for the shape that decoding takes: one query token,
``G ≤ 8`` query heads per KV head, ``D = 128``, K and V both 4-bit. With one split (``EXACT``) every rounding is
the reference's (IEEE quotients, no FMA contraction); with several, where each split draws its own P̂ anyway,
FMA contraction and one multiply per score are allowed. Each program is one warp: one (batch, KV head) and a
run of key blocks (a split); the splits are merged by the last one to finish, in split order (deterministic).

Why a warp of its own: the Triton kernel spends its time moving every code through shared memory to reach the
``mma`` operand layout (``ldmatrix``) and waiting on the barriers around it. Here the layouts are explicit: swap
AB (keys and channels are the ``mma`` M dimension, the query rows its N = 8), and the bytes a thread reads are
exactly the slots of its ``m16n8k16`` fragments after a relabelling of the reduction index, so a code goes
shared memory → register → bit trick → ``mma``::

    copies  cp.async brings a block's V codes with the next block's K codes (and their s^int / z^int rows) to
            shared memory, STAGES − 1 such groups ahead; each block is then read in parts of 16 keys (one mma M
            tile).
    overlap the scores of block t + 1 are computed in block t's iteration: their dots do not wait for block
            t's softmax, so the scheduler interleaves the two (one basic block: no division's slow path in the
            loop when several splits run).
    K side  Sᵀ·2⁻²⁴ [16 keys, 8] = X·2⁻²⁴ [16, 128] · (Q̂ ⊙ s^int)ᵀ, the accumulator starting at
            (Q̂ · (z^int ⊙ s^int))·2⁻²⁴ (one dot a block): a thread reads 16 contiguous bytes (32 channels) of its
            two keys; the masked nibbles are fp16 subnormals (code·2⁻²⁴, 16·code·2⁻²⁴ for odd channels, whose
            Q̂ ⊙ s^int is divided by 16), even and odd channels two dots of K = 64; the byte index is relabelled
            as the fragment's K slot (:func:`_k_slots`) and Q̂'s rows in the same order. ``Q̂ ⊙ s^int ≤ 119·16``
            and ``z^int ⊙ s^int`` are exact in fp16, every sum an integer < 2²⁴ times 2⁻²⁴: exact.
    pairing for G ≤ 4 one score tile holds two parts (columns 0-3 and 4-7), so no lane runs the softmax on
            padding columns; a row's maxima and sums combine its two columns.
    softmax the keys of a part are the M rows of one warp: the block's row max, P̂ scale and sums are in-register
            reductions plus three shuffles.
    V side  Oᵀ [128 channels, 8] += (X·2⁻²⁴)ᵀ [128, 16 keys] · P̂ᵀ a part: a thread reads 8 contiguous bytes
            (16 channels) of 4 keys (τ = 4j + q: a warp's read is 4 whole rows); prmt pairs the same byte of
            keys τ and τ + 4 (the fragment's K pair), the masked nibbles are the fp16 pair, so the dot is
            ``Σ X·P̂`` times a power of two, exactly, and the block's integer ``P̂·V̂ = s^int ⊙ (Σ X·P̂ +
            z^int·ΣP̂)`` comes out exactly in fp32. P̂ reaches the B fragment through one layout conversion a
            tile.

The INT8 buffer (the newest ``< 64`` keys, one universal scale) is the last block of the last split, loaded
through ordinary layouts. Host side: :func:`launch` (called by ``turbo_decode_triton._decode`` for the code
groups it takes: ``turbo_decode_triton.gluon_takes``, :func:`group_unsupported`).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from ..attention.quant_attn_triton import LOG2E, SAS_THRESHOLD
from ..attention.sas_ref import POLY_COEFFS
from ..compiled_launch import LaunchPlans, cdiv, next_pow2
from ..gluon_compat import async_load, cta_barrier
from .turbo_decode_splits import split_count

HEAD_DIM = 128
BITS = 4
MAX_GROUP = 8  # query heads per KV head: mma's N
BLOCK = gl.constexpr(64)  # keys per compressed block (n_b)
HALF = gl.constexpr(64)  # bytes of a 4-bit code row = channel pairs
ROWS = gl.constexpr(MAX_GROUP)
PART = gl.constexpr(16)  # keys read, unpacked and multiplied at a time: one mma M tile
PARTS = gl.constexpr(BLOCK.value // PART.value)
PROGRAMS_PER_SM = 8  # one warp each at ≤ 255 registers: 8 fit an SM
STAGES = 2  # copy groups in shared memory: the one computed and STAGES − 1 on their way
MAX_SPLITS = 64  # the merge reads every split's partial in one program
SPLITS_PAD = MAX_SPLITS  # the merge's row count whatever the split count: a longer context compiles no new variant
MERGE_ROWS = gl.constexpr(32)  # (split, row) partials merged at a time: 128 fp32 a lane

_N_R, _NEG_LOG2E = gl.constexpr(SAS_THRESHOLD), gl.constexpr(-LOG2E)
_C3, _C2, _C1, _C0 = (gl.constexpr(c) for c in POLY_COEFFS)

# 4 packed bytes b0..b3 ($4) → the low nibbles as fp16 subnormals code·2⁻²⁴ ($0: b0, b2; $1: b1, b3) and the high
# ones as 16·code·2⁻²⁴ ($2: b0, b2; $3: b1, b3): the masked bits themselves, one shift for the odd bytes (as
# mul.hi by 2²⁴: the FMA pipe's IMAD, not the ALU, which the masks keep busy).
_K_ASM = gl.constexpr("""{
.reg .b32 t;
mul.hi.u32 t, $4, 16777216;
and.b32 $0, $4, 0x000F000F;
and.b32 $1, t, 0x000F000F;
and.b32 $2, $4, 0x00F000F0;
and.b32 $3, t, 0x00F000F0;
}""")

# 4 signed bytes b0..b3 ($2) → fp16 ($0: b0, b2; $1: b1, b3): offset binary (xor 0x80) under fp16 1024 (ulp 1) is
# 1152 + b, then one sub.f16x2 a pair. All exact.
_S8_ASM = gl.constexpr("""{
.reg .b32 x, h, u, v, c;
xor.b32 x, $2, 0x80808080;
mul.hi.u32 h, x, 16777216;
lop3.b32 u, x, 0x00FF00FF, 0x64006400, 0xEA;
lop3.b32 v, h, 0x00FF00FF, 0x64006400, 0xEA;
mov.b32 c, 0x64806480;
sub.f16x2 $0, u, c;
sub.f16x2 $1, v, c;
}""")

# Bytes β0..β3 of key τ ($8) and of key τ + 4 ($9) → per β one fp16 pair (key τ, key τ + 4): the low nibbles as the
# fp16 subnormals code·2⁻²⁴ ($0..$3), the high ones as 16·code·2⁻²⁴ ($4..$7): the masked bits themselves. prmt puts
# byte β of each key at bytes 0 and 2 (the Triton kernel's subnormal codes: one lop3 a pair, no or).
_V_ASM = gl.constexpr("""{
.reg .b32 x0, x1, x2, x3;
prmt.b32 x0, $8, $9, 0x4400;
prmt.b32 x1, $8, $9, 0x5511;
prmt.b32 x2, $8, $9, 0x6622;
prmt.b32 x3, $8, $9, 0x7733;
and.b32 $0, x0, 0x000F000F;
and.b32 $1, x1, 0x000F000F;
and.b32 $2, x2, 0x000F000F;
and.b32 $3, x3, 0x000F000F;
and.b32 $4, x0, 0x00F000F0;
and.b32 $5, x1, 0x00F000F0;
and.b32 $6, x2, 0x00F000F0;
and.b32 $7, x3, 0x00F000F0;
}""")


# --------------------------------------------------------------------------- helpers


@gluon.jit
def _rne(x):
    """Round half to even for |x| < 2²²."""
    return (x + 12582912.0) - 12582912.0


@gluon.jit
def _sas_exp(x):
    """TurboAttention's SAS ``exp(x)``, ``x ≤ 0``, as the Triton kernels compute it (0 below n_r and for −∞)."""
    keep = x >= _N_R
    t = gl.where(keep, -x, 0.0)
    i = gl.floor(t)
    f = t - i
    poly = ((_C3 * f + _C2) * f + _C1) * f + _C0
    return gl.where(keep, gl.exp2(i * _NEG_LOG2E) * poly, 0.0)


@gluon.jit
def _k_slots(t):
    """Relabel axis 0 of ``t [64, N]``, a byte index ``β = 16q + 4s + 2b + h``, as the fragment K slot
    ``k = 16s + 8h + 2q + b`` (no data moves): lane ``q`` of a quad holds bytes ``16q … 16q + 15``, and a register
    the pair of bytes ``β, β + 2`` (:data:`_K_ASM`, :data:`_S8_ASM`), the fragment's K pair."""
    n: gl.constexpr = t.shape[1]
    t = gl.permute(gl.reshape(t, [4, 4, 2, 2, n]), (1, 3, 0, 2, 4))
    return gl.reshape(t, [HALF, n])


@gluon.jit
def _key_slots(t):
    """Relabel axis 0 of ``t [n, N]``, a key ``τ = 16s + 8h + 4b + q`` (lane ``q`` holds keys ``τ ≡ q mod 4``),
    as the fragment K slot ``k = 16s + 8h + 2q + b``."""
    n: gl.constexpr = t.shape[0]
    c: gl.constexpr = t.shape[1]
    t = gl.permute(gl.reshape(t, [n // 16, 2, 2, 4, c]), (0, 1, 3, 2, 4))
    return gl.reshape(t, [n, c])


@gluon.jit
def _channel_rows(t):
    """Relabel axis 0 of ``t [64, N]``, a byte index ``β = 8g + 4i₁ + 2i₀ + a`` (lane group ``g`` holds bytes
    ``8g … 8g + 7``), as the fragment M row ``m = 32i₁ + 16i₀ + 8a + g``."""
    n: gl.constexpr = t.shape[1]
    t = gl.permute(gl.reshape(t, [8, 2, 2, 2, n]), (1, 2, 3, 0, 4))
    return gl.reshape(t, [HALF, n])


@gluon.jit
def _row_channel(m):
    """The byte index ``β`` of fragment M row ``m`` (inverse of :func:`_channel_rows`)."""
    return 8 * (m & 7) + 4 * (m >> 5) + 2 * ((m >> 4) & 1) + ((m >> 3) & 1)


@gluon.jit
def _k_operand(x, op_a: gl.constexpr):
    """``x [keys, 64 bytes]`` (one parity of the channels) as the A operand ``[keys, 64 K slots]``."""
    return gl.convert_layout(gl.permute(_k_slots(gl.permute(x, (1, 0))), (1, 0)), op_a)


@gluon.jit
def _v_operand(x, op_a: gl.constexpr):
    """``x [keys, 64 bytes β]`` (one parity of the channels) as the A operand ``[64 channel rows, keys' K slots]``
    (keys ``τ = 4j + q``: :func:`_key_slots`, bytes: :func:`_channel_rows`)."""
    x = _channel_rows(gl.permute(x, (1, 0)))
    return gl.convert_layout(gl.permute(_key_slots(gl.permute(x, (1, 0))), (1, 0)), op_a)


@gluon.jit
def _unpacked_labels(x):
    """The true labels of :data:`_V_ASM`'s outputs ``[keys, 64 bytes]``: they come labelled as its inputs (element
    ``e`` of a pack = key bit 2 ``e₂``, byte bits ``e₀ e₁``) but hold (key bit 2 = ``e₀``, byte bits ``e₁ e₂``);
    a permutation of three size-2 axes (no data moves)."""
    n: gl.constexpr = x.shape[0]
    x = gl.reshape(x, [n // 8, 2, 4, 16, 2, 2])  # keys: [high, bit 2, bits 0-1]; bytes: [high, bit 1, bit 0]
    return gl.reshape(gl.permute(x, (0, 5, 2, 3, 1, 4)), [n, HALF])


@gluon.jit
def _byte_pairs(smem, row: gl.constexpr, layout: gl.constexpr, dtype: gl.constexpr):
    """Row ``row`` (``[128]`` int8, ``s^int`` or ``z^int``) of a block's ``[4, 128]`` in shared memory as (even,
    odd) channels ``[64]`` in ``dtype``, each lane holding the bytes ``layout`` gives it (fp16: by
    :data:`_S8_ASM`, two bytes at a time)."""
    x = smem.slice(row, 1).load(layout)
    if dtype == gl.float16:
        x = gl.inline_asm_elementwise(_S8_ASM, "=r,=r,r", [x], dtype=gl.float16, is_pure=True, pack=4)
        x = _nibble_labels(x)
    else:
        x = x.to(dtype)
    return gl.split(gl.reshape(x, [HALF, 2]))


@gluon.jit
def _pair(x, PAIR: gl.constexpr, MAX: gl.constexpr):
    """Per-column values ``[8]`` combined over the column pairs ``(c, c ^ 4)`` (max or sum) when ``PAIR``."""
    if PAIR:
        y = gl.reshape(x, [2, ROWS // 2])
        y = gl.max(y, 0) if MAX else gl.sum(y, 0)
        x = gl.convert_layout(gl.reshape(gl.permute(gl.join(y, y), (1, 0)), [ROWS]), x.type.layout)
    return x


@gluon.jit
def _fold_pairs(acc):
    """``acc [64, 8]`` with columns ``c`` and ``c + 4`` summed into column ``c`` (and ``c + 4``)."""
    n: gl.constexpr = acc.shape[0]
    y = gl.sum(gl.reshape(acc, [n, 2, ROWS // 2]), 1)
    return gl.convert_layout(gl.reshape(gl.permute(gl.join(y, y), (0, 2, 1)), [n, ROWS]), acc.type.layout)


@gluon.jit
def _softmax(s, m_i, l_i, PAIR: gl.constexpr):
    """SAS online softmax of one block's scores (a tuple of tiles ``[16 keys, 8 columns]``): ``(P̃ tiles, α, m',
    ℓ')``; ``PAIR``: columns ``c`` and ``c ^ 4`` are one query row (:func:`_pair`)."""
    m_blk = s[0]  # the tiles combined element-wise first: one cross-lane reduction a block
    for i in gl.static_range(1, len(s)):
        m_blk = gl.maximum(m_blk, s[i])
    m_new = gl.maximum(m_i, _pair(gl.max(m_blk, 0), PAIR, True))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet: SAS(−∞) = 0, not NaN
    alpha = _sas_exp(m_i - m_safe)
    p = (_sas_exp(s[0] - m_safe[None, :]),)
    total = p[0]
    for i in gl.static_range(1, len(s)):
        p = p + (_sas_exp(s[i] - m_safe[None, :]),)
        total += p[i]
    return p, alpha, m_new, l_i * alpha + _pair(gl.sum(total, 0), PAIR, False)


@gluon.jit
def _quantize_p(p, PMAX: gl.constexpr, EXACT: gl.constexpr, PAIR: gl.constexpr):
    """``(P̂ parts, s_P)``: ``s_P = max(P̃ over the block) / PMAX`` per row (1 if 0), ``P̂ = min(rne(P̃ / s_P),
    PMAX)`` with one reciprocal per row. ``EXACT``: IEEE quotients (s_P's, the reciprocal's, and Markstein's
    correction for P̃ / s_P); else s_P = max·RN(1/PMAX) and the fast reciprocal (no division's slow-path branch
    in the loop, whose basic block the next block's score dots share)."""
    p_max = p[0]
    for i in gl.static_range(1, len(p)):
        p_max = gl.maximum(p_max, p[i])
    p_max = _pair(gl.max(p_max, 0), PAIR, True)
    if EXACT:
        p_scale = gl.div_rn(p_max, PMAX * 1.0)
        p_scale = gl.where(p_scale == 0.0, 1.0, p_scale)
        r = gl.div_rn(gl.full_like(p_scale, 1.0), p_scale)[None, :]
    else:
        p_scale = gl.where(p_max == 0.0, 1.0, p_max * (1.0 / PMAX))
        r = (1.0 / p_scale)[None, :]  # div.full.f32
    out = ()
    for i in gl.static_range(len(p)):
        q = p[i] * r
        if EXACT:
            q = gl.fma(gl.fma(-p_scale[None, :], q, p[i]), r, q)
        out = out + (gl.minimum(_rne(q), PMAX * 1.0),)
    return out, p_scale


# --------------------------------------------------------------------------- kernel


# the arguments that change as a generation grows (blocks, buffered tokens, the split of them): not specialized, so
# no decode step compiles a variant of the kernel (Triton specializes an int on == 1 and % 16 == 0)
GROWING_ARGS = ["T", "NB", "BLOCKS_PER_SPLIT", "NUM_SPLITS"]


@gluon.jit(do_not_specialize=GROWING_ARGS)
def _turbo_decode_gluon(
    Q_ptr, stride_qb, stride_qh,
    KC_ptr, stride_kcb, KS_ptr, KZ_ptr, KBS_ptr,
    VC_ptr, stride_vcb, VS_ptr, VZ_ptr, VBS_ptr,
    KB_ptr, KBSC_ptr, VB_ptr, VBSC_ptr, META_ptr,
    O_ptr, stride_ob, stride_oh,
    MP_ptr, LP_ptr, ACC_ptr, CNT_ptr,
    T, NB, HKV, HG, BLOCKS_PER_SPLIT, NUM_SPLITS, sm_scale, H0, K_STEP, V_STEP,
    GROUP: gl.constexpr, G_PAD: gl.constexpr, QMAX: gl.constexpr, PMAX: gl.constexpr, SPLITS_PAD: gl.constexpr,
    STAGES: gl.constexpr, EXACT: gl.constexpr, REGULAR: gl.constexpr,
):
    """Split ``program_id(0)`` of (batch, group slot) ``program_id(1)``; ``META`` = (KV head, offsets of its K / V
    codes from the group's first head's, in int32 words), or (``REGULAR``) head ``H0 + slot`` at ``slot·K_STEP`` /
    ``slot·V_STEP`` words. Codes ``uint8 (B, T·64, 64)`` per head, ``s^int`` /
    ``z^int`` ``int8 (B, Hkv, T, 128)``, block scales ``(B, Hkv, T)``, buffer ``int8 (B, Hkv, NB, 128)``.
    Partials (several splits): ``m``, ``ℓ`` ``(B·H, NUM_SPLITS)``, acc ``(B·H, NUM_SPLITS, 128)``.

    A block's codes and ``s^int`` / ``z^int`` reach shared memory by ``cp.async`` ``STAGES − 1`` copy groups
    ahead; each block is then read into registers in parts of 16 keys (one mma M tile). ``EXACT`` (one split):
    every rounding is the reference's; else (each split draws its own P̂ anyway) a score takes one multiply by
    ``s_Q·s_K·scale``, s_P = max·RN(1/PMAX), P̂ = rne(P̃·(1/s_P)) (fast reciprocal) and R = (P̂·V̂)·(s_P·s_V)."""
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    op_a: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_l, k_width=2)
    op_b: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma_l, k_width=2)
    row_l: gl.constexpr = gl.SliceLayout(0, mma_l)  # per query row [8]
    # K codes [16 keys, 64 bytes]: lane (g, q) holds bytes 16q … 16q + 15 of keys g, g + 8 (16-byte reads)
    k_l: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [8, 0]],
        lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]], warp_bases=[], block_bases=[], shape=[PART, HALF])
    # V codes [16 keys, 64 bytes]: lane (g, q) holds bytes 8g … 8g + 7 of keys 4j + q (8-byte reads) ...
    v_l: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [4, 0], [8, 0]],
        lane_bases=[[1, 0], [2, 0], [0, 8], [0, 16], [0, 32]], warp_bases=[], block_bases=[], shape=[PART, HALF])
    # ... and, for the unpack, in the order bytes 0-3 of key τ, bytes 0-3 of key τ + 4, bytes 4-7 of τ, ...
    vu_l: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [4, 0], [0, 4], [8, 0]],
        lane_bases=[[1, 0], [2, 0], [0, 8], [0, 16], [0, 32]], warp_bases=[], block_bases=[], shape=[PART, HALF])
    # s^int / z^int rows [128] (channel 2β + parity): K's lane q holds bytes 32q …, V's lane group g 16g …
    ks_l: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [0, 16]], lane_bases=[[0, 32], [0, 64], [0, 0], [0, 0], [0, 0]],
        warp_bases=[], block_bases=[], shape=[1, 2 * HALF])
    vs_l: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8]], lane_bases=[[0, 0], [0, 0], [0, 16], [0, 32], [0, 64]],
        warp_bases=[], block_bases=[], shape=[1, 2 * HALF])
    # cp.async: 16 bytes a lane; codes [64, 64] (8 a lane), s^int / z^int rows [4, 128] (1 a lane)
    cp_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[8, 4], warps_per_cta=[1, 1],
                                          order=[1, 0])
    sz_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[4, 8], warps_per_cta=[1, 1],
                                          order=[1, 0])
    q_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[1, 32], warps_per_cta=[1, 1],
                                         order=[1, 0])
    smem_l: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])

    PAIR: gl.constexpr = GROUP <= ROWS // 2
    pid_s = gl.program_id(0)
    pid = gl.program_id(1)
    b = pid // HG
    slot = pid % HG
    if REGULAR:  # heads H0, H0 + 1, … with their codes K_STEP / V_STEP words apart: no META round trip
        h = H0 + slot
        k_off = gl.multiple_of(slot.to(gl.int64) * K_STEP * 4, 16)
        v_off = gl.multiple_of(slot.to(gl.int64) * V_STEP * 4, 16)
    else:
        h = gl.load(META_ptr + slot).to(gl.int32)
        k_off = gl.multiple_of(gl.load(META_ptr + HG + slot) * 4, 16)
        v_off = gl.multiple_of(gl.load(META_ptr + 2 * HG + slot) * 4, 16)
    bh = b * HKV + h

    # The split's blocks lo … hi − 1 in copy groups: group g = (K of block g + 1, V of block g) and its s^int /
    # z^int rows, in shared-memory slot (g − lo + 1) % STAGES. The scores of block t + 1 are computed in the
    # iteration of block t (its dots independent of block t's softmax, so the two interleave), the prologue
    # computing block lo's from group lo − 1 (K alone).
    lo = pid_s * BLOCKS_PER_SPLIT
    hi = gl.minimum(lo + BLOCKS_PER_SPLIT, T)
    kc_s = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK, HALF], smem_l)
    vc_s = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK, HALF], smem_l)
    sz_s = gl.allocate_shared_memory(gl.int8, [STAGES, 4, 2 * HALF], smem_l)
    code_offs = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, cp_l))[:, None] * HALF \
        + gl.arange(0, HALF, layout=gl.SliceLayout(0, cp_l))[None, :]
    kc_base = KC_ptr + k_off + b.to(gl.int64) * stride_kcb
    vc_base = VC_ptr + v_off + b.to(gl.int64) * stride_vcb
    which = gl.arange(0, 4, layout=gl.SliceLayout(1, sz_l))[:, None]
    sz_offs = bh.to(gl.int64) * T * (2 * HALF) + gl.arange(0, 2 * HALF, layout=gl.SliceLayout(0, sz_l))[None, :]
    sz_ptrs = gl.where(which == 0, KS_ptr, gl.where(which == 1, KZ_ptr, gl.where(which == 2, VS_ptr, VZ_ptr))) \
        + sz_offs
    sz_ptrs = gl.max_contiguous(gl.multiple_of(sz_ptrs, [1, 16]), [1, 16])  # rows of 128 bytes, 16-aligned
    sz_is_k = which < 2
    for g in gl.static_range(STAGES):  # groups lo − 1 … lo + STAGES − 2 (the first without V: its V rows are lo's)
        _copy_group(kc_s.index(g), vc_s.index(g), sz_s.index(g), kc_base, vc_base, code_offs, sz_ptrs, sz_is_k,
                    gl.minimum(lo + g, hi - 1), gl.minimum(gl.maximum(lo + g - 1, lo), hi - 1), WITH_V=g > 0)

    # Q̂ per token (absmax / QMAX) as B operands (even / odd channels): column c < GROUP = query head h·GROUP + c.
    # PAIR (GROUP ≤ 4): a second copy in columns 4 + c (one load and quantization for both), so that one score
    # tile holds two parts of 16 keys (the first in columns 0-3, the second in 4-7) and no lane computes a softmax
    # on padding columns.
    col = gl.arange(0, ROWS, layout=gl.SliceLayout(1, q_l))
    q_col = col % (ROWS // 2) if PAIR else col
    qw_lo, qw_hi, qs = _q_operands(Q_ptr, b, h * GROUP + q_col, q_col < GROUP, stride_qb, stride_qh, q_l, op_b,
                                   row_l, QMAX)
    if PAIR:  # qw: Q̂ in both column halves (the bias dot), qb / qb2: in the first / second half only
        first = (gl.arange(0, ROWS, layout=gl.SliceLayout(0, op_b)) < ROWS // 2).to(gl.float16)[None, :]
        qb_lo = qw_lo * first  # (a multiply by 0 / 1 keeps the fragment's fp16 pairs packed; a select does not)
        qb_hi = qw_hi * first
        qb2_lo = qw_lo * (1.0 - first)
        qb2_hi = qw_hi * (1.0 - first)
    else:
        qb_lo = qw_lo
        qb_hi = qw_hi
        qb2_lo = qw_lo  # (unused)
        qb2_hi = qw_hi

    m_i = gl.full([ROWS], float("-inf"), gl.float32, row_l)
    l_i = gl.zeros([ROWS], gl.float32, row_l)
    acc_lo = gl.zeros([HALF, ROWS], gl.float32, mma_l)
    acc_hi = gl.zeros([HALF, ROWS], gl.float32, mma_l)
    bs_row = bh * T
    kbs = gl.load(KBS_ptr + bs_row + gl.minimum(lo + 1, hi - 1))  # block scales one block ahead of their use
    vbs = gl.load(VBS_ptr + bs_row + lo)
    async_copy.wait_group(STAGES - 1)  # group lo − 1 has landed (this lane's copies) ...
    cta_barrier()  # ... and every lane's
    s = _block_scores(kc_s.index(0), sz_s.index(0), gl.load(KBS_ptr + bs_row + lo), qw_lo, qw_hi, qb_lo, qb_hi,
                      qb2_lo, qb2_hi, qs, sm_scale, mma_l, op_a, op_b, k_l, ks_l, PAIR, EXACT)
    for t in range(lo, hi - 1):
        st = (t - lo + 1) % STAGES
        kbs_n = gl.load(KBS_ptr + bs_row + gl.minimum(t + 2, hi - 1))
        vbs_n = gl.load(VBS_ptr + bs_row + t + 1)
        async_copy.wait_group(STAGES - 2)  # group t has landed (this lane's copies) ...
        cta_barrier()  # ... and every lane's; group t − 1's slot is free
        _copy_group(kc_s.index((st + STAGES - 1) % STAGES), vc_s.index((st + STAGES - 1) % STAGES),
                    sz_s.index((st + STAGES - 1) % STAGES), kc_base, vc_base, code_offs, sz_ptrs, sz_is_k,
                    gl.minimum(t + STAGES, hi - 1), gl.minimum(t + STAGES - 1, hi - 1), WITH_V=True)
        s_next = _block_scores(kc_s.index(st), sz_s.index(st), kbs, qw_lo, qw_hi, qb_lo, qb_hi, qb2_lo, qb2_hi,
                               qs, sm_scale, mma_l, op_a, op_b, k_l, ks_l, PAIR, EXACT)
        m_i, l_i, acc_lo, acc_hi = _attend_block(s, vc_s.index(st), sz_s.index(st), vbs, m_i, l_i, acc_lo, acc_hi,
                                                 mma_l, op_a, op_b, v_l, vu_l, vs_l, PMAX, PAIR, EXACT)
        s = s_next
        kbs, vbs = kbs_n, vbs_n
    async_copy.wait_group(0)  # the last block's group (and any clamped copies after it)
    cta_barrier()
    st = (hi - lo) % STAGES
    m_i, l_i, acc_lo, acc_hi = _attend_block(s, vc_s.index(st), sz_s.index(st), vbs, m_i, l_i, acc_lo, acc_hi,
                                             mma_l, op_a, op_b, v_l, vu_l, vs_l, PMAX, PAIR, EXACT)
    if PAIR:  # a query row's two column halves summed (m and ℓ are already the row's in both)
        acc_lo = _fold_pairs(acc_lo)
        acc_hi = _fold_pairs(acc_hi)

    if (pid_s == NUM_SPLITS - 1) & (NB > 0):  # the INT8 buffer: the newest NB keys, one universal scale a head
        acc_lo, acc_hi, m_i, l_i = _buffer_block(
            KB_ptr, KBSC_ptr, VB_ptr, VBSC_ptr, bh, NB, qb_lo, qb_hi, qs, sm_scale, m_i, l_i, acc_lo, acc_hi,
            mma_l, op_a, op_b, PMAX)

    # this split's (m, ℓ, acc), or the output itself (one split)
    rows = gl.arange(0, ROWS, layout=row_l)
    ch = 2 * _row_channel(gl.arange(0, HALF, layout=gl.SliceLayout(1, mma_l)))
    row_ok = rows < GROUP
    if NUM_SPLITS == 1:
        out_rows = O_ptr + b.to(gl.int64) * stride_ob + (h * GROUP + rows)[None, :] * stride_oh
        inv = gl.where(l_i == 0.0, 0.0, 1.0 / gl.where(l_i == 0.0, 1.0, l_i))
        gl.store(out_rows + ch[:, None], (acc_lo * inv[None, :]).to(O_ptr.dtype.element_ty), mask=row_ok[None, :])
        gl.store(out_rows + ch[:, None] + 1, (acc_hi * inv[None, :]).to(O_ptr.dtype.element_ty),
                 mask=row_ok[None, :])
    else:
        part = (b * (HKV * GROUP) + h * GROUP + rows).to(gl.int64) * NUM_SPLITS + pid_s
        gl.store(MP_ptr + part, m_i, mask=row_ok)
        gl.store(LP_ptr + part, l_i, mask=row_ok)
        acc_rows = ACC_ptr + part[None, :] * (2 * HALF)
        gl.store(acc_rows + ch[:, None], acc_lo, mask=row_ok[None, :])
        gl.store(acc_rows + ch[:, None] + 1, acc_hi, mask=row_ok[None, :])
        cta_barrier()  # every lane's partials are written before the ticket (release) is taken
        ticket = gl.atomic_add(CNT_ptr + bh, 1, sem="acq_rel", scope="gpu")
        if ticket == NUM_SPLITS - 1:
            gl.atomic_xchg(CNT_ptr + bh, 0)  # zero again for the next call
            _merge_splits(MP_ptr, LP_ptr, ACC_ptr, O_ptr, b, h, HKV, NUM_SPLITS, stride_ob, stride_oh,
                          GROUP, G_PAD, SPLITS_PAD)


@gluon.jit
def _q_operands(Q_ptr, b, head, ok, stride_qb, stride_qh, q_l: gl.constexpr, op_b: gl.constexpr,
                row_l: gl.constexpr, QMAX: gl.constexpr):
    """Q̂ = clamp(rne(q / s_Q), ±QMAX), s_Q = absmax / QMAX per token (1 if 0), of query heads ``head [8]`` (columns
    where ``ok``, zeros elsewhere): ``(B operand of the even channels, of the odd ones, s_Q [8])``."""
    c_q = gl.arange(0, 2 * HALF, layout=gl.SliceLayout(0, q_l))
    q = gl.load(Q_ptr + b.to(gl.int64) * stride_qb + head[:, None] * stride_qh + c_q[None, :], mask=ok[:, None],
                other=0.0).to(gl.float32)
    qs = gl.div_rn(gl.max(gl.abs(q), 1), QMAX * 1.0)
    qs = gl.where(qs == 0.0, 1.0, qs)
    r = gl.div_rn(gl.full_like(qs, 1.0), qs)[:, None]  # q / s_Q: one reciprocal a row, Markstein's correction
    q_hat = q * r
    q_hat = gl.fma(gl.fma(-qs[:, None], q_hat, q), r, q_hat)  # the IEEE quotient itself
    q_hat = gl.minimum(gl.maximum(_rne(q_hat), -QMAX * 1.0), QMAX * 1.0).to(gl.float16)
    q_even, q_odd = gl.split(gl.reshape(q_hat, [ROWS, HALF, 2]))
    return (gl.convert_layout(_k_slots(gl.permute(q_even, (1, 0))), op_b),
            gl.convert_layout(_k_slots(gl.permute(q_odd, (1, 0))), op_b), gl.convert_layout(qs, row_l))


@gluon.jit
def _copy_group(kc_dst, vc_dst, sz_dst, kc_base, vc_base, code_offs, sz_ptrs, sz_is_k, tk, tv, WITH_V: gl.constexpr):
    """``cp.async`` of a copy group: block ``tk``'s K codes and ``s^int`` / ``z^int`` rows (``sz_is_k``), block
    ``tv``'s V codes (``WITH_V``) and rows; one commit group."""
    async_load(kc_dst, kc_base + tk * (BLOCK * HALF) + code_offs, cache_modifier=".cg")
    if WITH_V:
        async_load(vc_dst, vc_base + tv * (BLOCK * HALF) + code_offs, cache_modifier=".cg")
    rows = gl.max_contiguous(gl.multiple_of(sz_ptrs + gl.where(sz_is_k, tk, tv) * (2 * HALF), [1, 16]), [1, 16])
    async_load(sz_dst, rows, cache_modifier=".cg")
    async_copy.commit_group()


@gluon.jit
def _block_scores(kc_t, sz_t, kbs, qw_lo, qw_hi, qb_lo, qb_hi, qb2_lo, qb2_hi, qs, sm_scale, mma_l: gl.constexpr,
                  op_a: gl.constexpr, op_b: gl.constexpr, k_l: gl.constexpr, ks_l: gl.constexpr, PAIR: gl.constexpr,
                  EXACT: gl.constexpr):
    """A block's scores ``S = Q̂·K̂ᵀ·s_Q·s_K·scale`` as a tuple of tiles ``[16 keys, 8 columns]`` (``PAIR``: two parts
    a tile, columns 0-3 / 4-7); ``kc_t``: its codes, ``sz_t``: its s^int / z^int rows, ``kbs``: its block scale.

    A = X·2⁻²⁴ (even channels) / 16·X·2⁻²⁴ (odd), B = Q̂ ⊙ s^int (odd: / 16), the accumulator starting at
    (Q̂·(z^int ⊙ s^int))·2⁻²⁴ (one dot of Q̂ with z ⊙ s a block): Sᵀ·2⁻²⁴, exact; parts of 16 keys."""
    kz_e, kz_o = _byte_pairs(sz_t, 1, ks_l, gl.float16)
    ks_e, ks_o = _byte_pairs(sz_t, 0, ks_l, gl.float16)
    bias = mma_v2(_bias_operand(kz_e * ks_e, op_a), qw_lo, gl.zeros([PART, ROWS], gl.float32, mma_l))
    bias = mma_v2(_bias_operand(kz_o * ks_o, op_a), qw_hi, bias) * (1.0 / 16777216.0)
    s_lo = _k_slot_vector(ks_e, op_b)[:, None]
    s_hi = _k_slot_vector(ks_o * 0.0625, op_b)[:, None]
    b_lo = qb_lo * s_lo
    b_hi = qb_hi * s_hi
    qk = (qs * kbs * 16777216.0)[None, :]  # 2²⁴·s_Q·s_K: S·2⁻²⁴·qk = S·(s_Q·s_K), one rounding as S·s_Q·s_K
    if not EXACT:
        qk = qk * sm_scale  # one multiply a score, not two
    s = ()
    for i in gl.static_range(PARTS // 2 if PAIR else PARTS):
        if PAIR:
            s_i = _key_scores(kc_t.slice(2 * i * PART, PART), b_lo, b_hi, bias, k_l, op_a)
            s_i = _key_scores(kc_t.slice((2 * i + 1) * PART, PART), qb2_lo * s_lo, qb2_hi * s_hi, s_i, k_l, op_a)
        else:
            s_i = _key_scores(kc_t.slice(i * PART, PART), b_lo, b_hi, bias, k_l, op_a)
        s_i = s_i * qk
        if EXACT:
            s_i = s_i * sm_scale
        s = s + (s_i,)
    return s


@gluon.jit
def _attend_block(s, vc_t, sz_t, vbs, m_i, l_i, acc_lo, acc_hi, mma_l: gl.constexpr, op_a: gl.constexpr,
                  op_b: gl.constexpr, v_l: gl.constexpr, vu_l: gl.constexpr, vs_l: gl.constexpr, PMAX: gl.constexpr,
                  PAIR: gl.constexpr, EXACT: gl.constexpr):
    """One block's SAS softmax of the scores ``s`` (:func:`_block_scores`), P̂ and its ``P̂·V̂`` (``vc_t``: the V
    codes, ``sz_t``: the s^int / z^int rows, ``vbs``: the block scale) into the running ``(m, ℓ, acc)``.

    A = (X·2⁻²⁴)ᵀ (even channels) / (16·X·2⁻²⁴)ᵀ (odd), B = P̂ᵀ; parts of 16 keys."""
    p, alpha, m_i, l_i = _softmax(s, m_i, l_i, PAIR)
    p, p_scale = _quantize_p(p, PMAX, EXACT, PAIR)
    r_lo = gl.zeros([HALF, ROWS], gl.float32, mma_l)
    r_hi = gl.zeros([HALF, ROWS], gl.float32, mma_l)
    p_all = p[0]
    first_half = (gl.arange(0, ROWS, layout=gl.SliceLayout(0, op_b)) < ROWS // 2)[None, :]
    for i in gl.static_range(len(p)):
        pb = gl.convert_layout(_key_slots(p[i].to(gl.float16)), op_b)  # one conversion a tile
        if PAIR:  # part 2i's P̂: the tile's first column half (the other half zero), part 2i + 1's: the second
            r_lo, r_hi = _value_products(vc_t.slice(2 * i * PART, PART), gl.where(first_half, pb, 0.0),
                                         r_lo, r_hi, v_l, vu_l, op_a)
            r_lo, r_hi = _value_products(vc_t.slice((2 * i + 1) * PART, PART), gl.where(first_half, 0.0, pb),
                                         r_lo, r_hi, v_l, vu_l, op_a)
        else:
            r_lo, r_hi = _value_products(vc_t.slice(i * PART, PART), pb, r_lo, r_hi, v_l, vu_l, op_a)
    for i in gl.static_range(1, len(p)):
        p_all += p[i]
    p_sum = gl.sum(p_all, 0)  # per column: its own keys' ΣP̂
    # the block's P̂·V̂, exact: (Σ X·P̂·2⁻²⁴ + z^int·2⁻²⁴·ΣP̂)·(s^int·2²⁴) (odd channels: 2⁻²⁰, 2²⁰)
    vz_e, vz_o = _byte_pairs(sz_t, 3, vs_l, gl.float32)
    vs_e, vs_o = _byte_pairs(sz_t, 2, vs_l, gl.float32)
    r_lo = gl.fma(_as_rows(vz_e * (1.0 / 16777216.0), mma_l), p_sum[None, :], r_lo) \
        * _as_rows(vs_e * 16777216.0, mma_l)
    r_hi = gl.fma(_as_rows(vz_o * (1.0 / 1048576.0), mma_l), p_sum[None, :], r_hi) \
        * _as_rows(vs_o * 1048576.0, mma_l)
    if EXACT:
        acc_lo = acc_lo * alpha[None, :] + r_lo * p_scale[None, :] * vbs
        acc_hi = acc_hi * alpha[None, :] + r_hi * p_scale[None, :] * vbs
    else:
        f = (p_scale * vbs)[None, :]
        acc_lo = acc_lo * alpha[None, :] + r_lo * f
        acc_hi = acc_hi * alpha[None, :] + r_hi * f
    return m_i, l_i, acc_lo, acc_hi


@gluon.jit
def _key_scores(kc, b_lo, b_hi, bias, k_l: gl.constexpr, op_a: gl.constexpr):
    """``Sᵀ·2⁻²⁴`` of 16 keys (``kc``: their codes in shared memory) as ``[16 keys, 8 rows]`` fp32, exact."""
    a_lo, a_hi = gl.inline_asm_elementwise(_K_ASM, "=r,=r,=r,=r,r", [kc.load(k_l)], dtype=(gl.float16, gl.float16),
                                           is_pure=True, pack=4)
    return mma_v2(_k_operand(_nibble_labels(a_hi), op_a), b_hi, mma_v2(_k_operand(_nibble_labels(a_lo), op_a), b_lo,
                                                                        bias))


@gluon.jit
def _nibble_labels(x):
    """The true labels of :data:`_K_ASM`'s and :data:`_S8_ASM`'s outputs ``[rows, bytes]``: element ``e`` of a pack
    of 4 is labelled byte ``e`` but holds byte ``2e₀ + e₁`` (the two low byte bits swapped; no data moves)."""
    n: gl.constexpr = x.shape[0]
    c: gl.constexpr = x.shape[1]
    x = gl.permute(gl.reshape(x, [n, c // 4, 2, 2]), (0, 1, 3, 2))
    return gl.reshape(x, [n, c])


@gluon.jit
def _k_slot_vector(x, op_b: gl.constexpr):
    """Per-byte values ``[64]`` (lane ``q`` holding bytes ``16q …``) as the K slots of the B operand ``[64]``."""
    x = gl.reshape(_k_slots(gl.reshape(x, [HALF, 1])), [HALF])
    return gl.convert_layout(x, gl.SliceLayout(1, op_b))


@gluon.jit
def _bias_operand(w, op_a: gl.constexpr):
    """Per-byte values ``[64]`` (``z^int ⊙ s^int`` of one parity) as an A operand ``[16, 64]`` of 16 equal rows."""
    w = gl.convert_layout(gl.reshape(_k_slots(gl.reshape(w, [HALF, 1])), [HALF]), gl.SliceLayout(0, op_a))
    return gl.broadcast(w[None, :], gl.zeros([PART, HALF], gl.float16, op_a))[0]


@gluon.jit
def _value_products(vc, pb, r_lo, r_hi, v_l: gl.constexpr, vu_l: gl.constexpr, op_a: gl.constexpr):
    """``r += Σ_keys X·2⁻²⁴·P̂`` (even channels) and ``Σ 16·X·2⁻²⁴·P̂`` (odd) over 32 keys (``vc``: their
    codes in shared memory; ``pb``: P̂ as the B operand), ``[64 channel rows, 8 rows]``."""
    codes = gl.convert_layout(vc.load(v_l), vu_l)
    x_lo, x_hi = gl.inline_asm_elementwise(
        _V_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [codes], dtype=(gl.float16, gl.float16), is_pure=True, pack=8)
    r_lo = mma_v2(_v_operand(_unpacked_labels(x_lo), op_a), pb, r_lo)
    r_hi = mma_v2(_v_operand(_unpacked_labels(x_hi), op_a), pb, r_hi)
    return r_lo, r_hi


@gluon.jit
def _as_rows(x, mma_l: gl.constexpr):
    """Per-byte values ``[64]`` (lane group ``g`` holding bytes ``8g …``) as ``[64 channel rows, 1]`` of ``mma_l``."""
    x = gl.reshape(_channel_rows(gl.reshape(x, [HALF, 1])), [HALF])
    return gl.convert_layout(x, gl.SliceLayout(1, mma_l))[:, None]


@gluon.jit
def _parts(x):
    """``x [64, N]`` → its four parts ``x[16i : 16i + 16]`` (a tuple)."""
    n: gl.constexpr = x.shape[1]
    a, b = gl.split(gl.permute(gl.reshape(x, [2, 2, PART, n]), (2, 3, 0, 1)))  # [16, N, i₁], i₀ = 0 / 1
    a0, a1 = gl.split(a)
    b0, b1 = gl.split(b)
    return a0, b0, a1, b1


@gluon.jit
def _buffer_block(KB_ptr, KBSC_ptr, VB_ptr, VBSC_ptr, bh, NB, qb_lo, qb_hi, qs, sm_scale, m_i, l_i, acc_lo, acc_hi,
                  mma_l: gl.constexpr, op_a: gl.constexpr, op_b: gl.constexpr, PMAX: gl.constexpr):
    """The INT8 buffer's ``NB < 64`` keys as one masked block (K̂, V̂ = the stored integers)."""
    buf_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 2, 2], threads_per_warp=[4, 8, 1],
                                           warps_per_cta=[1, 1, 1], order=[2, 1, 0])
    key = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, gl.SliceLayout(2, buf_l)))
    byte = gl.arange(0, HALF, layout=gl.SliceLayout(0, gl.SliceLayout(2, buf_l)))
    par = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, buf_l)))
    offs = (bh.to(gl.int64) * NB + key[:, None, None]) * (2 * HALF) + 2 * byte[None, :, None] + par[None, None, :]
    ok = (key < NB)[:, None, None]
    k_even, k_odd = gl.split(gl.load(KB_ptr + offs, mask=ok, other=0).to(gl.float16))
    k_even = _parts(k_even)
    k_odd = _parts(k_odd)
    zero_s = gl.zeros([PART, ROWS], gl.float32, mma_l)
    keys = gl.arange(0, PART, layout=gl.SliceLayout(1, mma_l))
    qk = (qs * gl.load(KBSC_ptr + bh))[None, :]
    s = ()
    for i in gl.static_range(PARTS):
        s_int = mma_v2(_k_operand(k_odd[i], op_a), qb_hi, mma_v2(_k_operand(k_even[i], op_a), qb_lo, zero_s))
        s = s + (gl.where((i * PART + keys < NB)[:, None], s_int * qk * sm_scale, float("-inf")),)
    p, alpha, m_i, l_i = _softmax(s, m_i, l_i, False)
    p, p_scale = _quantize_p(p, PMAX, True, False)
    v_even, v_odd = gl.split(gl.load(VB_ptr + offs, mask=ok, other=0).to(gl.float16))
    v_even = _parts(v_even)
    v_odd = _parts(v_odd)
    r_lo = gl.zeros([HALF, ROWS], gl.float32, mma_l)
    r_hi = gl.zeros([HALF, ROWS], gl.float32, mma_l)
    for i in gl.static_range(PARTS):
        pb = gl.convert_layout(_key_slots(p[i].to(gl.float16)), op_b)
        r_lo = mma_v2(_v_operand(v_even[i], op_a), pb, r_lo)
        r_hi = mma_v2(_v_operand(v_odd[i], op_a), pb, r_hi)
    vbs = gl.load(VBSC_ptr + bh)
    acc_lo = acc_lo * alpha[None, :] + r_lo * p_scale[None, :] * vbs
    acc_hi = acc_hi * alpha[None, :] + r_hi * p_scale[None, :] * vbs
    return acc_lo, acc_hi, m_i, l_i


@gluon.jit
def _merge_chunk_loads(MP_ptr, ACC_ptr, head0, NUM_SPLITS, s0, sc, rc, cc, GROUP: gl.constexpr):
    """Splits ``s0 … s0 + CHUNK − 1`` of the rows ``head0 + rc``: their ``m [CHUNK, G_PAD]`` and acc
    ``[CHUNK, G_PAD, 128]`` (−∞ and 0 past the splits and rows)."""
    ok = (s0 + sc < NUM_SPLITS)[:, None] & (rc < GROUP)[None, :]
    part = (head0 + rc[None, :]).to(gl.int64) * NUM_SPLITS + s0 + sc[:, None]
    m = gl.load(MP_ptr + part, mask=ok, other=float("-inf"), cache_modifier=".cg")
    acc = gl.load(ACC_ptr + part[:, :, None] * (2 * HALF) + cc[None, None, :], mask=ok[:, :, None], other=0.0,
                  cache_modifier=".cg")
    return m, acc


@gluon.jit
def _merge_splits(MP_ptr, LP_ptr, ACC_ptr, O_ptr, b, h, HKV, NUM_SPLITS, stride_ob, stride_oh,
                  GROUP: gl.constexpr, G_PAD: gl.constexpr, SPLITS_PAD: gl.constexpr):
    """``O = Σ_s SAS(m_s − M)·acc_s / Σ_s SAS(m_s − M)·ℓ_s`` over the splits of (b, h), in split order, the
    partials read past L1 (``.cg``: other programs wrote them)."""
    m_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1], threads_per_warp=[4, 8], warps_per_cta=[1, 1],
                                         order=[1, 0])
    a_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 4], threads_per_warp=[1, 1, 32],
                                         warps_per_cta=[1, 1, 1], order=[2, 1, 0])
    head0 = b * (HKV * GROUP) + h * GROUP
    CHUNK: gl.constexpr = MERGE_ROWS // G_PAD  # splits merged at a time
    sc = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, gl.SliceLayout(2, a_l)))
    rc = gl.arange(0, G_PAD, layout=gl.SliceLayout(0, gl.SliceLayout(2, a_l)))
    cc = gl.arange(0, 2 * HALF, layout=gl.SliceLayout(0, gl.SliceLayout(1, a_l)))
    first = _merge_chunk_loads(MP_ptr, ACC_ptr, head0, NUM_SPLITS, 0, sc, rc, cc, GROUP)  # in flight with m, ℓ
    sp = gl.arange(0, SPLITS_PAD, layout=gl.SliceLayout(1, m_l))
    rows = gl.arange(0, G_PAD, layout=gl.SliceLayout(0, m_l))
    ok = (sp < NUM_SPLITS)[:, None] & (rows < GROUP)[None, :]
    part = (head0 + rows[None, :]).to(gl.int64) * NUM_SPLITS + sp[:, None]
    m = gl.load(MP_ptr + part, mask=ok, other=float("-inf"), cache_modifier=".cg")
    m_max = gl.max(m, 0)
    m_ref = gl.where(m_max == float("-inf"), 0.0, m_max)
    ell = gl.sum(_sas_exp(m - m_ref[None, :]) * gl.load(LP_ptr + part, mask=ok, other=0.0, cache_modifier=".cg"), 0)

    m_ref3 = gl.convert_layout(m_ref, gl.SliceLayout(0, gl.SliceLayout(2, a_l)))[None, :]
    acc = gl.sum(_sas_exp(first[0] - m_ref3)[:, :, None] * first[1], 0)
    for s0 in range(CHUNK, NUM_SPLITS, CHUNK):
        m_c, a = _merge_chunk_loads(MP_ptr, ACC_ptr, head0, NUM_SPLITS, s0, sc, rc, cc, GROUP)
        acc += gl.sum(_sas_exp(m_c - m_ref3)[:, :, None] * a, 0)
    ell = gl.convert_layout(ell, gl.SliceLayout(1, gl.SliceLayout(0, a_l)))
    out = gl.where((ell == 0.0)[:, None], 0.0, acc / gl.where(ell == 0.0, 1.0, ell)[:, None])
    ro = gl.arange(0, G_PAD, layout=gl.SliceLayout(1, gl.SliceLayout(0, a_l)))
    co = gl.arange(0, 2 * HALF, layout=gl.SliceLayout(0, gl.SliceLayout(0, a_l)))
    o_ptrs = O_ptr + b.to(gl.int64) * stride_ob + (h * GROUP + ro)[:, None] * stride_oh + co[None, :]
    gl.store(o_ptrs, out.to(O_ptr.dtype.element_ty), mask=(ro < GROUP)[:, None])


# --------------------------------------------------------------------------- launcher


def group_unsupported(group: int, nq: int, d: int, k_bits: int, v_bits: int, n_blocks: int) -> str | None:
    """Why the Gluon kernel cannot take a code-width group of a call (None if it can): it is written for
    decoding's shape, one query token of ``≤ 8`` query heads per KV head, ``D = 128``, 4-bit K and V, at least one
    compressed block."""
    if nq != 1:
        return f"q_len {nq} (the Gluon kernel takes single-token decode steps)"
    if group > MAX_GROUP:
        return f"{group} query heads per KV head (the Gluon kernel takes ≤ {MAX_GROUP})"
    if d != HEAD_DIM:
        return f"head_dim {d} (the Gluon kernel takes {HEAD_DIM})"
    if (k_bits, v_bits) != (BITS, BITS):
        return f"{k_bits}-bit K / {v_bits}-bit V (the Gluon kernel takes {BITS}-bit both)"
    if n_blocks == 0:
        return "no compressed block yet"
    return None


def default_num_splits(batch: int, kv_heads: int, n_blocks: int, device: torch.device) -> int:
    """Splits of the key blocks: the Triton kernel's rule
    (:func:`~quantpatch.kernels.turbo_kv.turbo_decode_splits.split_count`: one wave, at least 4 blocks a split) with
    ``PROGRAMS_PER_SM`` one-warp programs per SM, at most ``MAX_SPLITS``."""
    return min(split_count(batch, kv_heads, n_blocks, device, PROGRAMS_PER_SM), MAX_SPLITS)


def launch_splits(batch: int, heads: int, n_blocks: int, num_splits: int, device: torch.device) -> tuple[int, int]:
    """``(splits, blocks per split)`` of a launch over ``heads`` KV heads of a cache of ``n_blocks ≥ 1`` blocks:
    ``num_splits`` (≤ 0: :func:`default_num_splits`), at most ``MAX_SPLITS`` and ``n_blocks``, evened out."""
    splits = num_splits if num_splits > 0 else default_num_splits(batch, heads, n_blocks, device)
    per_split = cdiv(n_blocks, min(max(splits, 1), n_blocks, MAX_SPLITS))
    return cdiv(n_blocks, per_split), per_split


_PLANS = LaunchPlans(_turbo_decode_gluon)  # later calls of a shape go to the compiled kernel's launcher


def launch_constexprs(group: int, qk_qmax: int, pv_qmax: int, splits: int, regular: bool) -> dict:
    """The kernel's constexprs for a launch over ``splits`` splits of KV heads with ``group`` query heads each
    (``regular``: the heads consecutive, their codes evenly spaced)."""
    return dict(GROUP=group, G_PAD=next_pow2(group), QMAX=qk_qmax, PMAX=pv_qmax, SPLITS_PAD=SPLITS_PAD,
                STAGES=STAGES, EXACT=splits == 1, REGULAR=regular)


def launch(q, heads, meta, steps, kc, vc, k_sint, k_zint, k_bscale, v_sint, v_zint, v_bscale, k_buf, k_buf_scale,
           v_buf, v_buf_scale, nb: int, out, workspace, sm_scale: float, qk_qmax: int, pv_qmax: int,
           num_splits: int) -> None:
    """One launch over the KV heads ``heads`` (a 4-bit group) of a decode call into ``out (B, H, 1, 128)``.

    ``kc`` / ``vc``: the group's first head's codes ``uint8 (B, T·64, 64)``; ``steps``: ``(K step, V step)`` in
    int32 words where the heads are consecutive and their codes evenly spaced (16-byte multiples), else None and
    ``meta`` the heads and their code offsets (``turbo_decode_triton._group_offsets``; not read, and may be None,
    with ``steps``); ``s^int`` / ``z^int`` int8 and block scales fp32 of the whole cache; buffers
    ``int8 (B, Hkv, nb, 128)`` with fp32 scales (any valid tensor when ``nb = 0``); ``workspace``:
    ``workspace(splits) → (m, ℓ, acc, counters)`` for several splits; ``num_splits`` ≤ 0: the default.

    A plan's first launch goes through ``JITFunction.run`` (compiling if needed), later ones straight to the
    compiled kernel's launcher."""
    b, h, _, d = q.shape
    hkv, t = k_sint.shape[1], k_sint.shape[2]
    group = h // hkv
    splits, per_split = launch_splits(b, len(heads), t, num_splits, q.device)
    # float32 partials even with one split: the kernel's merge branch is compiled whatever the split count (a runtime
    # value), and storing its float32 partials through a bf16 output pointer does not compile
    m_part, l_part, acc_part, counters = workspace(splits)
    args = (q, q.stride(0), q.stride(1),
            kc, kc.stride(0), k_sint, k_zint, k_bscale,
            vc, vc.stride(0), v_sint, v_zint, v_bscale,
            k_buf, k_buf_scale, v_buf, v_buf_scale, q if meta is None else meta,
            out, out.stride(0), out.stride(1),
            m_part, l_part, acc_part, counters,
            t, nb, hkv, len(heads), per_split, splits, sm_scale, heads[0], *(steps or (0, 0)))
    _PLANS((splits, b * len(heads)), args, launch_constexprs(group, qk_qmax, pv_qmax, splits, steps is not None),
           num_warps=1, enable_fp_fusion=splits > 1)  # one split follows the reference's roundings: no FMA contraction
