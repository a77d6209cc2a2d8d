"""INT8 Q·Kᵀ prefill attention in Gluon (Triton 3.6+, sm_90): FA3's schedule over the Triton kernel's numerics.

Same operands and numerics as ``quant_attn_triton._attn_fwd_kernel`` for ``sage2`` (INT8 Q·Kᵀ with
SageAttention2's per-thread Q and K scales, ΔS, P̃ → e4m3 at the static 448 scale, FP8 P̃·V accumulated per key
block then added to the FP32 accumulator, per-channel V scale, optional V mean) and ``int8_flash`` (per-token Q
and K scales, P̂ = rne(127 P̃), INT8 P̂·V with an int32 accumulator per block, one V scale, ℓ from P̂), causal
(bottom-right aligned, Nk - Nq a multiple of 128) or not, any Nq / Nk (tails masked), GQA, optional LSE. The
public route is ``fast_paths.gluon_takes``.

A program takes 128 query rows: two consumer warpgroups of 64 rows share one producer warp (the ping-pong schedule;
the serial one below has three), which brings K (with ΔS, and δK for int8-flash and causal calls) and Vᵀ blocks by
TMA into ``STAGES``-deep rings. Per-thread groups make δQ·δK one value a lane and 64-key span, so S costs one
multiply-add an element (with ΔS). Each lane loads its δK two blocks ahead from global memory, or, causal, reads it
from the δK ring (as int8-flash reads its per-token δK): the ring ran causal calls 1.02–1.04× as fast at 4k–16k
keys and non-causal ones 0.97–0.98× (H200), so each keeps the faster. Scores stay in raw units (log₂e/√d
is applied in the exp2's own multiply-add) and ΔS keeps its row constant q̄·K̄, which softmax does not see (only the
LSE removes it).

A program takes its key blocks last first: the first is the only one with keys a row must not see (the tail, or,
causal, the diagonal, which is one block because Nk - Nq is a multiple of 128), so it alone is masked and the loop
holds no masked copy of a section. With a masked copy after the loop (key blocks in ascending order), ptxas compiled
the causal loop with spills and the causal kernel ran 0.84–0.98× the Triton kernel; taken this way it runs
1.09 / 1.14 / 1.17× at 4k / 8k / 16k keys, non-causal speed unchanged (H200). Each consumer runs
(block j)::

    [its turn]  issue Q·K_{j+1}, issue P̃_j·V_j        (async wgmma; then the other warpgroup's turn)
                wait(1)  -> Q·K_{j+1} done               (P̃_j·V_j still runs)
                softmax of block j + 1                   (ALU / MUFU, under P̃_j·V_j and the other's MMAs)
                wait(0)  -> P̃_j·V_j done; acc = α_j acc + R_j

The turns (two mbarriers) make the warpgroups alternate their MMA issues, so one's softmax runs while the
other's MMAs do (FA3's ping-pong). Every MMA retires in the iteration that issued it: a wgmma in flight across
the loop's back edge makes ptxas serialise them all (C7514).

Warpgroup 1 issues its first Q·K only once warpgroup 0 has the row max of its first block (one mbarrier,
``first_max``). Started together, the two run their first softmaxes in step; staggered, the kernel ran
1.03–1.04× as fast at 8k keys and 1.06–1.09× at 4k (H200, kernel only against the unstaggered kernel;
re-staggering every 2, 8 or 32 blocks and making the exp2 phases take turns were slower).

The serial schedule (``WARPGROUPS`` = 3, non-causal only) gives a program 192 query rows and three consumers at 160
registers, too few to hold S, the accumulator and a block's P̂·V at once: each consumer runs Q·K_j, softmax j,
P̂_j·V_j and the accumulator update in turn, and the other two warpgroups' work covers its waits (warpgroup w > 0
starts once w − 1 has its first row max; δK and ΔS come from the ring, two ΔS rows a stage as 192 rows meet two
query blocks). Three warps a scheduler instead of two hide more of the softmax's latency, which pays where the
softmax is longest: int8-flash ran 1.05 / 1.06 / 1.09 / 1.09× as fast at 2k / 4k / 8k / 16k keys (4 stages, bits
equal), sage2 0.94–0.96× (H200), so int8-flash's non-causal calls take it by default.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..compiled_launch import LaunchPlans, cdiv
from ..gluon_compat import cta_barrier, tma_load
from .qk_quant_triton import QuantizedQKV
from .quant_attn_triton import LOG2E, MAGIC_F, MAGIC_I

WG_ROWS = gl.constexpr(64)  # query rows of a consumer warpgroup (wgmma M)
BLOCK_M = 128  # query rows of a program of two consumer warpgroups (the causal kernel's diagonal block)
# SageAttention2's per-thread groups (App. A.6) as this kernel reads them: rows 16w + i and 16w + 8 + i share δQ
# (query blocks with block_q / warps a multiple of 16), and within each aligned span of K_SPAN keys the keys
# 8r + 2g + b of lane group g share δK (block_k a multiple of 64), so δQ·δK is one value a thread and span
K_SPAN = gl.constexpr(64)
PRODUCER_REGS = gl.constexpr(24)
SERIAL = gl.constexpr(3)  # consumer warpgroups of the serial schedule (two: the ping-pong one)


@gluon.jit
def _kv_producer(args, config: gl.constexpr):
    """Producer warp: the t-th K block (int8 tile, the ΔS rows of the program's query blocks, ``ds_step`` apart, and
    δK for whoever reads it from the ring) and Vᵀ block (:func:`_key_block`) into stage ``t % STAGES`` by TMA once
    every consumer has released the stage (after its P̂·V of block t - STAGES)."""
    k_desc, ds_desc, ks_desc, vt_desc, k_s, ds_s, ks_s, v_s, k_ready, v_ready, kv_empty, k_row0, ds_row0, ds_step, \
        v_row0, n_blocks = args
    BLOCK_N: gl.constexpr = config.BLOCK_N
    HEAD_DIM: gl.constexpr = config.HEAD_DIM
    STAGES: gl.constexpr = config.STAGES
    SMOOTH_Q: gl.constexpr = config.SMOOTH_Q
    DS_ROWS: gl.constexpr = _ds_rows(config.WARPGROUPS)
    DK_RING: gl.constexpr = config.TOKEN_SCALES or _lane_dk_ring(config.CAUSAL, config.TOKEN_SCALES,
                                                                 config.WARPGROUPS)
    K_BYTES: gl.constexpr = BLOCK_N * HEAD_DIM + BLOCK_N * 4 * (DS_ROWS * SMOOTH_Q + DK_RING)
    for t in range(n_blocks):
        st = t % STAGES
        key0 = _key_block(t, n_blocks) * BLOCK_N
        mbarrier.wait(kv_empty.index(st), ((t // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1 at once
        mbarrier.expect(k_ready.index(st), K_BYTES)
        tma_load(k_desc, [k_row0 + key0, 0], k_ready.index(st), k_s.index(st))
        if SMOOTH_Q:
            for r in gl.static_range(DS_ROWS):
                tma_load(ds_desc, [ds_row0 + r * ds_step + key0], k_ready.index(st), ds_s.index(DS_ROWS * st + r))
        if DK_RING:
            tma_load(ks_desc, [k_row0 + key0], k_ready.index(st), ks_s.index(st))
        mbarrier.expect(v_ready.index(st), BLOCK_N * HEAD_DIM)
        tma_load(vt_desc, [v_row0, key0], v_ready.index(st), v_s.index(st))


@gluon.jit
def _key_block(t, n_blocks):
    """The key block a program takes t-th: descending, from the last one it needs (the one with the tail keys, or,
    causal, the diagonal), the only one masked: the loop holds no masked copy of a section."""
    return n_blocks - 1 - t


@triton.constexpr_function
def _log2_p_max(pv_int8):
    """log₂ of P̂'s static scale: 127 (INT8 P̂) or 448 (e4m3)."""
    return math.log2(127.0 if pv_int8 else 448.0)


