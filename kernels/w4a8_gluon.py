"""W4A8 decode GEMM (M ≤ 16 tokens) in Gluon (Triton 3.6+, sm_90): the weights as wgmma's register operand.

Same numerics as the Triton decode kernel (:func:`quantpatch.kernels.w4a8_triton._decode_consumer`, ``swap``):
per 128-group ``g`` two fp16 tensor-core dots with an fp32 accumulator (low nibbles × even input channels,
high nibbles × odd ones; operands fp16 holds exactly: INT4 −8…7 and e4m3 values), the group's partial times
its e4m3 scale σ added to an fp32 accumulator, split-K runs summed in a fixed order by the last run to
arrive, then ``(acc ⊙ β) · 2⁻ⁿ + bias``. Activations: the numerics of
:func:`~quantpatch.kernels.w4a8_triton.quantize_activation_fp8` (bit-exact with the reference), computed by
the first M programs of the same launch where a row fits one ``DECODE_QBLOCK`` load (:func:`w4a8_linear_gluon`:
the layer, which ``w4a8_triton.w4a8_linear_2d`` runs for M ≤ 16 on sm_90).

Design (swap AB, one warpgroup per program, ``yᵀ = ŵ x̂ᵀ``)::

    programs 0…M-1 (fused): token m → x̂, β (workspace) → flag += 1 (release)
    program (tile t, run r): 64 output channels × a run of CHUNKS · GPC groups of K, a chunk of GPC at a time
      ld.global.v4  the chunk's packed weights [64, GPC·64] bytes straight into registers, all in flight at once
                    (per group 16 contiguous bytes a thread, rows r and r + 8 of the wgmma fragment); σ loads
      (fused, first chunk: wait until the flag counts M tokens, acquire)
      x̂ of the chunk (int16 pairs); the next chunk's weights, σ and x̂ requested before this one is computed
      x̂ᵀ   of the chunk's channels → fp16 → shared memory (wgmma's B operand, [64, BM] per group and parity)
      per group: the group's registers
                 → INT4 → fp16 pairs by PTX bit tricks (prmt, lop3, sub/fma.f16x2), already in wgmma's
                   A-operand registers: the group's input channels are relabelled so that the bytes a thread
                   holds are exactly its fragment's K slots, and x̂ᵀ's rows are stored in the same order
                 → 2 async wgmma m64nBMk16 × 4 (even, odd), group g's retired while g + 1 is unpacked
                 → acc += part · σ_g   (over the run's groups in order, whatever the chunking)

The weights never touch shared memory (no TMA, no host tensor descriptor, no ``local_alloc`` round trip). A
run of one chunk (CHUNKS = 1) has all its weight bytes requested before it computes anything; longer runs of
small chunks (:func:`default_run`) need fewer programs and fewer split-K partials, a chunk's loads overlapping
the chunk before. Host side: a launch plan per shape
(:func:`_launch`) calls the compiled kernel's launcher directly after the first call.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper

from .compiled_launch import cdiv, next_pow2, relaunch
from .w4a8_ref import GROUP_SIZE
from .w4a8_triton import (
    _SCRATCH,
    DECODE_QBLOCK,
    _bf16_rne,
    _check_operands,
    _scratch,
    _stream_key,
    _x_hat_scratch,
    quantize_activation_fp8,
)

# the CTA barrier: gl.thread_barrier in Triton 3.6, gl.barrier from 3.7 on (both a plain bar.sync)
_cta_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
BLOCK_N = gl.constexpr(64)  # output channels per program: wgmma's M
HALF = gl.constexpr(GROUP_SIZE // 2)  # bytes of one group of one output channel
MAX_TOKENS = 16  # wgmma's N at most here
DEFAULT_GPC = 2  # groups per chunk (loaded while the chunk before is computed; 4 and 8 spill at longer runs)
MAX_GPC = 8  # registers: a chunk's weights take GPC × 8 a thread, twice (this chunk's and the next)
PROGRAMS_PER_SM = 2  # default runs: no more GEMM programs than this an SM (one wave)
SHORT_RUN = 8  # groups of the default run in one chunk, where such runs fit one wave

# INT4 pairs → fp16 pairs. In: 4 packed bytes b0..b3 ($4). Out: low nibbles of b0..b3 as fp16 ($0 = b0, b1;
# $1 = b2, b3), high nibbles likewise ($2, $3). prmt spreads two bytes over the two halves of a word;
# lop3 (a & b) ^ c (LUT 0x6A) keeps a nibble, flips its sign bit (offset binary) and ORs in the fp16 1024:
# low: 1024 + (v ^ 8) − 1032 = v; high: (1024 + 16 (v ^ 8)) / 16 − 72 = v. All exact in fp16.
_UNPACK_ASM = gl.constexpr("""{
.reg .b32 t0, t1, u0, u1, u2, u3, m, s, o;
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
lop3.b32 u0, t0, 0x000F000F, 0x64086408, 0x6A;
lop3.b32 u1, t1, 0x000F000F, 0x64086408, 0x6A;
lop3.b32 u2, t0, 0x00F000F0, 0x64806480, 0x6A;
lop3.b32 u3, t1, 0x00F000F0, 0x64806480, 0x6A;
mov.b32 m, 0x64086408;
mov.b32 s, 0x2C002C00;
mov.b32 o, 0xD480D480;
sub.f16x2 $0, u0, m;
sub.f16x2 $1, u1, m;
fma.rn.f16x2 $2, u2, s, o;
fma.rn.f16x2 $3, u3, s, o;
}""")


@gluon.jit
def _unpack_int4(wb):
    """``uint8 [64, 64]`` packed bytes → ``(low, high)`` nibbles as fp16 ``[64, 64]`` in ``wb``'s layout."""
    return gl.inline_asm_elementwise(_UNPACK_ASM, "=r,=r,=r,=r,r", [wb], dtype=(gl.float16, gl.float16),
                                     is_pure=True, pack=4)


