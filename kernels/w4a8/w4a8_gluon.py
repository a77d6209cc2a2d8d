"""W4A8 decode GEMM (M ≤ 16 tokens) in Gluon (Triton 3.6+, sm_90): the weights as the FP8 wgmma's register operand.

Numerics: those of the Gluon prefill GEMM (:mod:`.w4a8_prefill_gluon`, :mod:`.w4a8_gluon_operand`): per 128-group
``g`` one FP8 tensor-core product (INT4 as e4m3 ``ŵ · 2⁻⁹``, x̂ in fragment order) into a fresh fp32 accumulator,
times ``σ_g · 2⁹``, added to an fp32 accumulator over the run's groups in order; split-K runs summed in run order by
the last run to arrive, then ``(acc ⊙ β) · 2⁻ⁿ + bias``. Activations: the numerics of
:func:`~quantpatch.kernels.w4a8.w4a8_act_quant_triton.quantize_activation_fp8` in fragment order (bit-exact with the
reference), computed by the first M programs of the same launch where a row fits one ``DECODE_QBLOCK`` load
(:func:`w4a8_linear_gluon`: the layer, which ``w4a8_triton.w4a8_linear_2d`` runs for M ≤ 16 on sm_90).

Design (swap AB, one warpgroup per program, ``yᵀ = ŵ x̂ᵀ``)::

    programs 0…M-1 (fused): token m → x̂ (fragment order), β (workspace) → flag += 1 (release)
    program (tile t, run r): 64 output channels × a run of CHUNKS · GPC groups of K, a chunk of GPC at a time
      ld.global.v4  the chunk's packed weights straight into the registers of wgmma's A operand (16 bytes of rows
                    r and r + 8 a thread a group) and σ of the thread's rows; the next chunk's requested before
                    this one is computed
      (fused, first chunk: wait until the flag counts M tokens, acquire)
      cp.async      the chunk's x̂ [GPC, BM, 128] e4m3 into one of two shared buffers (wgmma's B operand as it
                    is: no conversion), the next chunk's while this one is computed
      per group:    INT4 → e4m3 in registers (10 PTX instructions a word), async wgmma m64nBMk32 × 4, the
                    previous group's product retired meanwhile; acc += part · σ 2⁹

The weights never touch shared memory. This FP8 path replaced fp16 wgmma (INT4 → fp16 pairs, x̂ → fp16 staged
by every program): half the wgmma instructions, and x̂ goes to the tensor core as loaded. Host
side: a launch plan per shape (:func:`_launch`) calls the compiled kernel's launcher directly after the first call.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from ..compiled_launch import cdiv, next_pow2, relaunch, stream_key
from ..gluon_compat import async_load, cta_barrier
from ..rounding_triton import ROUND_TO_BF16, _round_to
from .w4a8_act_quant_triton import DECODE_QBLOCK, quantize_activation_fp8
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
from .w4a8_scratch import _SCRATCH, _scratch, _x_hat_scratch

BLOCK_N = WG_ROWS  # output channels per program: wgmma's M
MAX_TOKENS = 16  # wgmma's N at most here
DEFAULT_GPC = 4  # groups per chunk (H200, M = 16: 4 beat 2 and 8 at both long-K shapes)
MAX_GPC = 8  # registers: a chunk's weights take GPC × 8 a thread, twice (this chunk's and the next)
PROGRAMS_PER_SM = 2  # default runs: no more GEMM programs than this an SM (one wave)
SHORT_RUN = 8  # groups of the default run in one chunk, where such runs fit one wave


@gluon.jit
def _fragment_slot(c):
    """Slot of channel ``c`` of a 128-group in fragment order: ``32q + 8s + 2j + h`` → ``32s + 16h + 4q + j``."""
    return (c & ~127) | (((c >> 3) & 3) << 5) | ((c & 1) << 4) | (((c >> 5) & 3) << 2) | ((c >> 1) & 3)


@gluon.jit
def _quantize_token(X_ptr, XQ_ptr, AS_ptr, C_ptr, m, K, stride_xm, QBLOCK: gl.constexpr):
    """Token ``m`` (``K ≤ QBLOCK``, one load): :func:`~quantpatch.kernels.w4a8.w4a8_act_quant_triton._quantize_row`
    (``β = bf16(max|x| / 448)``, 1 if 0; ``x̂ = e4m3(x / β)`` saturating; IEEE divisions, round-half-even) into
    ``x̂ (M, K)`` in fragment order / ``β (M,)``, then one count on the flag ``C[0]`` (release)."""
    q_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[8], threads_per_warp=[32], warps_per_cta=[4], order=[0])
    offs = gl.arange(0, QBLOCK, layout=q_l)
    x = gl.load(X_ptr + m.to(gl.int64) * stride_xm + offs, mask=offs < K, other=0.0).to(gl.float32)
    beta = gl.div_rn(gl.max(gl.abs(x), 0), 448.0)  # e4m3 max
    beta = gl.where(beta == 0.0, 1.0, beta)  # an all-zero token gets 1
    beta = _round_to(beta, ROUND_TO_BF16, False)  # cvt.rn.bf16.f32: Gluon kernels run on the GPU only
    beta = gl.where(beta == 0.0, 1.0, beta)  # bf16 underflow
    x_hat = gl.div_rn(x, beta).to(gl.float8e4nv)  # cvt.rn.satfinite
    gl.store(XQ_ptr + m * K + _fragment_slot(offs), x_hat, mask=offs < K)
    gl.store(AS_ptr + m, beta.to(gl.bfloat16))  # exact: β is on the bf16 grid
    cta_barrier()  # every thread's x̂ is written before the flag (release) counts this token
    gl.atomic_add(C_ptr, 1, sem="release", scope="gpu")


@gluon.jit
def _load_chunk(w_ptrs, w_ok, s_ptrs, n_ok, g, GPC: gl.constexpr):
    """Groups ``g … g + GPC − 1`` of the program's rows: per group 4 words of rows r and r + 8 a thread (one 16-byte
    load each), straight into the registers the unpack reads (rows past N as zeros), and σ of the thread's rows."""
    wb = ()
    sig = ()
    for j in gl.static_range(GPC):
        wb = wb + (gl.load(w_ptrs + (g + j) * (HALF // 4), mask=w_ok, other=0),)
        sig = sig + (gl.load(s_ptrs + g + j, mask=n_ok, other=0.0),)
    return wb, sig


@gluon.jit
def _request_x(x_s, buf, x_ptrs, x_ok, g, GPC: gl.constexpr):
    """x̂ of groups ``g … g + GPC − 1`` (``[BM, 128]`` e4m3 each, tokens ≥ M zero-filled) into buffer ``buf`` by
    cp.async (L2, not L1: the fused launch's x̂ was written by other programs); one commit group."""
    for j in gl.static_range(GPC):
        async_load(x_s.index(buf * GPC + j), x_ptrs + (g + j) * GROUP, mask=x_ok)
    async_copy.commit_group()


@gluon.jit
def _chunk_mma(acc, wb, sig, x_s, buf, acc_l: gl.constexpr, op_l: gl.constexpr, GPC: gl.constexpr):
    """``acc += Σ_j (σ_j 2⁹) (ŵ_j 2⁻⁹ x̂_jᵀ)`` over a chunk's GPC groups in order, group j's product in flight
    while group j + 1 is unpacked; all retired on return (the x̂ buffer is free)."""
    zero = gl.zeros(acc.shape, gl.float32, acc_l)
    tok = zero
    for j in gl.static_range(GPC):
        lo, hi = _unpack(wb[j])
        nxt = hopper.warpgroup_mma(_weight_operand(lo, hi, op_l), x_s.index(buf * GPC + j).permute((1, 0)), zero,
                                   use_acc=False, is_async=True)
        if j > 0:
            part = hopper.warpgroup_mma_wait(1, deps=[tok])
            acc += part * (sig[j - 1].to(gl.float32) * SIGMA_SHIFT)[:, None]
        tok = nxt
    part = hopper.warpgroup_mma_wait(0, deps=[tok])
    return acc + part * (sig[GPC - 1].to(gl.float32) * SIGMA_SHIFT)[:, None]


@gluon.jit
def _gemm_program(
    c, W_ptr, XQ_ptr, AS_ptr, WS_ptr, B_ptr, PTS_ptr, P_ptr, C_ptr, Y_ptr,
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
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 32])
    op_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=4)
    x_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[4, 8], warps_per_cta=[4, 1],
                                         order=[1, 0])
    x_smem_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)

    tiles = gl.cdiv(N, BLOCK_N)
    tile = c % tiles
    run = c // tiles
    n0 = tile * BLOCK_N
    g0 = run * (CHUNKS * GPC)

    # 1. the first chunk's weights and σ in flight
    r_w = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, WORDS_L))
    c_w = gl.arange(0, HALF // 4, layout=gl.SliceLayout(0, WORDS_L))
    w_ptrs = W_ptr + (n0 + r_w[:, None]).to(gl.int64) * stride_wn + g0 * (HALF // 4) + c_w[None, :]
    w_ok = (n0 + r_w < N)[:, None]
    offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_l))  # σ's rows and the epilogue's
    n_ok = offs_n < N
    s_ptrs = WS_ptr + offs_n.to(gl.int64) * stride_sn + g0
    wb, sig = _load_chunk(w_ptrs, w_ok, s_ptrs, n_ok, 0, GPC)

    # 2. x̂ (fused: once all M tokens are counted on the flag C[0], acquire; programs of lower index, which the
    #    GPU starts first, set it); the last program past the wait sets C[0], C[1] back to 0
    if FUSED:
        while gl.atomic_add(C_ptr, 0, sem="acquire", scope="gpu") < M:
            pass
    m_x = gl.arange(0, BM, layout=gl.SliceLayout(1, x_l))
    c_x = gl.arange(0, GROUP, layout=gl.SliceLayout(0, x_l))
    x_ptrs = XQ_ptr + m_x[:, None] * K + g0 * GROUP + c_x[None, :]
    x_ok = (m_x < M)[:, None]
    x_s = gl.allocate_shared_memory(gl.float8e4nv, [2 * GPC, BM, GROUP], x_smem_l)
    _request_x(x_s, 0, x_ptrs, x_ok, 0, GPC)
    if FUSED:
        if gl.atomic_add(C_ptr + 1, 1, sem="relaxed", scope="gpu") == gl.num_programs(0) - M - 1:
            gl.atomic_xchg(C_ptr, 0, sem="relaxed", scope="gpu")
            gl.atomic_xchg(C_ptr + 1, 0, sem="relaxed", scope="gpu")

    # 3. per chunk: the next chunk's loads, then this chunk's wgmma (x̂ double-buffered)
    acc = gl.zeros([BLOCK_N, BM], gl.float32, acc_l)
    for i in gl.static_range(CHUNKS):
        if i + 1 < CHUNKS:
            wb_next, sig_next = _load_chunk(w_ptrs, w_ok, s_ptrs, n_ok, (i + 1) * GPC, GPC)
        async_copy.wait_group(0)  # this thread's copies of chunk i landed
        hopper.fence_async_shared()  # ... and are visible to wgmma (the async proxy)
        cta_barrier()  # every thread's copies landed; every warp is past chunk i − 1, so its buffer is free
        if i + 1 < CHUNKS:
            _request_x(x_s, (i + 1) % 2, x_ptrs, x_ok, (i + 1) * GPC, GPC)
        acc = _chunk_mma(acc, wb, sig, x_s, i % 2, acc_l, op_l, GPC)
        if i + 1 < CHUNKS:
            wb, sig = wb_next, sig_next

    # 4. epilogue, or this run's partial and the tile's ticket C[2 + tile] (the last run sums all partials in order)
    offs_m = gl.arange(0, BM, layout=gl.SliceLayout(0, acc_l))
    m_ok = offs_m < M
    mask = n_ok[:, None] & m_ok[None, :]
    y_ptrs = Y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    if SPLIT_K == 1:
        y = _epilogue(acc, AS_ptr, B_ptr, PTS_ptr, offs_n, offs_m, n_ok, m_ok, HAS_BIAS)
        gl.store(y_ptrs, y.to(Y_ptr.dtype.element_ty), mask=mask)
    else:
        p_ptrs = P_ptr + offs_m[None, :] * N + offs_n[:, None]
        gl.store(p_ptrs + run * M * N, acc, mask=mask)
        cta_barrier()  # every thread's partial is written before the ticket (release) is taken
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
    X_ptr, XQ_ptr, W_ptr, AS_ptr, WS_ptr, B_ptr, PTS_ptr, P_ptr, C_ptr, Y_ptr,
    M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
    BM: gl.constexpr, GPC: gl.constexpr, CHUNKS: gl.constexpr, SPLIT_K: gl.constexpr, FUSED: gl.constexpr,
    QBLOCK: gl.constexpr, HAS_BIAS: gl.constexpr,
):
    """One launch: ``tiles × SPLIT_K`` GEMM programs (:func:`_gemm_program`), after ``M`` quantizing ones if ``FUSED``.

    ``X``: ``x (M, K)`` (row stride ``stride_xm``; ``FUSED`` only). ``XQ``: ``x̂ (M, K)`` e4m3 in fragment order
    (the fused workspace, or the caller's). ``W``: ``qweight`` as ``int32 (N, K/8)`` words (row stride
    ``stride_wn`` words). ``AS``: β (M,). ``WS``: σ e4m3 (N, K/128). ``P``: fp32 partials (SPLIT_K, M, N).
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
            _gemm_program(pid - M, W_ptr, XQ_ptr, AS_ptr, WS_ptr, B_ptr, PTS_ptr, P_ptr, C_ptr, Y_ptr,
                          M, N, K, stride_wn, stride_sn, stride_ym, BM, GPC, CHUNKS, SPLIT_K, FUSED, HAS_BIAS)
    else:
        _gemm_program(pid, W_ptr, XQ_ptr, AS_ptr, WS_ptr, B_ptr, PTS_ptr, P_ptr, C_ptr, Y_ptr,
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
    replays: 13.2 / 20.9 / 26.7 µs (docs/performance.md)."""
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
    skey = stream_key(y.device)
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
        x_hat = _SCRATCH[(skey, "x_hat_views")][0]
        beta = _SCRATCH[(skey, "beta")]
    else:
        x = x_hat
    # qweight as it is: the launcher reads only its address, which the plan's first launch checked as words
    # (weight_words) at this key's alignment and row stride
    args = (x, x_hat, qweight, beta, scales, beta if bias is None else bias, pts_exp,
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
        x_hat = _x_hat_scratch(skey, m * k, y.device)[0]
        beta = _scratch(skey, "beta", m, torch.bfloat16, y.device)
    else:
        x = x_hat
    grid = (m if fused else 0) + tiles * split
    ints = (m, n, k, x.stride(0), qweight.stride(0) // 4, scales.stride(0), y.stride(0),
            8 if m <= 8 else 16, gpc, chunks, split, fused, max(1024, next_pow2(k)), bias is not None)
    kernel = _w4a8_decode_gluon[(grid,)](
        x, x_hat, weight_words(qweight), beta, scales, beta if bias is None else bias, pts_exp, work, counters, y,
        *ints, num_warps=4)
    return kernel, grid, split > 1, ints


def _check(m: int, k: int, qweight: torch.Tensor, scales: torch.Tensor) -> None:
    check_gemm_operands(m, k, qweight, scales)
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
    """The GEMM alone: ``y = β · 2⁻ⁿ · Σ_g σ_g (x̂_g ŵ_gᵀ) + bias`` for ``M ≤ 16`` tokens from ``x̂`` in fragment
    order, as :func:`~quantpatch.kernels.w4a8.w4a8_prefill_gluon.w4a8_gemm_prefill_gluon` (``gps``: groups per split-K
    run, ``gpc``: groups per chunk, :func:`run_shape`; both None: :func:`default_run`).

    Args:
        x_hat: ``float8_e4m3fn (M, K)``, contiguous, K a multiple of 128, each 128-group in fragment order
            (``quantize_activation_fp8(x, fragment_order=True)``).
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
    check_x_hat(x_hat)
    y = torch.empty((m, qweight.shape[0]), device=x_hat.device, dtype=out_dtype)
    if m and y.shape[1]:
        _launch(None, x_hat, x_scale, qweight, scales, pts_exp, bias, y, gps, gpc)
    return y


def w4a8_linear_gluon(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, pts_exp: torch.Tensor,
    bias: torch.Tensor | None = None, *, gps: int | None = None, gpc: int | None = None,
) -> torch.Tensor:
    """The whole layer on ``x (M ≤ 16, K)`` (last dim contiguous) → ``y (M, N)`` in ``x``'s dtype: what
    :func:`~quantpatch.kernels.w4a8.w4a8_triton.w4a8_linear_2d` runs for M ≤ 16 on sm_90.

    ``K ≤ DECODE_QBLOCK``: one launch, the quantization of
    :func:`~quantpatch.kernels.w4a8.w4a8_act_quant_triton.quantize_activation_fp8` (fragment order, bit for bit) fused
    with the GEMM. Longer rows: that quantization kernel, then the GEMM (fused, a row's several dependent loads, behind
    the GEMM programs' weight loads in the memory queues, held every GEMM program up: 14336 → 4096 at 16 tokens took
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
            _launch(None, *quantize_activation_fp8(x, fragment_order=True), qweight, scales, pts_exp, bias, y, gps, gpc)
    return y