@triton.constexpr_function
def _int32_wrapped(x):
    """``x`` modulo 2³² as a signed 32-bit value (what int32 arithmetic that wraps leaves of it)."""
    return (x + 2**31) % 2**32 - 2**31


@triton.constexpr_function
def _lane_scale_shape(block_n):
    """Shape of the score tile ``(64, block_n)`` seen by per-thread groups: row = 16w + 8h + i, key =
    64n + 8r + 2g + b (warp w, lane 4i + g; registers h, r, b), so δQ depends on (w, i) and δK on (n, g)."""
    span = K_SPAN.value
    return [4, 2, 8, block_n // span, span // 8, 4, 2]


class _Config(NamedTuple):
    """The kernel's compile-time switches, as one constexpr a partition takes (Gluon turns constexprs inside a tuple
    of runtime values into tensors)."""
    BLOCK_N: int
    HEAD_DIM: int
    Q_BLOCK: int
    STAGES: int
    SMOOTH_Q: bool
    SMOOTH_K: bool
    SMOOTH_V: bool
    RETURN_LSE: bool
    TOKEN_SCALES: bool
    PV_INT8: bool
    CAUSAL: bool
    WARPGROUPS: int


@triton.constexpr_function
def _pack(*values):
    """:class:`_Config` of the kernel's constexpr values, in its field order."""
    return _Config(*values)


@triton.constexpr_function
def _consumer_regs(warpgroups):
    """setmaxnreg of a consumer warpgroup: ``warpgroups`` · 128 · regs + 128 · PRODUCER_REGS ≤ 64 K."""
    return {2: 232, SERIAL.value: 160}[warpgroups]


@triton.constexpr_function
def _p_buffers(warpgroups):
    """P̂ buffers in shared memory: consumer c's are 2c and 2c + 1 in the ping-pong schedule (P̃_j·V_j reads one while
    softmax j + 1 writes the other), c in the serial one."""
    return 2 * warpgroups if warpgroups == 2 else warpgroups


@triton.constexpr_function
def _ds_rows(warpgroups):
    """ΔS rows (query blocks of ``block_q``, a multiple of 128) a program's rows meet: 192 rows meet two."""
    return warpgroups - 1


@triton.constexpr_function
def _lane_dk_ring(causal, token_scales, warpgroups):
    """Whether per-thread groups (sage2) read their lane's δK from the ring rather than global memory: causal calls
    and the serial schedule (H200: the ring ran causal calls 1.02–1.04× as fast, non-causal ones 0.97–0.98×;
    the serial schedule 1.05× as fast)."""
    return (causal or warpgroups == SERIAL.value) and not token_scales


@triton.constexpr_function
def _lane_k_layout(lane7):
    """Layout of a lane's δK values ``(BLOCK_N / 64, 4)`` (span n, lane group g): ``lane7`` less its other dims."""
    return gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(4, gl.SliceLayout(6, lane7)))))


@gluon.jit
def _as_lane7(ks):
    """δK ``(BLOCK_N / 64, 4)`` in :func:`_lane_k_layout` as shape (1, 1, 1, BLOCK_N / 64, 1, 4, 1) in ``lane7``."""
    return gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(ks, 0), 1), 2), 4), 6)