@gluon.jit
def _as_k_order(t, op_layout: gl.constexpr):
    """Relabel a group's byte axis ``c = 16q + 4s + 2h + b`` as the wgmma K index ``k = 16s + 8h + 2q + b``.

    Lane ``q`` of a quad holds bytes ``16q … 16q + 15`` (one 16-byte load) and, in wgmma's A fragment, the
    K slots ``16s + 8h + 2q + b``: the relabelling moves no data (``convert_layout`` is a register renaming).
    """
    t = gl.reshape(t, [BLOCK_N, 4, 4, 2, 2])
    t = gl.permute(t, (0, 2, 3, 1, 4))
    return gl.convert_layout(gl.reshape(t, [BLOCK_N, HALF]), op_layout)


@gluon.jit
def _epilogue(acc, AS_ptr, B_ptr, PTS_ptr, offs_n, offs_m, n_ok, m_ok, HAS_BIAS: gl.constexpr):
    """``(acc ⊙ β) · 2⁻ⁿ (+ bias)`` on ``accᵀ [64, BM]`` in fp32, the reference's order."""
    beta = gl.load(AS_ptr + offs_m, mask=m_ok, other=1.0, cache_modifier=".cg").to(gl.float32)
    n_pts = gl.load(PTS_ptr)
    inv_delta = ((127 - n_pts) << 23).to(gl.float32, bitcast=True)  # 2⁻ⁿ exactly (0 ≤ n ≤ 126)
    y = acc * beta[None, :] * inv_delta
    if HAS_BIAS:
        y += gl.load(B_ptr + offs_n, mask=n_ok, other=0.0).to(gl.float32)[:, None]
    return y


@gluon.jit
def _quantize_token(X_ptr, XQ_ptr, AS_ptr, C_ptr, m, K, stride_xm, QBLOCK: gl.constexpr):
    """Token ``m`` (``K ≤ QBLOCK``, one load): :func:`~quantpatch.kernels.w4a8_triton._quantize_row`
    (``β = bf16(max|x| / 448)``, 1 if 0; ``x̂ = e4m3(x / β)`` saturating; IEEE divisions, round-half-even) into
    ``x̂ (M, K)`` / ``β (M,)``, then one count on the flag ``C[0]`` (release)."""
    q_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[8], threads_per_warp=[32], warps_per_cta=[4], order=[0])
    offs = gl.arange(0, QBLOCK, layout=q_l)
    x = gl.load(X_ptr + m.to(gl.int64) * stride_xm + offs, mask=offs < K, other=0.0).to(gl.float32)
    beta = gl.div_rn(gl.max(gl.abs(x), 0), 448.0)  # e4m3 max
    beta = gl.where(beta == 0.0, 1.0, beta)  # an all-zero token gets 1
    beta = _bf16_rne(beta)
    beta = gl.where(beta == 0.0, 1.0, beta)  # bf16 underflow
    gl.store(XQ_ptr + m * K + offs, gl.div_rn(x, beta).to(gl.float8e4nv), mask=offs < K)  # cvt.rn.satfinite
    gl.store(AS_ptr + m, beta.to(gl.bfloat16))  # exact: β is on the bf16 grid
    _cta_barrier()  # every thread's x̂ is written before the flag (release) counts this token
    gl.atomic_add(C_ptr, 1, sem="release", scope="gpu")


@gluon.jit
def _load_chunk(w_ptrs, w_ok, s_ptrs, s_ok, g, GPC: gl.constexpr):
    """Groups ``g … g + GPC − 1`` of the program's rows: per group two 16-byte loads a thread (rows r, r + 8),
    straight into the registers the unpack reads (rows past N as zeros), and their scales σ ``[GPC, 64]``."""
    wb = ()
    for j in gl.static_range(GPC):
        wb = wb + (gl.load(w_ptrs + (g + j) * HALF, mask=w_ok, other=0),)
    return wb, gl.load(s_ptrs + g, mask=s_ok, other=0.0)


@gluon.jit
def _chunk_mma(acc, wb, xp, sig, xe_s, xo_s, sig_s,
               acc_l: gl.constexpr, op_l: gl.constexpr, BM: gl.constexpr, GPC: gl.constexpr):
    """``acc += Σ_j σ_j (ŵ_j x̂_jᵀ)`` over a chunk's GPC groups, in order: ``xp`` (x̂ as int16 pairs
    ``[GPC, BM, 64]``) and σ staged in shared memory, then per group the unpack into the A fragment and two
    async wgmma, the previous group's retired meanwhile; all retired on return (the staging buffers are free)."""
    # x̂ᵀ even and odd channels, tokens ≥ M as zeros, [GPC·BM, 64] fp16, relabelled (bytes → wgmma K order) as
    # the weights are, so B's rows meet A's K slots; σ [GPC·64] fp32
    xp = gl.reshape(gl.permute(gl.reshape(xp, [GPC, BM, 4, 4, 2, 2]), (0, 1, 3, 4, 2, 5)), [GPC * BM, HALF])
    _cta_barrier()  # every warp's wgmma of the previous chunk retired before the buffers are rewritten
    xe_s.store((xp & 0xFF).to(gl.int8).to(gl.float8e4nv, bitcast=True).to(gl.float16))
    xo_s.store((xp >> 8).to(gl.int8).to(gl.float8e4nv, bitcast=True).to(gl.float16))
    sig_s.store(gl.reshape(sig.to(gl.float32), [GPC * BLOCK_N]))
    hopper.fence_async_shared()
    _cta_barrier()
    zero = gl.zeros([BLOCK_N, BM], gl.float32, acc_l)
    tok = zero
    for j in gl.static_range(GPC):
        lo, hi = _unpack_int4(wb[j])
        nxt = hopper.warpgroup_mma(_as_k_order(lo, op_l), xe_s.slice(j * BM, BM).permute((1, 0)), zero,
                                   use_acc=False, is_async=True)
        nxt = hopper.warpgroup_mma(_as_k_order(hi, op_l), xo_s.slice(j * BM, BM).permute((1, 0)), nxt, is_async=True)
        if j > 0:
            part = hopper.warpgroup_mma_wait(2, deps=[tok])
            acc += part * sig_s.slice((j - 1) * BLOCK_N, BLOCK_N).load(gl.SliceLayout(1, acc_l))[:, None]
        tok = nxt
    part = hopper.warpgroup_mma_wait(0, deps=[tok])
    return acc + part * sig_s.slice((GPC - 1) * BLOCK_N, BLOCK_N).load(gl.SliceLayout(1, acc_l))[:, None]