@gluon.jit
def _lane_k_scale(KS_ptr, key0, lane7: gl.constexpr, BLOCK_N: gl.constexpr, valid=True):
    """δK of the keys each lane holds in the key block starting at ``key0``: shape (1, 1, 1, BLOCK_N / 64, 1, 4, 1)
    in ``lane7``, one load per 64-key span (key 2g of the span: every key a lane holds there is in its group)."""
    kl: gl.constexpr = _lane_k_layout(lane7)
    span = gl.arange(0, BLOCK_N // K_SPAN, layout=gl.SliceLayout(1, kl))
    g = gl.arange(0, 4, layout=gl.SliceLayout(0, kl))
    return _as_lane7(gl.load(KS_ptr + key0 + K_SPAN * span[:, None] + 2 * g[None, :], mask=valid, other=1.0))


@gluon.jit
def _lane_k_scale_ring(ks_smem, lane7: gl.constexpr, col_s: gl.constexpr, BLOCK_N: gl.constexpr):
    """:func:`_lane_k_scale` from the block's per-key scales ``ks_smem`` (BLOCK_N,), brought with K by TMA (causal
    calls). Each lane reads its score columns' scales and keeps key 64n + 2g of them: the reshape, permute and splits
    only rename registers, and ptxas loads the two values kept."""
    ks = gl.reshape(ks_smem.load(col_s), [BLOCK_N // K_SPAN, 2, 2, 2, 4, 2])  # key 64n + 32r₂ + 16r₁ + 8r₀ + 2g + b
    ks = gl.permute(ks, (0, 4, 1, 2, 3, 5))
    ks, _ = gl.split(ks)  # b = 0
    ks, _ = gl.split(ks)  # r₀ = 0
    ks, _ = gl.split(ks)  # r₁ = 0
    ks, _ = gl.split(ks)  # r₂ = 0
    return _as_lane7(gl.convert_layout(ks, _lane_k_layout(lane7)))


@gluon.jit
def _softmax_block(s_int, scale7, ds_smem, ks_smem, qk_scale, key0, m_i, l_i, last_key, max_done,
                   SIGNAL_MAX: gl.constexpr, BLOCK_N: gl.constexpr, SMOOTH_Q: gl.constexpr, TOKEN_SCALES: gl.constexpr,
                   PV_INT8: gl.constexpr, MASKED: gl.constexpr, col_s: gl.constexpr, row_s: gl.constexpr,
                   p_op: gl.constexpr):
    """Online softmax of the key block from ``key0`` on: S = (Q̂·K̂ᵀ) δQ δK (+ ΔS_raw) → P̃ = 2^((S − m)·qk_scale),
    P̂ = e4m3(448 P̃) (sage2) or rne(127 P̃) (``PV_INT8``, int8-flash).

    ``s_int (64, BLOCK_N)`` the int32 Q̂·K̂ᵀ (exact in fp32: |Q̂·K̂ᵀ| < 2²⁴). Per-thread groups: ``scale7`` δQ δK per
    lane (:func:`_lane_scale_shape`), one multiply-add an element with ΔS_raw = q̄·K_j, and ``qk_scale`` =
    log₂e/√d. ``TOKEN_SCALES``: S = (Q̂·K̂ᵀ) δK with δK ``(BLOCK_N,)`` from ``ks_smem`` (None: ``s_int`` is already
    the fp32 (Q̂·K̂ᵀ) δK), and δQ enters with ``qk_scale`` = δQ log₂e/√d ``(64,)`` a row. S, ``m_i`` and the
    returned max are raw scores (no ``qk_scale``, which enters through the exp2's multiply-add): ΔS_raw's row
    constant q̄·K̄ (the reference's ΔS is q̄·(K_j − K̄)) shifts a row's scores and its max alike, so P̃ and α are the
    reference's up to fp32 rounding.
    ``MASKED``: keys past ``last_key (64,)`` of each row are −inf (the tail, causal). ``SIGNAL_MAX``: arrive on the
    mbarrier ``max_done`` once the row max is known. Returns ``p_hat`` (the A operand of P̃·V), the rescale
    ``alpha (64,)`` of what came before, and the new running max and sum ℓ (in units of P_MAX; with ``PV_INT8``
    ℓ sums P̂, INT-FlashAttention's ℓ from the quantized P).
    """
    LOG2_PMAX: gl.constexpr = _log2_p_max(PV_INT8)
    s_mma: gl.constexpr = s_int.type.layout
    if TOKEN_SCALES:
        s = s_int.to(gl.float32)
        if ks_smem is not None:
            s = s * ks_smem.load(col_s)[None, :]
        row_scale = qk_scale[:, None]
    else:
        s7 = gl.reshape(s_int.to(gl.float32), _lane_scale_shape(BLOCK_N)) * scale7
        s = gl.convert_layout(gl.reshape(s7, [s_int.shape[0], BLOCK_N]), s_mma)  # same registers: no data movement
        row_scale = qk_scale
    if SMOOTH_Q:
        s = s + ds_smem.load(col_s)[None, :]
    if MASKED:
        keys = key0 + gl.arange(0, BLOCK_N, layout=col_s)
        s = gl.where(keys[None, :] <= last_key[:, None], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    if SIGNAL_MAX:
        mbarrier.arrive(max_done)
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2((m_i - m_safe) * qk_scale)
    p = gl.exp2(s * row_scale - (m_safe * qk_scale - LOG2_PMAX)[:, None])  # = P_MAX · P̃
    if PV_INT8:
        # P_MAX·P̃ ∈ [0, 127]: adding 1.5·2²³ puts rne(P_MAX·P̃) in the low bits (MAGIC_I's low byte is 0), and the
        # row sum of those words less BLOCK_N·MAGIC_I (exact in wrapping int32) is Σ P̂
        p_bits = (p + MAGIC_F).to(gl.int32, bitcast=True)
        p_hat = p_bits.to(gl.int8)
        l_i = l_i * alpha + (gl.sum(p_bits, 1) - _int32_wrapped(BLOCK_N * MAGIC_I)).to(gl.float32)
    else:
        p_hat = p.to(gl.float8e4nv)
        l_i = l_i * alpha + gl.sum(p, 1)
    return _pv_operand(p_hat, p_op), alpha, m_new, l_i


@gluon.jit
def _pv_operand(p_hat, p_op: gl.constexpr):
    """P̂ ``(rows, BLOCK_N)`` (8-bit, score accumulator layout) as the register A operand ``p_op`` of P̂·V."""
    # within each 32 keys, key k of the 8-bit A operand is the accumulator's column 16k₄+8k₁+4k₃+2k₂+k₀: this
    # reordering costs no data movement (the registers are already where the operand wants them), and Vᵀ's
    # keys are stored in the same order (wgmma_key_order), so P̂·V sums the same products
    rows: gl.constexpr = p_hat.shape[0]
    cols: gl.constexpr = p_hat.shape[1]
    p8 = gl.reshape(p_hat, [rows, cols // 32, 2, 2, 2, 2, 2])
    p8 = gl.reshape(gl.permute(p8, [0, 1, 2, 4, 5, 3, 6]), [rows, cols])
    return gl.convert_layout(p8, p_op)


@gluon.jit
def _publish(p_hat, p_smem):
    """P̃ (registers) into its shared-memory buffer, visible to the warpgroup's next wgmma (async proxy)."""
    p_smem.store(p_hat)
    hopper.fence_async_shared()
    cta_barrier()


@gluon.jit
def _section(j, WG: gl.constexpr, q_wg, p_s, k_s, ds_s, ks_s, v_s, k_ready, v_ready, kv_empty, turn, KS_ptr,
             k_row0, n_blocks, qs, ks_next, ks_after, qk_scale, m_i, l_i, alpha, acc, zero_s, zero_o,
             lane7: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SMOOTH_Q: gl.constexpr,
             TOKEN_SCALES: gl.constexpr, PV_INT8: gl.constexpr, LANE_DK_RING: gl.constexpr, col_s: gl.constexpr,
             row_s: gl.constexpr, row_o: gl.constexpr, p_op: gl.constexpr):
    """Section j + 1 of a consumer: Q·K_{j+1} and P̃_j·V_j on its turn, softmax j + 1 (unmasked) under P̃_j·V_j,
    then ``acc = α_j acc + P̃_j·V_j``; returns the carried state. Block j is the program's j-th
    (:func:`_key_block`). ``LANE_DK_RING``: per-thread groups read δK from the ring (causal calls), else two blocks
    ahead from global memory."""
    OTHER: gl.constexpr = 1 - WG
    buf = j % STAGES
    nbuf = (j + 1) % STAGES
    ks_cur = ks_next
    if not TOKEN_SCALES and not LANE_DK_RING:  # per-thread groups: this lane's δK two blocks ahead
        ks_next = ks_after
        ks_after = _lane_k_scale(KS_ptr, k_row0 + _key_block(j + 3, n_blocks) * BLOCK_N, lane7, BLOCK_N,
                                 j + 3 < n_blocks)
    mbarrier.wait(k_ready.index(nbuf), ((j + 1) // STAGES) & 1)
    mbarrier.wait(v_ready.index(buf), (j // STAGES) & 1)
    mbarrier.wait(turn.index(WG), ((j + 1) & 1) ^ OTHER)
    s_tok = hopper.warpgroup_mma(q_wg, k_s.index(nbuf).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    r_tok = hopper.warpgroup_mma(p_s.index(2 * WG + j % 2), v_s.index(buf).permute((1, 0)), zero_o, use_acc=False,
                                 is_async=True)
    mbarrier.arrive(turn.index(OTHER))
    if LANE_DK_RING:  # this lane's δK from the ring, while Q·K_{j+1} runs
        ks_cur = _lane_k_scale_ring(ks_s.index(nbuf), lane7, col_s, BLOCK_N)
    s_int = hopper.warpgroup_mma_wait(1, deps=[s_tok])
    p_hat, alpha_next, m_i, l_i = _softmax_block(s_int, qs * ks_cur, ds_s.index(nbuf), ks_s.index(nbuf), qk_scale,
                                                 _key_block(j + 1, n_blocks) * BLOCK_N, m_i, l_i, None,
                                                 None, False, BLOCK_N, SMOOTH_Q, TOKEN_SCALES, PV_INT8, False, col_s,
                                                 row_s, p_op)
    _publish(p_hat, p_s.index(2 * WG + (j + 1) % 2))  # the other buffer: P̃_j·V_j still reads this one
    r = hopper.warpgroup_mma_wait(0, deps=[r_tok])
    mbarrier.arrive(kv_empty.index(buf))  # K_j and V_j are done with: one arrival releases both
    acc = acc * gl.convert_layout(alpha, row_o)[:, None] + _block_pv(r)  # two-level: one block's P̂·V, then acc
    return m_i, l_i, alpha_next, acc, ks_next, ks_after


@gluon.jit
def _serial_block(j, WG: gl.constexpr, q_wg, p_wg, k_s, ds_s, ks_s, v_s, k_ready, v_ready, kv_empty, first_max, qs,
                  qk_scale, last_key, ds_row, n_blocks, m_i, l_i, acc, zero_s, zero_o, lane7: gl.constexpr,
                  BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SMOOTH_Q: gl.constexpr, TOKEN_SCALES: gl.constexpr,
                  PV_INT8: gl.constexpr, DS_ROWS: gl.constexpr, MASKED: gl.constexpr, col_s: gl.constexpr,
                  row_s: gl.constexpr, row_o: gl.constexpr, p_op: gl.constexpr):
    """Block j of a consumer of the serial schedule (three warpgroups): Q·K_j, softmax j (``MASKED``: the first
    block; warpgroup w > 0 starts it once w - 1 has its row max), P̂_j·V_j, ``acc = α_j acc + P̂_j·V_j``; the other
    warpgroups' work covers each wait. δK (per-thread groups) and ΔS row ``ds_row`` come from the ring."""
    buf = j % STAGES
    mbarrier.wait(k_ready.index(buf), (j // STAGES) & 1)
    if MASKED and WG > 0:
        mbarrier.wait(first_max.index(WG - 1), 0)
    s_tok = hopper.warpgroup_mma(q_wg, k_s.index(buf).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    scale = qs
    if not TOKEN_SCALES:
        scale = qs * _lane_k_scale_ring(ks_s.index(buf), lane7, col_s, BLOCK_N)
    SIGNAL_MAX: gl.constexpr = MASKED and WG < SERIAL - 1  # the last warpgroup's row max starts no one
    max_done = None
    if SIGNAL_MAX:
        max_done = first_max.index(WG)
    s_int = hopper.warpgroup_mma_wait(0, deps=[s_tok])
    p_hat, alpha, m_i, l_i = _softmax_block(s_int, scale, ds_s.index(DS_ROWS * buf + ds_row), ks_s.index(buf),
                                            qk_scale, _key_block(j, n_blocks) * BLOCK_N, m_i, l_i, last_key, max_done,
                                            SIGNAL_MAX, BLOCK_N, SMOOTH_Q, TOKEN_SCALES, PV_INT8, MASKED, col_s,
                                            row_s, p_op)
    _publish(p_hat, p_wg)
    mbarrier.wait(v_ready.index(buf), (j // STAGES) & 1)
    r_tok = hopper.warpgroup_mma(p_wg, v_s.index(buf).permute((1, 0)), zero_o, use_acc=False, is_async=True)
    r = hopper.warpgroup_mma_wait(0, deps=[r_tok])
    mbarrier.arrive(kv_empty.index(buf))
    return m_i, l_i, acc * gl.convert_layout(alpha, row_o)[:, None] + _block_pv(r)


@gluon.jit
def _block_pv(r):
    """A block's P̂·V̂ as fp32: the FP8 wgmma's already, the INT8 one's int32 converted (exact: |R| ≤ 127²·BLOCK_N
    < 2²⁴)."""
    if r.dtype == gl.int32:
        r = r.to(gl.float32)
    return r


@gluon.jit
def _pingpong_loop(WG: gl.constexpr, q_wg, p_s, k_s, ds_s, ks_s, v_s, k_ready, v_ready, kv_empty, turn, first_max,
                   KS_ptr, k_row0, qs, qk_scale, last_key, n_blocks, zero_s, zero_o, lane7: gl.constexpr,
                   BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, SMOOTH_Q: gl.constexpr,
                   TOKEN_SCALES: gl.constexpr, PV_INT8: gl.constexpr, CAUSAL: gl.constexpr, col_s: gl.constexpr,
                   row_s: gl.constexpr, row_o: gl.constexpr, o_mma: gl.constexpr, p_op: gl.constexpr):
    """The two-warpgroup schedule of consumer ``WG`` (module docstring): its running max, ℓ and accumulator after
    the program's ``n_blocks`` key blocks."""
    OTHER: gl.constexpr = 1 - WG
    # section 0: Q·K_0, softmax 0 (causal: the masked diagonal block)
    mbarrier.wait(k_ready.index(0), 0)
    if WG == 1:  # warpgroup 1 starts once warpgroup 0 has its first row max (module docstring)
        mbarrier.wait(first_max.index(0), 0)
    mbarrier.wait(turn.index(WG), OTHER)  # warpgroup 0 first (a fresh barrier passes parity 1)
    s_tok = hopper.warpgroup_mma(q_wg, k_s.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    mbarrier.arrive(turn.index(OTHER))
    s_int = hopper.warpgroup_mma_wait(0, deps=[s_tok])
    m_i = gl.full([WG_ROWS], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([WG_ROWS], gl.float32, layout=row_s)
    key0 = _key_block(0, n_blocks) * BLOCK_N
    LANE_DK_RING: gl.constexpr = _lane_dk_ring(CAUSAL, TOKEN_SCALES, 2)
    if LANE_DK_RING:
        scale = qs * _lane_k_scale_ring(ks_s.index(0), lane7, col_s, BLOCK_N)
    else:
        scale = qs * _lane_k_scale(KS_ptr, k_row0 + key0, lane7, BLOCK_N)
    p_hat, alpha, m_i, l_i = _softmax_block(s_int, scale, ds_s.index(0), ks_s.index(0), qk_scale, key0, m_i, l_i,
                                            last_key, first_max.index(0), WG == 0, BLOCK_N, SMOOTH_Q, TOKEN_SCALES,
                                            PV_INT8, True, col_s, row_s, p_op)
    _publish(p_hat, p_s.index(2 * WG))
    acc = gl.zeros([WG_ROWS, HEAD_DIM], gl.float32, layout=o_mma)
    ks_next = scale  # δK two blocks ahead (unused with LANE_DK_RING)
    ks_after = scale
    if not LANE_DK_RING:
        ks_next = _lane_k_scale(KS_ptr, k_row0 + _key_block(1, n_blocks) * BLOCK_N, lane7, BLOCK_N, 1 < n_blocks)
        ks_after = _lane_k_scale(KS_ptr, k_row0 + _key_block(2, n_blocks) * BLOCK_N, lane7, BLOCK_N, 2 < n_blocks)
    # sections 1 … n_blocks - 1 see only keys every row of the program may attend
    for j in range(n_blocks - 1):
        m_i, l_i, alpha, acc, ks_next, ks_after = _section(
            j, WG, q_wg, p_s, k_s, ds_s, ks_s, v_s, k_ready, v_ready, kv_empty, turn, KS_ptr, k_row0, n_blocks, qs,
            ks_next, ks_after, qk_scale, m_i, l_i, alpha, acc, zero_s, zero_o, lane7,
            BLOCK_N, STAGES, SMOOTH_Q, TOKEN_SCALES, PV_INT8, LANE_DK_RING, col_s, row_s, row_o, p_op)
    # section n_blocks: P̂·V of the last block
    last = (n_blocks - 1) % STAGES
    mbarrier.wait(v_ready.index(last), ((n_blocks - 1) // STAGES) & 1)
    mbarrier.wait(turn.index(WG), (n_blocks & 1) ^ OTHER)
    r_tok = hopper.warpgroup_mma(p_s.index(2 * WG + (n_blocks - 1) % 2), v_s.index(last).permute((1, 0)), zero_o,
                                 use_acc=False, is_async=True)
    mbarrier.arrive(turn.index(OTHER))
    r = hopper.warpgroup_mma_wait(0, deps=[r_tok])
    acc = acc * gl.convert_layout(alpha, row_o)[:, None] + _block_pv(r)
    return m_i, l_i, acc


@gluon.jit
def _serial_loop(WG: gl.constexpr, q_wg, p_wg, k_s, ds_s, ks_s, v_s, k_ready, v_ready, kv_empty, first_max, qs,
                 qk_scale, last_key, ds_row, n_blocks, zero_s, zero_o, lane7: gl.constexpr, BLOCK_N: gl.constexpr,
                 HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, SMOOTH_Q: gl.constexpr, TOKEN_SCALES: gl.constexpr,
                 PV_INT8: gl.constexpr, col_s: gl.constexpr, row_s: gl.constexpr, row_o: gl.constexpr,
                 o_mma: gl.constexpr, p_op: gl.constexpr):
    """The three-warpgroup schedule of consumer ``WG`` (module docstring), :func:`_serial_block` over the program's
    ``n_blocks`` key blocks (the first masked); ``ds_row``: which of the stage's ΔS rows is this warpgroup's."""
    DS_ROWS: gl.constexpr = _ds_rows(SERIAL)
    m_i = gl.full([WG_ROWS], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([WG_ROWS], gl.float32, layout=row_s)
    acc = gl.zeros([WG_ROWS, HEAD_DIM], gl.float32, layout=o_mma)
    m_i, l_i, acc = _serial_block(0, WG, q_wg, p_wg, k_s, ds_s, ks_s, v_s, k_ready, v_ready, kv_empty, first_max, qs,
                                  qk_scale, last_key, ds_row, n_blocks, m_i, l_i, acc, zero_s, zero_o, lane7, BLOCK_N,
                                  STAGES, SMOOTH_Q, TOKEN_SCALES, PV_INT8, DS_ROWS, True, col_s, row_s, row_o, p_op)
    for j in range(1, n_blocks):
        m_i, l_i, acc = _serial_block(j, WG, q_wg, p_wg, k_s, ds_s, ks_s, v_s, k_ready, v_ready, kv_empty, first_max,
                                      qs, qk_scale, last_key, ds_row, n_blocks, m_i, l_i, acc, zero_s, zero_o, lane7,
                                      BLOCK_N, STAGES, SMOOTH_Q, TOKEN_SCALES, PV_INT8, DS_ROWS, False, col_s, row_s,
                                      row_o, p_op)
    return m_i, l_i, acc


@gluon.jit
def _store_output(acc, l_i, VS_ptr, VM_ptr, O_ptr, bh_kv, b, h, r0, stride_ob, stride_oh, stride_om, NQ,
                  HEAD_DIM: gl.constexpr, WG_ROWS: gl.constexpr, SMOOTH_V: gl.constexpr, V_TENSOR: gl.constexpr,
                  col_o: gl.constexpr, row_o: gl.constexpr):
    """The epilogue of a warpgroup's rows ``r0 ...``: O = acc·δV / ℓ (+ mean V), 0 for rows that saw no key; returns
    the head-dim offsets (``col_o``). ``acc`` is in units of P_MAX·V̂ and ℓ in units of P_MAX: the two cancel. δV:
    one scale (``V_TENSOR``) or one a channel."""
    d_o = gl.arange(0, HEAD_DIM, layout=col_o)
    if V_TENSOR:
        out = acc * gl.load(VS_ptr)
    else:
        out = acc * gl.load(VS_ptr + bh_kv * HEAD_DIM + d_o)[None, :]
    l_o = gl.convert_layout(l_i, row_o)
    empty = l_o == 0.0
    out = out / gl.where(empty, 1.0, l_o)[:, None]
    if SMOOTH_V:
        out += gl.load(VM_ptr + bh_kv * HEAD_DIM + d_o)[None, :]
    out = gl.where(empty[:, None], 0.0, out)
    rows_o = r0 + gl.arange(0, WG_ROWS, layout=row_o)
    o_ptrs = O_ptr + b.to(gl.int64) * stride_ob + h * stride_oh + rows_o[:, None] * stride_om + d_o[None, :]
    gl.store(o_ptrs, out.to(O_ptr.dtype.element_ty), mask=rows_o[:, None] < NQ)
    return d_o


@gluon.jit
def _store_lse(m_i, l_i, qk_scale, LSE_ptr, pid_bh, rows, NQ, LOG2_PMAX: gl.constexpr):
    """The natural-log LSE of ``rows`` from the running max ``m_i`` (raw score units) and ℓ (units of P_MAX);
    −inf for rows that saw no key."""
    l_e = gl.where(l_i == 0.0, 1.0, l_i)
    lse = (m_i * qk_scale + gl.log2(l_e) - LOG2_PMAX) * 0.6931471805599453
    lse = gl.where(l_i == 0.0, float("-inf"), lse)
    gl.store(LSE_ptr + pid_bh.to(gl.int64) * NQ + rows, lse, mask=rows < NQ)


@gluon.jit
def _warpgroup_rows(r0, NQ, NK, QS_ptr, pid_bh, qk_scale, row_s: gl.constexpr, lane7: gl.constexpr,
                    CAUSAL: gl.constexpr, TOKEN_SCALES: gl.constexpr):
    """A warpgroup's query rows ``r0 … r0 + 63``: their indices ``(64,)``, the last key each attends (bottom-right
    aligned where ``CAUSAL``), δQ of each lane's rows (16w + i; 16w + 8 + i shares it) shaped (4, 1, 8, 1, 1, 1, 1)
    in ``lane7`` (per-thread groups), and the softmax scale: ``qk_scale``, or with ``TOKEN_SCALES`` each row's δQ
    times it ``(64,)`` (it enters with the exp2's multiply-add, :func:`_softmax_block`)."""
    rows = r0 + gl.arange(0, WG_ROWS, layout=row_s)
    if CAUSAL:  # row r attends keys ≤ r + Nk - Nq
        last_key = gl.minimum(rows + (NK - NQ), NK - 1)
    else:
        last_key = gl.full([WG_ROWS], NK - 1, gl.int32, layout=row_s)
    ql: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(4, gl.SliceLayout(5,
                                      gl.SliceLayout(6, lane7)))))  # dims (0, 2): warp w, lane row i
    q_rows = (r0 + 16 * gl.arange(0, 4, layout=gl.SliceLayout(1, ql))[:, None]
              + gl.arange(0, 8, layout=gl.SliceLayout(0, ql))[None, :])
    qs = gl.load(QS_ptr + pid_bh.to(gl.int64) * NQ + q_rows, mask=q_rows < NQ, other=0.0)
    qs = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(qs, 1), 3), 4), 5), 6)
    if TOKEN_SCALES:
        qk_scale = gl.load(QS_ptr + pid_bh.to(gl.int64) * NQ + rows, mask=rows < NQ, other=1.0) * qk_scale
    return rows, last_key, qs, qk_scale


@gluon.jit
def _consumer(WG: gl.constexpr, shared, tensors, where, config: gl.constexpr):
    """Consumer warpgroup ``WG`` (of ``WARPGROUPS``): query rows ``m0 + 64 WG …`` over the program's ``n_blocks`` key
    blocks (module docstring; causal: the diagonal block first, masked), then its rows of O (and LSE). The kernel
    passes its shared-memory buffers, tensors, program coordinates and configuration as four tuples."""
    q_s, p_s, k_s, ds_s, ks_s, v_s, k_ready, v_ready, kv_empty, turn, first_max = shared
    QS_ptr, KS_ptr, QM_ptr, KM_ptr, VS_ptr, VM_ptr, O_ptr, LSE_ptr, stride_ob, stride_oh, stride_om = tensors
    pid_bh, b, h, bh_kv, m0, k_row0, n_blocks, NQ, NK, NQB, qk_scale = where
    BLOCK_N: gl.constexpr = config.BLOCK_N
    HEAD_DIM: gl.constexpr = config.HEAD_DIM
    Q_BLOCK: gl.constexpr = config.Q_BLOCK
    STAGES: gl.constexpr = config.STAGES
    SMOOTH_Q: gl.constexpr = config.SMOOTH_Q
    SMOOTH_K: gl.constexpr = config.SMOOTH_K
    SMOOTH_V: gl.constexpr = config.SMOOTH_V
    RETURN_LSE: gl.constexpr = config.RETURN_LSE
    TOKEN_SCALES: gl.constexpr = config.TOKEN_SCALES
    PV_INT8: gl.constexpr = config.PV_INT8
    CAUSAL: gl.constexpr = config.CAUSAL
    WARPGROUPS: gl.constexpr = config.WARPGROUPS
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
    r0 = m0 + WG * WG_ROWS
    lane7: gl.constexpr = gl.reshape(gl.zeros([WG_ROWS, BLOCK_N], gl.float32, layout=s_mma),
                                     _lane_scale_shape(BLOCK_N)).type.layout
    rows, last_key, qs, qk_scale = _warpgroup_rows(r0, NQ, NK, QS_ptr, pid_bh, qk_scale, row_s, lane7, CAUSAL,
                                                   TOKEN_SCALES)
    q_wg = q_s.index(WG)
    zero_s = gl.zeros([WG_ROWS, BLOCK_N], gl.int32, layout=s_mma)
    zero_o = gl.zeros([WG_ROWS, HEAD_DIM], gl.int32 if PV_INT8 else gl.float32, layout=o_mma)

    if WARPGROUPS == SERIAL:
        m_i, l_i, acc = _serial_loop(WG, q_wg, p_s.index(WG), k_s, ds_s, ks_s, v_s, k_ready, v_ready, kv_empty,
                                     first_max, qs, qk_scale, last_key, r0 // Q_BLOCK - m0 // Q_BLOCK, n_blocks, zero_s,
                                     zero_o, lane7, BLOCK_N, HEAD_DIM, STAGES, SMOOTH_Q, TOKEN_SCALES, PV_INT8, col_s,
                                     row_s, row_o, o_mma, p_op)
    else:
        m_i, l_i, acc = _pingpong_loop(WG, q_wg, p_s, k_s, ds_s, ks_s, v_s, k_ready, v_ready, kv_empty, turn,
                                       first_max, KS_ptr, k_row0, qs, qk_scale, last_key, n_blocks, zero_s, zero_o,
                                       lane7, BLOCK_N, HEAD_DIM, STAGES, SMOOTH_Q, TOKEN_SCALES, PV_INT8, CAUSAL,
                                       col_s, row_s, row_o, o_mma, p_op)

    d_o = _store_output(acc, l_i, VS_ptr, VM_ptr, O_ptr, bh_kv, b, h, r0, stride_ob, stride_oh, stride_om, NQ,
                        HEAD_DIM, WG_ROWS, SMOOTH_V, PV_INT8, col_o, row_o)
    if RETURN_LSE:
        ds_shift = 0.0  # the row constant q̄·K̄ that ΔS_raw holds and the reference's ΔS does not
        if SMOOTH_Q:
            if SMOOTH_K:
                qm = gl.load(QM_ptr + (pid_bh * NQB + r0 // Q_BLOCK) * HEAD_DIM + d_o)
                ds_shift = gl.sum(qm * gl.load(KM_ptr + bh_kv * HEAD_DIM + d_o), 0)
        _store_lse(m_i - ds_shift, l_i, qk_scale, LSE_ptr, pid_bh, rows, NQ, LOG2_PMAX)


@gluon.jit
def _attn_qk_int8_fwd_gluon(
    Q_ptr, k_desc, vt_desc, ds_desc, ks_desc, QS_ptr, KS_ptr, QM_ptr, KM_ptr, VS_ptr, VM_ptr, O_ptr, LSE_ptr,
    stride_ob, stride_oh, stride_om,
    NQ, NK, NK_PAD, H, GROUP, NQB, qk_scale,
    HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, Q_BLOCK: gl.constexpr,
    SMOOTH_Q: gl.constexpr, SMOOTH_K: gl.constexpr, SMOOTH_V: gl.constexpr, RETURN_LSE: gl.constexpr,
    STAGES: gl.constexpr, TOKEN_SCALES: gl.constexpr, PV_INT8: gl.constexpr, CAUSAL: gl.constexpr,
    WARPGROUPS: gl.constexpr,
):
    """Program ``(q block of 64 · WARPGROUPS rows, b·H + h)`` (causal: the last q block first, it has the most keys);
    launched with 4 warps (consumer 0), the other consumers (4 warps each) and the producer (1 warp) are the worker
    partitions."""
    ld: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[4, 8], warps_per_cta=[4, 1],
                                        order=[1, 0])
    pid_m = gl.program_id(0)
    if CAUSAL:
        pid_m = gl.num_programs(0) - 1 - pid_m
    pid_bh = gl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    bh_kv = b * (H // GROUP) + h // GROUP
    m0 = pid_m * (WARPGROUPS * WG_ROWS)

    # the program's Q tile (int8) into shared memory once, a warpgroup's rows apiece
    d_ld = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ld))
    q_s = gl.allocate_shared_memory(gl.int8, [WARPGROUPS, WG_ROWS, HEAD_DIM], k_desc.layout)
    for i in gl.static_range(WARPGROUPS):
        rows_ld = m0 + i * WG_ROWS + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, ld))
        q_s.index(i).store(gl.load(Q_ptr + (pid_bh.to(gl.int64) * NQ + rows_ld[:, None]) * HEAD_DIM + d_ld[None, :],
                                   mask=rows_ld[:, None] < NQ, other=0))

    k_row0 = bh_kv * NK_PAD  # key 0 of this kv head in the (B·Hkv·Nk_pad, D) view and the flat K scales
    v_row0 = bh_kv * HEAD_DIM  # channel 0 in the (B·Hkv·D, Nk_pad) view
    ds_row0 = (pid_bh * NQB + m0 // Q_BLOCK) * NK_PAD  # the first q block's ΔS row (flat)
    ds_step = gl.where(m0 // Q_BLOCK + 1 < NQB, NK_PAD, 0)  # to the next one's (three warpgroups: the rows meet two)

    # per stage a "ready" mbarrier for K and one for Vᵀ (TMA bytes landed), and an "empty" one (every consumer is
    # done with the block: K is held past its use, so that one arrival releases K and V)
    DS_ROWS: gl.constexpr = _ds_rows(WARPGROUPS)
    k_s = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    ds_s = gl.allocate_shared_memory(gl.float32, [DS_ROWS * STAGES, BLOCK_N], ds_desc.layout)
    ks_s = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N], ks_desc.layout)
    v_s = gl.allocate_shared_memory(vt_desc.dtype, [STAGES, HEAD_DIM, BLOCK_N], vt_desc.layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    first_max = gl.allocate_shared_memory(gl.int64, [WARPGROUPS - 1, 1], mbarrier.MBarrierLayout())
    p_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(128, BLOCK_N), element_bitwidth=8, rank=2)
    p_s = gl.allocate_shared_memory(vt_desc.dtype, [_p_buffers(WARPGROUPS), WG_ROWS, BLOCK_N], p_layout)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=WARPGROUPS)  # one arrival a consumer
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    for i in gl.static_range(WARPGROUPS - 1):
        mbarrier.init(first_max.index(i), count=1)
    hopper.fence_async_shared()  # Q tile and barrier inits before the async proxy reads them

    n_blocks = NK_PAD // BLOCK_N
    if CAUSAL:  # row r attends keys ≤ r + Nk - Nq, with Nk - Nq a multiple of BLOCK_N (the launcher checks): every
        # row of the program sees all keys before block (m0 + Nk - Nq) / BLOCK_N, the diagonal one and its last
        n_blocks = gl.minimum(gl.maximum(gl.cdiv(m0 + WARPGROUPS * WG_ROWS + NK - NQ, BLOCK_N), 1), n_blocks)
    shared = (q_s, p_s, k_s, ds_s, ks_s, v_s, k_ready, v_ready, kv_empty, turn, first_max)
    tensors = (QS_ptr, KS_ptr, QM_ptr, KM_ptr, VS_ptr, VM_ptr, O_ptr, LSE_ptr, stride_ob, stride_oh, stride_om)
    where = (pid_bh, b, h, bh_kv, m0, k_row0, n_blocks, NQ, NK, NQB, qk_scale)
    config: gl.constexpr = _pack(BLOCK_N, HEAD_DIM, Q_BLOCK, STAGES, SMOOTH_Q, SMOOTH_K, SMOOTH_V, RETURN_LSE,
                                 TOKEN_SCALES, PV_INT8, CAUSAL, WARPGROUPS)
    producer = (k_desc, ds_desc, ks_desc, vt_desc, k_s, ds_s, ks_s, v_s, k_ready, v_ready, kv_empty, k_row0, ds_row0,
                ds_step, v_row0, n_blocks)
    REGS: gl.constexpr = _consumer_regs(WARPGROUPS)
    if WARPGROUPS == SERIAL:
        gl.warp_specialize([(_consumer, (0, shared, tensors, where, config)),
                            (_consumer, (1, shared, tensors, where, config)),
                            (_consumer, (2, shared, tensors, where, config)), (_kv_producer, (producer, config))],
                           [4, 4, 1], [REGS, REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([(_consumer, (0, shared, tensors, where, config)),
                            (_consumer, (1, shared, tensors, where, config)), (_kv_producer, (producer, config))],
                           [4, 1], [REGS, PRODUCER_REGS])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_ready.index(i))
        mbarrier.invalidate(v_ready.index(i))
        mbarrier.invalidate(kv_empty.index(i))
    for i in gl.static_range(2):
        mbarrier.invalidate(turn.index(i))
    for i in gl.static_range(WARPGROUPS - 1):
        mbarrier.invalidate(first_max.index(i))


_LAUNCH = LaunchPlans(_attn_qk_int8_fwd_gluon)  # later calls of a shape skip JITFunction.run's host work


def wgmma_key_order(n: int, device: torch.device) -> torch.Tensor:
    """Key permutation (n,) (a multiple of 32) that puts the FP8 P̃·V operand in the score accumulator's
    register order: position 32g + k holds key 32g + 16k₄ + 8k₁ + 4k₃ + 2k₂ + k₀."""
    k = torch.arange(32, device=device)
    bit = [(k >> i) & 1 for i in range(5)]
    col = 16 * bit[4] + 8 * bit[1] + 4 * bit[3] + 2 * bit[2] + bit[0]
    return (torch.arange(0, n, 32, device=device)[:, None] + col[None, :]).reshape(-1)


def check_operand_formats(x: QuantizedQKV, qk_granularity: str, launcher: str) -> bool:
    """The operand formats both Gluon attention kernels compute, checked for ``launcher``: INT8 Q/K with FP8 V and
    per-channel V scales (sage2) or INT8 V and one V scale (int8-flash), per-thread or per-token Q/K scales. Returns
    whether P̂·V is INT8 (int8-flash)."""
    pv_int8 = x.v_hat_t.dtype == torch.int8
    v_ok = x.v_scale.numel() == 1 if pv_int8 else x.v_hat_t.dtype == torch.float8_e4m3fn and x.v_scale.dim() == 3
    if x.q_hat.dtype != torch.int8 or not v_ok:
        raise ValueError(f"{launcher} takes INT8 Q/K with FP8 V and per-channel V scales (sage2) or INT8 V and one V "
                         "scale (int8-flash)")
    if qk_granularity not in ("thread", "token"):
        raise ValueError(f"qk_granularity={qk_granularity!r}: the kernel reads per-thread or per-token scales")
    return pv_int8


def permute_v_keys(v_hat_t: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """``v_hat_t (B, Hkv, D, Nk_pad)`` FP8 with its keys in :func:`wgmma_key_order` (the kernel's Vᵀ; what
    ``quantize_qkv(..., v_key_order=True)`` writes), or back (``inverse``). A gather pass: tests and fallbacks."""
    order = wgmma_key_order(v_hat_t.shape[-1], v_hat_t.device)
    if inverse:
        order = torch.argsort(order)
    return v_hat_t.view(torch.uint8).index_select(-1, order).view(v_hat_t.dtype)


def attn_qk_int8_gluon(
    x: QuantizedQKV,
    nk: int,
    *,
    qk_granularity: str = "thread",
    is_causal: bool = False,
    sm_scale: float | None = None,
    return_lse: bool = False,
    out_dtype: torch.dtype = torch.bfloat16,
    block_q: int = 128,
    block_n: int = 128,
    stages: int | None = None,
    warpgroups: int | None = None,
    v_keys_permuted: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """sage2 or int8-flash attention (causal: bottom-right aligned, as the reference, with Nk - Nq a multiple of
    :data:`BLOCK_M`) over :func:`~quantpatch.kernels.attention.qk_quant_triton.quantize_qkv` operands. INT8 Q/K; the V
    operand picks P̂·V, as in the Triton kernel: FP8 V with per-channel scales → P̂ = e4m3(448 P̃) (sage2), INT8 V
    with one scale → P̂ = rne(127 P̃) and ℓ from P̂ (int8-flash).

    ``qk_granularity``: how Q/K were quantized. ``"thread"``: SageAttention2's per-thread groups (``block_q / warps``
    a multiple of 16, ``block_k`` of 64: :data:`K_SPAN`; ``fast_paths.gluon_takes`` checks it), which the kernel
    reads as one δQ·δK a lane; ``"token"``: one scale a token (int8-flash), δK brought with K by TMA.

    ``warpgroups``: consumer warpgroups of a program, 2 (the ping-pong schedule, 128 query rows) or 3 (the serial
    one, 192 rows, non-causal only); by default 3 for int8-flash's non-causal calls and 2 for the rest (module
    docstring). ``stages``: depth of the K/Vᵀ ring, by default 3 with two warpgroups (1.02 / 1.04 / 1.05× as fast as
    4 at 8k / 16k / 32k keys, as fast at 2k–4k; 2: 0.72–0.75×, 5: slower than 4; H200) and 4 with three
    (int8-flash 1.01–1.02× as fast as 3 at 2k–16k; H200).
    ``v_keys_permuted``: ``x.v_hat_t`` with its keys in :func:`wgmma_key_order` if the caller has it
    (``quantize_qkv(..., v_key_order=True)``); else :func:`permute_v_keys` makes it here (an extra pass).
    Returns ``o (B, H, Nq, D)`` in ``out_dtype`` and ``lse (B, H, Nq)`` (empty unless asked), as
    :func:`~quantpatch.kernels.attention.quant_attn_triton.attn_qk_int8_pv_fp8`.
    """
    b, h, nq, d = x.q_hat.shape
    hkv, nk_pad = x.k_hat.shape[1], x.k_hat.shape[2]
    pv_int8 = check_operand_formats(x, qk_granularity, "attn_qk_int8_gluon")
    if nk_pad % block_n or block_q % BLOCK_M:
        raise ValueError(f"Nk_pad={nk_pad} must be a multiple of block_n={block_n}, block_q={block_q} of {BLOCK_M}")
    if warpgroups is None:
        warpgroups = SERIAL.value if pv_int8 and not is_causal else 2
    if warpgroups not in (2, SERIAL.value) or (warpgroups == SERIAL.value and is_causal):
        raise ValueError(f"warpgroups={warpgroups}: 2, or {SERIAL.value} for non-causal calls (a causal program's "
                         "diagonal must be one key block)")
    if stages is None:
        stages = 4 if warpgroups == SERIAL.value else 3
    if is_causal and ((nk - nq) % BLOCK_M or block_n != BLOCK_M):
        raise ValueError(f"causal calls need Nk - Nq (= {nk - nq}) a multiple of {BLOCK_M} and block_n={BLOCK_M}: "
                         "the diagonal must be one key block of each program")
    if x.delta_s.numel() >= 2**31:
        raise ValueError("ΔS too large for 32-bit TMA coordinates")
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    o = torch.empty((b, h, nq, d), device=x.q_hat.device, dtype=out_dtype)
    lse = torch.empty((b, h, nq) if return_lse else (0,), device=o.device, dtype=torch.float32)
    smooth_q = x.delta_s.numel() > 0
    v_t = permute_v_keys(x.v_hat_t) if v_keys_permuted is None else v_keys_permuted
    k_layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    v_layout = gl.NVMMASharedLayout(swizzle_byte_width=min(128, block_n), element_bitwidth=8, rank=2)
    vec_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
    k_desc = TensorDescriptor.from_tensor(x.k_hat.view(b * hkv * nk_pad, d), [block_n, d], k_layout)
    vt_desc = TensorDescriptor.from_tensor(v_t.view(b * hkv * d, nk_pad), [d, block_n], v_layout)
    ks_desc = TensorDescriptor.from_tensor(x.k_scale.view(-1), [block_n], vec_layout)
    ds_desc = TensorDescriptor.from_tensor(x.delta_s.view(-1), [block_n], vec_layout) if smooth_q else ks_desc
    _LAUNCH(
        (cdiv(nq, warpgroups * WG_ROWS.value), b * h),
        (x.q_hat, k_desc, vt_desc, ds_desc, ks_desc, x.q_scale, x.k_scale, x.q_mean, x.k_mean, x.v_scale, x.v_mean, o,
         lse,
         o.stride(0), o.stride(1), o.stride(2),
         nq, nk, nk_pad, h, h // hkv, x.delta_s.shape[2] if smooth_q else 1, scale * LOG2E),
        dict(HEAD_DIM=d, BLOCK_N=block_n, Q_BLOCK=block_q,
             SMOOTH_Q=smooth_q, SMOOTH_K=x.k_mean.numel() > 0, SMOOTH_V=x.v_mean.numel() > 0, RETURN_LSE=return_lse,
             STAGES=stages, TOKEN_SCALES=qk_granularity == "token", PV_INT8=pv_int8, CAUSAL=is_causal,
             WARPGROUPS=warpgroups),
        num_warps=4,
    )
    return o, lse