@gluon.jit
def _gemm_program(
    c, W_ptr, XP_ptr, AS_ptr, WS_ptr, B_ptr, PTS_ptr, P_ptr, C_ptr, Y_ptr,
    M, N, K, stride_wn, stride_sn, stride_ym,
    BM: gl.constexpr, GPC: gl.constexpr, CHUNKS: gl.constexpr, SPLIT_K: gl.constexpr, FUSED: gl.constexpr,
    HAS_BIAS: gl.constexpr,
):
    """GEMM program ``c``: output channels ``64 (c mod tiles) …`` over a run of ``CHUNKS · GPC`` groups of K,
    starting at group ``CHUNKS · GPC · (c div tiles)``, a chunk of GPC groups at a time, the next chunk's weights,
    σ and x̂ in flight while this one is computed.

    ``FUSED``: ``x̂``/``β`` come from this launch's first M programs; the first chunk's weights and σ and
    nothing else are requested before the wait on their flag.
    """
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
    op_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
    # the bytes of a group as a thread needs them: 16 contiguous (c) in registers, rows r and r + 8 as in acc_l
    ld_l: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [8, 0]], lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[BLOCK_N, HALF])
    x_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 8], threads_per_warp=[1, 4, 8],
                                         warps_per_cta=[1, 4, 1], order=[2, 1, 0])
    s_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1], threads_per_warp=[1, 32], warps_per_cta=[1, 4],
                                         order=[1, 0])
    x_smem_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    flat_l: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])

    tiles = gl.cdiv(N, BLOCK_N)
    tile = c % tiles
    run = c // tiles
    n0 = tile * BLOCK_N
    g0 = run * (CHUNKS * GPC)

    # 1. the first chunk's weights and σ in flight
    r_w = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld_l))
    c_w = gl.arange(0, HALF, layout=gl.SliceLayout(0, ld_l))
    w_ptrs = W_ptr + (n0 + r_w[:, None]).to(gl.int64) * stride_wn + g0 * HALF + c_w[None, :]
    w_ok = (n0 + r_w < N)[:, None]
    g_s = gl.arange(0, GPC, layout=gl.SliceLayout(1, s_l))
    r_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_l))
    s_ptrs = WS_ptr + (n0 + r_s[None, :]).to(gl.int64) * stride_sn + g0 + g_s[:, None]
    s_ok = (n0 + r_s < N)[None, :]
    wb, sig = _load_chunk(w_ptrs, w_ok, s_ptrs, s_ok, 0, GPC)

    # 2. x̂ (fused: once all M tokens are counted on the flag C[0], acquire; programs of lower index, which the
    #    GPU starts first, set it); the last program past the wait sets C[0], C[1] back to 0
    if FUSED:
        while gl.atomic_add(C_ptr, 0, sem="acquire", scope="gpu") < M:
            pass
    g_x = gl.arange(0, GPC, layout=gl.SliceLayout(1, gl.SliceLayout(2, x_l)))
    m_x = gl.arange(0, BM, layout=gl.SliceLayout(0, gl.SliceLayout(2, x_l)))
    c_x = gl.arange(0, HALF, layout=gl.SliceLayout(0, gl.SliceLayout(1, x_l)))
    x_ptrs = XP_ptr + m_x[None, :, None] * (K // 2) + (g0 + g_x[:, None, None]) * HALF + c_x[None, None, :]
    x_ok = (m_x < M)[None, :, None]
    xp = gl.load(x_ptrs, mask=x_ok, other=0, cache_modifier=".cg")  # 16 B a thread a group
    if FUSED:
        if gl.atomic_add(C_ptr + 1, 1, sem="relaxed", scope="gpu") == gl.num_programs(0) - M - 1:
            gl.atomic_xchg(C_ptr, 0, sem="relaxed", scope="gpu")
            gl.atomic_xchg(C_ptr + 1, 0, sem="relaxed", scope="gpu")

    # 3. per chunk: the next chunk's loads, then this chunk's wgmma (shared-memory staging reused by every chunk)
    xe_s = gl.allocate_shared_memory(gl.float16, [GPC * BM, HALF], x_smem_l)
    xo_s = gl.allocate_shared_memory(gl.float16, [GPC * BM, HALF], x_smem_l)
    sig_s = gl.allocate_shared_memory(gl.float32, [GPC * BLOCK_N], flat_l)
    acc = gl.zeros([BLOCK_N, BM], gl.float32, acc_l)
    for i in gl.static_range(1, CHUNKS):
        wb_next, sig_next = _load_chunk(w_ptrs, w_ok, s_ptrs, s_ok, i * GPC, GPC)
        xp_next = gl.load(x_ptrs + i * (GPC * HALF), mask=x_ok, other=0, cache_modifier=".cg")
        acc = _chunk_mma(acc, wb, xp, sig, xe_s, xo_s, sig_s, acc_l, op_l, BM, GPC)
        wb, sig, xp = wb_next, sig_next, xp_next
    acc = _chunk_mma(acc, wb, xp, sig, xe_s, xo_s, sig_s, acc_l, op_l, BM, GPC)

    # 4. epilogue, or this run's partial and the tile's ticket C[2 + tile] (the last run sums all partials in order)
    offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_l))
    offs_m = gl.arange(0, BM, layout=gl.SliceLayout(0, acc_l))
    n_ok = offs_n < N
    m_ok = offs_m < M
    mask = n_ok[:, None] & m_ok[None, :]
    y_ptrs = Y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    if SPLIT_K == 1:
        y = _epilogue(acc, AS_ptr, B_ptr, PTS_ptr, offs_n, offs_m, n_ok, m_ok, HAS_BIAS)
        gl.store(y_ptrs, y.to(Y_ptr.dtype.element_ty), mask=mask)
    else:
        p_ptrs = P_ptr + offs_m[None, :] * N + offs_n[:, None]
        gl.store(p_ptrs + run * M * N, acc, mask=mask)
        _cta_barrier()  # every thread's partial is written before the ticket (release) is taken
        ticket = gl.atomic_add(C_ptr + 2 + tile, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:
            total = gl.load(p_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
            for s in gl.static_range(1, SPLIT_K):
                total += gl.load(p_ptrs + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            y = _epilogue(total, AS_ptr, B_ptr, PTS_ptr, offs_n, offs_m, n_ok, m_ok, HAS_BIAS)
            gl.store(y_ptrs, y.to(Y_ptr.dtype.element_ty), mask=mask)
            gl.atomic_xchg(C_ptr + 2 + tile, 0)


@gluon.jit
def _w4a8_decode_gluon(
    X_ptr, XQ_ptr, W_ptr, XP_ptr, AS_ptr, WS_ptr, B_ptr, PTS_ptr, P_ptr, C_ptr, Y_ptr,
    M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
    BM: gl.constexpr, GPC: gl.constexpr, CHUNKS: gl.constexpr, SPLIT_K: gl.constexpr, FUSED: gl.constexpr,
    QBLOCK: gl.constexpr, HAS_BIAS: gl.constexpr,
):
    """One launch: ``tiles × SPLIT_K`` GEMM programs (:func:`_gemm_program`), after ``M`` quantizing ones if ``FUSED``.

    ``X``: ``x (M, K)`` (row stride ``stride_xm``; ``FUSED`` only). ``XQ``: ``x̂ (M, K)`` e4m3 workspace that
    ``XP`` reads as int16 pairs (low byte: channel 2c). ``W``: ``qweight uint8 (N, K/2)`` (row stride
    ``stride_wn``). ``AS``: β (M,). ``WS``: σ e4m3 (N, K/128). ``P``: fp32 partials (SPLIT_K, M, N).
    ``C``: int32 ``[flag, passed, ticket per tile…]``, 0 between launches. ``Y``: (M, N). ``BM`` ∈ {8, 16}: wgmma N.

    ``FUSED``: programs ``0…M-1`` quantize token ``pid`` (:func:`_quantize_token`) and count themselves on
    ``C[0]``; the GEMM programs come after them in the grid and wait for the count to reach M. They wait only
    on programs of lower index, which the GPU dispatches first, so the wait cannot deadlock (the assumption of
    the Triton decode kernel's fused launch, and of Stream-K's and decoupled look-back's waits).
    """
    pid = gl.program_id(0)
    if FUSED:
        if pid < M:
            _quantize_token(X_ptr, XQ_ptr, AS_ptr, C_ptr, pid, K, stride_xm, QBLOCK)
        else:
            _gemm_program(pid - M, W_ptr, XP_ptr, AS_ptr, WS_ptr, B_ptr, PTS_ptr, P_ptr, C_ptr, Y_ptr,
                          M, N, K, stride_wn, stride_sn, stride_ym, BM, GPC, CHUNKS, SPLIT_K, FUSED, HAS_BIAS)
    else:
        _gemm_program(pid, W_ptr, XP_ptr, AS_ptr, WS_ptr, B_ptr, PTS_ptr, P_ptr, C_ptr, Y_ptr,
                      M, N, K, stride_wn, stride_sn, stride_ym, BM, GPC, CHUNKS, SPLIT_K, FUSED, HAS_BIAS)


def run_shape(groups: int, gps: int, gpc: int | None = None) -> tuple[int, int]:
    """``(GPC, CHUNKS)``: groups per chunk ``gpc`` (default :data:`DEFAULT_GPC`, at most :data:`MAX_GPC`) lowered
    to a power of two (``gl.arange``) that divides ``groups``; chunks per split-K run: the run, ``gps`` groups
    lowered to a multiple of GPC that divides ``groups``, over GPC."""
    gpc = min(gpc or DEFAULT_GPC, MAX_GPC, groups)
    while groups % gpc or gpc & (gpc - 1):
        gpc -= 1
    chunks = max(1, min(gps, groups) // gpc)
    while groups % (chunks * gpc):
        chunks -= 1
    return gpc, chunks


def default_run(tiles: int, groups: int, sms: int) -> tuple[int, int]:
    """``(gps, gpc)`` by default. Runs of :data:`SHORT_RUN` groups in one chunk (all of a run's loads in flight at
    once, also while a fused quantization is awaited) where ``tiles × runs ≤ PROGRAMS_PER_SM · sms`` (4096→4096
    on an H200); else the shortest run of :data:`DEFAULT_GPC`-group chunks dividing ``groups`` that fits
    (4096→14336: the whole K; 14336→4096: 28 groups), the whole K if none does. H200, M = 16, layer as graph
    replays: 13.9 / 25.8 / 30.1 µs (NOTES, version 7)."""
    if groups % SHORT_RUN == 0 and tiles * (groups // SHORT_RUN) <= PROGRAMS_PER_SM * sms:
        return SHORT_RUN, SHORT_RUN
    gpc = run_shape(groups, groups)[0]
    for run in range(gpc, groups, gpc):
        if groups % run == 0 and tiles * (groups // run) <= PROGRAMS_PER_SM * sms:
            return run, gpc
    return groups, gpc


# Launch plans: (stream key, fused, M, N, K, gps, out dtype, strides, each caller tensor's dtype and 16-byte
# alignment) → (compiled kernel, grid, split-K?, int and constexpr arguments). The key holds everything Triton
# specializes the kernel on (the ints exactly), so a plan's kernel is the one ``JITFunction.run`` would pick. A
# plan holds no tensor: the workspaces are looked up per call (they only ever grow, so the current ones fit).
_PLANS: dict[tuple, tuple] = {}


def _launch(x, x_hat, beta, qweight, scales, pts_exp, bias, y, gps: int | None, gpc: int | None) -> None:
    """One launch of :func:`_w4a8_decode_gluon` into ``y (M, N)``: from ``x (M, K)`` (quantization fused) if given,
    else from ``x̂ (M, K), β (M,)``.

    A plan's first launch goes through ``JITFunction.run`` (compiling if needed); later ones call the compiled
    kernel's launcher directly, skipping Triton's per-call argument binding and specialization."""
    m, n = y.shape
    k = qweight.shape[1] * 2
    fused = x is not None
    skey = _stream_key(y.device)
    src = x if fused else x_hat
    caller = (src, qweight, scales, pts_exp) + (() if fused else (beta,)) + (() if bias is None else (bias,))
    key = (skey, fused, m, n, k, gps, gpc, y.dtype, bias is None, src.stride(0), qweight.stride(0), scales.stride(0),
           *[(t.dtype, t.data_ptr() % 16 == 0) for t in caller])
    plan = _PLANS.get(key)
    if plan is None:
        _PLANS[key] = _first_launch(x, x_hat, beta, qweight, scales, pts_exp, bias, y, gps, gpc, skey)
        return
    kernel, grid, split, ints = plan
    if fused:
        x_hat, x_pairs = _SCRATCH[(skey, "x_hat_views")]
        beta = _SCRATCH[(skey, "beta")]
    else:
        x, x_pairs = x_hat, x_hat.view(torch.int16)
    args = (x, x_hat, qweight, x_pairs, beta, scales, beta if bias is None else bias, pts_exp,
            _SCRATCH[(skey, "gluon_partials")] if split else y, _SCRATCH[(skey, "gluon_counters")], y, *ints)
    relaunch(kernel, (grid, 1, 1), skey[1], args)


def _first_launch(x, x_hat, beta, qweight, scales, pts_exp, bias, y, gps, gpc, skey) -> tuple:
    """:func:`_launch` through ``JITFunction.run`` (workspaces made or grown here); returns the plan."""
    m, n = y.shape
    k = qweight.shape[1] * 2
    groups = k // GROUP_SIZE
    tiles = cdiv(n, BLOCK_N.value)
    sms = torch.cuda.get_device_properties(y.device).multi_processor_count
    if gps is None and gpc is None:
        gps, gpc = default_run(tiles, groups, sms)
    gpc, chunks = run_shape(groups, gps or groups, gpc)
    split = groups // (gpc * chunks)
    counters = _scratch(skey, "gluon_counters", 2 + tiles, torch.int32, y.device)
    work = _scratch(skey, "gluon_partials", split * m * n, torch.float32, y.device) if split > 1 else y
    fused = x is not None
    if fused:
        x_hat, x_pairs = _x_hat_scratch(skey, m * k, y.device)
        beta = _scratch(skey, "beta", m, torch.bfloat16, y.device)
    else:
        x, x_pairs = x_hat, x_hat.view(torch.int16)
    grid = (m if fused else 0) + tiles * split
    ints = (m, n, k, x.stride(0), qweight.stride(0), scales.stride(0), y.stride(0),
            8 if m <= 8 else 16, gpc, chunks, split, fused, max(1024, next_pow2(k)), bias is not None)
    kernel = _w4a8_decode_gluon[(grid,)](
        x, x_hat, qweight, x_pairs, beta, scales, beta if bias is None else bias, pts_exp, work, counters, y,
        *ints, num_warps=4)
    return kernel, grid, split > 1, ints


def _check(m: int, k: int, qweight: torch.Tensor, scales: torch.Tensor) -> None:
    _check_operands(m, k, qweight, scales)
    if m > MAX_TOKENS:
        raise ValueError(f"the Gluon decode kernel takes M ≤ {MAX_TOKENS} tokens, got {m}")


def w4a8_gemm_gluon(
    x_hat: torch.Tensor,
    x_scale: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    pts_exp: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    gps: int | None = None,
    gpc: int | None = None,
) -> torch.Tensor:
    """The GEMM alone: ``y = β · 2⁻ⁿ · Σ_g σ_g (x̂_g ŵ_gᵀ) + bias`` for ``M ≤ 16`` tokens, as
    :func:`~quantpatch.kernels.w4a8_triton.w4a8_gemm` (same arguments; ``gps``: groups per split-K run,
    ``gpc``: groups per chunk, :func:`run_shape`; both None: :func:`default_run`).

    Args:
        x_hat: ``float8_e4m3fn (M, K)``, contiguous, K a multiple of 128.
        x_scale: ``bfloat16 (M,)``.
        qweight: ``uint8 (N, K/2)``, last dim contiguous.
        scales: ``float8_e4m3fn (N, K/128)``.
        pts_exp: ``int32 ()`` on the device.
        bias: ``(N,)`` or None.

    Returns:
        ``y (M, N)`` in ``out_dtype``.
    """
    m, k = x_hat.shape
    _check(m, k, qweight, scales)
    if not x_hat.is_contiguous():
        raise ValueError("x_hat must be contiguous")
    y = torch.empty((m, qweight.shape[0]), device=x_hat.device, dtype=out_dtype)
    if m and y.shape[1]:
        _launch(None, x_hat, x_scale, qweight, scales, pts_exp, bias, y, gps, gpc)
    return y


def w4a8_linear_gluon(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, pts_exp: torch.Tensor,
    bias: torch.Tensor | None = None, *, gps: int | None = None, gpc: int | None = None,
) -> torch.Tensor:
    """The whole layer on ``x (M ≤ 16, K)`` (last dim contiguous) → ``y (M, N)`` in ``x``'s dtype: what
    :func:`~quantpatch.kernels.w4a8_triton.w4a8_linear_2d` runs for M ≤ 16 on sm_90.

    ``K ≤ DECODE_QBLOCK``: one launch, the quantization of
    :func:`~quantpatch.kernels.w4a8_triton.quantize_activation_fp8` (bit for bit) fused with the GEMM. Longer
    rows: that quantization kernel, then the GEMM (fused, a row's several dependent loads, behind the GEMM
    programs' weight loads in the memory queues, held every GEMM program up: 14336 → 4096 at 16 tokens took
    40.3 µs against 33.6 µs in two launches, H200)."""
    m, k = x.shape
    _check(m, k, qweight, scales)
    if x.stride(-1) != 1:
        raise ValueError("x needs a contiguous last dim")
    y = torch.empty((m, qweight.shape[0]), device=x.device, dtype=x.dtype)
    if m and y.shape[1]:
        if k <= DECODE_QBLOCK:
            _launch(x, None, None, qweight, scales, pts_exp, bias, y, gps, gpc)
        else:
            _launch(None, *quantize_activation_fp8(x), qweight, scales, pts_exp, bias, y, gps, gpc)
    return y
