"""FireQ W4A8-FP linear in Triton: per-token FP8 activation quantization and the INT4 × FP8 GEMM.

Three kernels behind one ``torch.library.custom_op``, ``quantpatch::w4a8_linear`` (:func:`w4a8_linear_op`,
with ``register_fake``; launched on the current stream), reproducing :mod:`quantpatch.kernels.w4a8.w4a8_ref`
(``weight_operand="group"``):

* activation quantization (:func:`~quantpatch.kernels.w4a8.w4a8_act_quant_triton.quantize_activation_fp8`, shared with
  the Gluon kernels), one program per token: ``a = max_k |x|``, ``β = bf16(a / 448)`` (1 if 0),
  ``x̂ = e4m3(x / β)`` saturating, bit-exact with :func:`~quantpatch.kernels.w4a8.w4a8_ref.quantize_activation_fp8`.
* the GEMM (:func:`w4a8_gemm`)::

      P_g  = x̂[:, g] · ŵ[:, g]ᵀ        one dot per 128-group g, fp32 accumulator
      acc += P_g ⊙ σ[:, g]ᵀ            the group's e4m3 scale, per output channel, fp32
      y    = (acc ⊙ β) · 2⁻ⁿ + bias    epilogue: per-token BF16 scale, exact PTS factor, bias → out dtype

  in two kernels (a third on sm_90, below). Decode (M ≤ 16, :func:`_w4a8_decode_kernel`): one launch in which
  the first M programs quantize the tokens and the GEMM programs wait for them (where a row fits one chunk),
  ``BLOCK_N`` output channels per program over a run of groups, even/odd input channels as two fp16 tensor-core
  dots (transposed, ``ŵ x̂ᵀ``, so the unpacked weights are wgmma's register operand), split-K runs summed in a
  fixed order by the last program to arrive (deterministic). Larger M (:func:`_w4a8_gemm_kernel`): the activation
  kernel, then FP8 tensor-core tiles over all of K. INT4 → fp16 by bit tricks (:func:`_int4_nibbles_fp16`).
  ``n`` (``pts_exp``) is read from device memory, so a forward never syncs the host.
* on sm_90, M ≤ 16: the Gluon decode kernel (:mod:`quantpatch.kernels.w4a8.w4a8_gluon`, the quantization fused in
  the same way, same numerics) instead of :func:`_w4a8_decode_kernel`; M > 16: the activation kernel writing x̂
  in fragment order, then the Gluon prefill GEMM (:mod:`quantpatch.kernels.w4a8.w4a8_prefill_gluon`: FP8 wgmma, the
  INT4 weights as its register operand, x̂ by TMA; the tiled kernel's numerics) instead of
  :func:`_w4a8_gemm_kernel`; where ``triton.experimental.gluon`` imports (:data:`GLUON`, :data:`PREFILL_GLUON`
  say why not, once per device, in the log).

Configurations come from one fixed table (:func:`gemm_config`), not a run-time autotuner, so a
given shape always runs the same program.

Difference to the reference: only the order of the fp32 sums (within a group, the dot's own
order — for the decode kernel the 64 even then the 64 odd channels; across groups, sequential
here and per split-K run); the products ``x̂ ŵ`` are exact in fp32 and the epilogue applies the
same operations in the same order. On Hopper the FP8 MMA accumulates in a narrower register
(≈ 13 mantissa bits, SageAttention2 §3.4; DeepSeek-V3 §3.3.2), which is why each group's partial
is promoted to fp32 after 128 products (see the tests' bounds); the decode kernel's fp16 MMA
accumulates in fp32.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import triton
import triton.language as tl

from ..compiled_launch import cdiv, interpreting, next_pow2, stream_key
from ..device import GluonGate, cuda_unsupported
from .w4a8_act_quant_triton import DECODE_BLOCK_M, DECODE_QBLOCK, _quantize_row, quantize_activation_fp8
from .w4a8_ref import GROUP_SIZE, check_gemm_operands
from .w4a8_scratch import _scratch, _x_hat_scratch

# --------------------------------------------------------------------------- GEMM


@triton.jit
def _int4_nibbles_fp16(wb):
    """Packed bytes (uint8) → (low, high) nibbles as fp16 integers −8…7, by bit tricks, no int→float convert.

    ``(v ^ 8) | 0x6400`` is the fp16 ``1024 + (v + 8)``: the nibble, moved to offset binary, in the mantissa
    of 2¹⁰; subtracting 1032 is exact in fp16 (integers below 2048).
    """
    b = wb.to(tl.int16)  # zero-extends the unsigned byte
    magic = tl.full((), 1032.0, tl.float16)
    lo = (((b & 0xF) ^ 0x8) | 0x6400).to(tl.float16, bitcast=True) - magic
    hi = (((b >> 4) ^ 0x8) | 0x6400).to(tl.float16, bitcast=True) - magic
    return lo, hi


@triton.jit
def _unpack_int4_fp8(wb, BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
    """``uint8 [BLOCK_N, GROUP/2]`` → e4m3 ``[BLOCK_N, GROUP]``: low nibble = even channel, high = odd."""
    lo, hi = _int4_nibbles_fp16(wb)
    w = tl.reshape(tl.join(lo, hi), [BLOCK_N, GROUP])  # [n, c, 0] = channel 2c, [n, c, 1] = 2c + 1
    return w.to(tl.float8e4nv)  # −8…7: exact in e4m3


@triton.jit
def _w4a8_gemm_kernel(
    A_ptr, AP_ptr, AS_ptr, W_ptr, WS_ptr, B_ptr, PTS_ptr, Y_ptr,
    M, N, GROUPS,
    stride_am, stride_wn, stride_sn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr, SWAP: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """Outputs ``[BLOCK_M, BLOCK_N]``: ``Σ_g σ_g (x̂_g ŵ_gᵀ)`` by FP8 tensor-core dots, then :func:`_epilogue`.

    ``SWAP = 0``: ``ŵ`` unpacked to ``[BLOCK_N, GROUP]`` (nibbles interleaved back into channel order) as the
    shared-memory operand. ``SWAP = 1``: the transposed product ``ŵ x̂ᵀ``, as the decode kernel: even and odd
    channels as two dots, so the unpacked weights stay elementwise and can be the register operand of wgmma;
    ``x̂`` (``AP``: the same bytes as int16 pairs) is split into its even and odd channels instead.
    """
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    offs_k = tl.arange(0, GROUP)
    offs_b = tl.arange(0, GROUP // 2)
    w_ptrs = W_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_b[None, :]
    s_ptrs = WS_ptr + offs_n.to(tl.int64) * stride_sn
    if SWAP:
        ap_ptrs = AP_ptr + offs_m.to(tl.int64)[:, None] * (stride_am // 2) + offs_b[None, :]
        acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for g in range(0, GROUPS):
            xp = tl.load(ap_ptrs + g * (GROUP // 2), mask=m_ok[:, None], other=0)
            x_even = (xp & 0xFF).to(tl.int8).to(tl.float8e4nv, bitcast=True)  # low byte: channel 2c
            x_odd = (xp >> 8).to(tl.int8).to(tl.float8e4nv, bitcast=True)
            lo, hi = _int4_nibbles_fp16(tl.load(w_ptrs + g * (GROUP // 2), mask=n_ok[:, None], other=0))
            sigma = tl.load(s_ptrs + g, mask=n_ok, other=0.0).to(tl.float32)
            part = tl.dot(hi.to(tl.float8e4nv), tl.trans(x_odd), tl.dot(lo.to(tl.float8e4nv), tl.trans(x_even)))
            acc_t += part * sigma[:, None]
        acc = tl.trans(acc_t)
    else:
        a_ptrs = A_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for g in range(0, GROUPS):
            a = tl.load(a_ptrs + g * GROUP, mask=m_ok[:, None], other=0.0)
            w = _unpack_int4_fp8(tl.load(w_ptrs + g * (GROUP // 2), mask=n_ok[:, None], other=0), BLOCK_N, GROUP)
            sigma = tl.load(s_ptrs + g, mask=n_ok, other=0.0).to(tl.float32)
            acc += tl.dot(a, tl.trans(w)) * sigma[None, :]  # the group's own fp32 partial, then × σ
    y = _epilogue(acc, AS_ptr, B_ptr, PTS_ptr, offs_m, offs_n, m_ok, n_ok, HAS_BIAS)
    tl.store(Y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], y.to(Y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _decode_consumer(
    c, XP_ptr, AS_ptr, W_ptr, WS_ptr, B_ptr, PTS_ptr, P_ptr, C_ptr, Y_ptr,
    M, N, K, GROUPS_PER_SPLIT, stride_wn, stride_sn, stride_ym,
    BLOCK_N: tl.constexpr, GROUP: tl.constexpr, SPLIT_K: tl.constexpr,
    FUSED: tl.constexpr, SWAP: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """GEMM program ``c``: ``BLOCK_N`` output channels (tile ``c mod tiles``) over the groups of run ``c div tiles``.

    A group's dot is ``x̂_even ŵ_evenᵀ + x̂_odd ŵ_oddᵀ`` (low nibbles = even input channels, high = odd) as two
    fp16 tensor-core dots with an fp32 accumulator, on operands fp16 holds exactly (e4m3 values, −8…7).
    ``SWAP``: computed transposed, ``ŵ x̂ᵀ`` (``BLOCK_N`` rows: Hopper's wgmma, the weights as the register operand).
    """
    BLOCK_M: tl.constexpr = 16  # DECODE_BLOCK_M: the fp16 mma's row count
    HALF: tl.constexpr = GROUP // 2
    tiles = tl.cdiv(N, BLOCK_N)
    pid_n = c % tiles
    pid_k = c // tiles
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    offs_c = tl.arange(0, HALF)  # byte c of a group holds input channels 2c (low) and 2c + 1 (high)
    x_ptrs = XP_ptr + offs_m[:, None] * (K // 2) + offs_c[None, :]  # x̂ as int16: one e4m3 pair per element
    w_ptrs = W_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_c[None, :]
    s_ptrs = WS_ptr + offs_n.to(tl.int64) * stride_sn
    g0 = pid_k * GROUPS_PER_SPLIT
    g1 = tl.minimum(g0 + GROUPS_PER_SPLIT, K // GROUP)
    # Software pipeline in registers (Triton does not pipeline loads that reach the dot through bit operations):
    # the weights and scales of groups g + 1 and g + 2 and x̂ of g + 1 are in flight while group g is computed;
    # the first two weight tiles are asked for before the wait on the fused quantization.
    # (a group past the run: row limit ≤ 0, nothing loaded; integer limits, as the interpreter masks no scalar bools)
    n_a = tl.minimum(N, (g1 - g0) * N)
    wa = tl.load(w_ptrs + g0 * HALF, mask=offs_n[:, None] < n_a, other=0)
    sa = tl.load(s_ptrs + g0, mask=offs_n < n_a, other=0.0)
    n_b = tl.minimum(N, (g1 - g0 - 1) * N)
    wb = tl.load(w_ptrs + (g0 + 1) * HALF, mask=offs_n[:, None] < n_b, other=0)
    sb = tl.load(s_ptrs + g0 + 1, mask=offs_n < n_b, other=0.0)
    if FUSED:  # x̂ and β are written by programs 0…M-1 of this launch: wait for all M (acquire)
        while tl.atomic_add(C_ptr, 0, sem="acquire", scope="gpu") < M:
            pass
    xa = tl.load(x_ptrs + g0 * HALF, mask=offs_m[:, None] < tl.minimum(M, (g1 - g0) * M), other=0,
                 cache_modifier=".cg")  # .cg: from L2, never a stale L1
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g in range(g0, g1):
        n_c = tl.minimum(N, (g1 - g - 2) * N)
        wc = tl.load(w_ptrs + (g + 2) * HALF, mask=offs_n[:, None] < n_c, other=0)
        sc = tl.load(s_ptrs + g + 2, mask=offs_n < n_c, other=0.0)
        xb = tl.load(x_ptrs + (g + 1) * HALF, mask=offs_m[:, None] < tl.minimum(M, (g1 - g - 1) * M), other=0,
                     cache_modifier=".cg")
        w_even, w_odd = _int4_nibbles_fp16(wa)
        x_even = (xa & 0xFF).to(tl.int8).to(tl.float8e4nv, bitcast=True).to(tl.float16)  # low byte: channel 2c
        x_odd = (xa >> 8).to(tl.int8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        sigma = sa.to(tl.float32)
        if SWAP:
            part = tl.dot(w_odd, tl.trans(x_odd), tl.dot(w_even, tl.trans(x_even)))
            acc += part * sigma[:, None]
        else:
            part = tl.dot(x_odd, tl.trans(w_odd), tl.dot(x_even, tl.trans(w_even)))
            acc += part * sigma[None, :]
        wa, wb, sa, sb, xa = wb, wc, sb, sc, xb
    if SWAP:
        acc = tl.trans(acc)
    mask = m_ok[:, None] & n_ok[None, :]
    y_ptrs = Y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    if SPLIT_K == 1:
        y = _epilogue(acc, AS_ptr, B_ptr, PTS_ptr, offs_m, offs_n, m_ok, n_ok, HAS_BIAS)
        tl.store(y_ptrs, y.to(Y_ptr.dtype.element_ty), mask=mask)
    else:
        p_ptrs = P_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(p_ptrs + pid_k * M * N, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the ticket (release) is taken
        ticket = tl.atomic_add(C_ptr + 2 + pid_n, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:  # the last run of this tile: the partials in a fixed order (loads unrolled)
            total = tl.load(p_ptrs, mask=mask, other=0.0, cache_modifier=".cg")  # .cg: from L2, not a stale L1
            for s in tl.static_range(1, SPLIT_K):
                total += tl.load(p_ptrs + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            y = _epilogue(total, AS_ptr, B_ptr, PTS_ptr, offs_m, offs_n, m_ok, n_ok, HAS_BIAS)
            tl.store(y_ptrs, y.to(Y_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(C_ptr + 2 + pid_n, 0)
    if FUSED:  # the last GEMM program past the wait sets the flag (and this count) back to 0 for the next launch
        if tl.atomic_add(C_ptr + 1, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - M - 1:
            tl.atomic_xchg(C_ptr, 0)
            tl.atomic_xchg(C_ptr + 1, 0)


@triton.jit
def _w4a8_decode_kernel(
    X_ptr, XQ_ptr, XP_ptr, AS_ptr, W_ptr, WS_ptr, B_ptr, PTS_ptr, P_ptr, C_ptr, Y_ptr,
    M, N, K, GROUPS_PER_SPLIT,
    stride_xm, stride_wn, stride_sn, stride_ym,
    BLOCK_N: tl.constexpr, GROUP: tl.constexpr, SPLIT_K: tl.constexpr,
    FUSED: tl.constexpr, SWAP: tl.constexpr, QBLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr, EMULATE: tl.constexpr,
):
    """Few tokens (``M ≤ 16``), one launch: ``tiles × SPLIT_K`` GEMM programs (:func:`_decode_consumer`).

    ``FUSED``: programs ``0…M-1`` first quantize token ``m`` (:func:`_quantize_row`: ``x`` → ``x̂``, ``β`` in the
    workspaces ``XQ``/``AS``) and count themselves on the flag ``C[0]`` (release); the GEMM programs come after
    them in the grid and wait on that flag. They wait only on programs of lower index, which the GPU starts
    first, so the wait cannot deadlock (the assumption of Stream-K's and decoupled look-back's waits; the
    interpreter runs programs in index order). Without ``FUSED``, ``x̂``/``β`` come from
    :func:`quantize_activation_fp8`.

    ``SPLIT_K > 1``: each run stores its fp32 sum in the workspace ``P (SPLIT_K, M, N)`` and takes a ticket
    from the N tile's counter ``C[2 + pid_n]``; the run that draws the last ticket sums the ``SPLIT_K``
    partials in a fixed order (the same result whoever arrives last), applies the epilogue and sets the
    counter back to 0 for the next launch. No atomics on data: deterministic.
    """
    pid = tl.program_id(0)
    if FUSED:
        if pid < M:
            _quantize_row(X_ptr + pid.to(tl.int64) * stride_xm, XQ_ptr + pid * K, AS_ptr + pid, K, QBLOCK, False,
                          EMULATE)
            tl.debug_barrier()  # every thread's x̂ is written before the flag (release) counts this token
            tl.atomic_add(C_ptr, 1, sem="release", scope="gpu")
        else:
            _decode_consumer(pid - M, XP_ptr, AS_ptr, W_ptr, WS_ptr, B_ptr, PTS_ptr, P_ptr, C_ptr, Y_ptr,
                             M, N, K, GROUPS_PER_SPLIT, stride_wn, stride_sn, stride_ym,
                             BLOCK_N, GROUP, SPLIT_K, FUSED, SWAP, HAS_BIAS)
    else:
        _decode_consumer(pid, XP_ptr, AS_ptr, W_ptr, WS_ptr, B_ptr, PTS_ptr, P_ptr, C_ptr, Y_ptr,
                         M, N, K, GROUPS_PER_SPLIT, stride_wn, stride_sn, stride_ym,
                         BLOCK_N, GROUP, SPLIT_K, FUSED, SWAP, HAS_BIAS)


@triton.jit
def _epilogue(acc, AS_ptr, B_ptr, PTS_ptr, offs_m, offs_n, m_ok, n_ok, HAS_BIAS: tl.constexpr):
    """``(acc ⊙ β) · 2⁻ⁿ (+ bias)`` in fp32, in the reference's order (``acc * beta * 2**-n + bias``)."""
    beta = tl.load(AS_ptr + offs_m, mask=m_ok, other=1.0, cache_modifier=".cg").to(tl.float32)  # .cg: see decode
    n_pts = tl.load(PTS_ptr)
    inv_delta = ((127 - n_pts) << 23).to(tl.float32, bitcast=True)  # 2⁻ⁿ exactly (0 ≤ n ≤ 126)
    y = acc * beta[:, None] * inv_delta
    if HAS_BIAS:
        y += tl.load(B_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    return y


# (max M, config): the first row whose max M ≥ M. ``decode`` (M ≤ DECODE_BLOCK_M): :func:`_w4a8_decode_kernel`,
# BLOCK_N channels per program, split-K into runs of ``gps`` groups (longer where K is long: at most MAX_SPLIT
# runs), ``swap`` (the wgmma orientation), ``fused``: the activation quantization in the same launch where a
# token's row fits one DECODE_QBLOCK chunk (a longer row, read in several passes by one program, would hold
# every GEMM program up: there the activation kernel runs first). ``tiled``: the activation kernel, then
# BLOCK_M × BLOCK_N FP8 tiles over all of K. Picked on an H200 by ``eval/bench_linear.py --tune``.
GEMM_CONFIGS = (
    (16, dict(kernel="decode", block_n=64, gps=8, fused=1, swap=1, num_warps=4)),
    (256, dict(kernel="tiled", block_m=128, block_n=64, swap=0, num_warps=4, num_stages=4)),
    (None, dict(kernel="tiled", block_m=128, block_n=64, swap=1, num_warps=4, num_stages=4)),
)
MAX_SPLIT = 16  # split-K runs of the decode kernel (their partials are summed from registers)
COUNTERS = 2  # decode workspace counters ahead of the per-tile tickets: the quantization flag, the done count


def gemm_config(m: int, n: int, k: int) -> dict:
    """The launch configuration of :func:`w4a8_gemm` for ``M × K → N`` (a fixed table: deterministic)."""
    for max_m, cfg in GEMM_CONFIGS:
        if max_m is None or m <= max_m:
            return cfg
    raise AssertionError("GEMM_CONFIGS must end with a max-M None row")


def decode_split(cfg: dict, n: int, groups: int) -> tuple[int, int]:
    """``(SPLIT_K, groups per run)`` of the decode kernel: runs of ``cfg["gps"]`` groups, at most ``MAX_SPLIT``."""
    split = max(1, min(MAX_SPLIT, cdiv(groups, cfg["gps"])))
    gps = cdiv(groups, split)
    return cdiv(groups, gps), gps


def _semaphores(device: torch.device, count: int) -> torch.Tensor:
    """The decode kernel's int32 counters for the current stream: 0 between launches."""
    return _scratch(stream_key(device), "counters", count, torch.int32, device)


def _launch_decode(x, x_hat, beta, qweight, scales, pts_exp, bias, y, cfg: dict) -> None:
    """One launch of :func:`_w4a8_decode_kernel`: from ``x`` (quantization fused) if given, else from ``x̂, β``."""
    m, n, k = y.shape[0], y.shape[1], qweight.shape[1] * 2
    if m > DECODE_BLOCK_M:
        raise ValueError(f"the decode kernel takes M ≤ {DECODE_BLOCK_M} tokens, got {m}")
    device = y.device
    key = stream_key(device)
    bn = cfg["block_n"]
    tiles = cdiv(n, bn)
    split, gps = decode_split(cfg, n, k // GROUP_SIZE)
    fused = x is not None
    counters = _scratch(key, "counters", COUNTERS + tiles, torch.int32, device)
    work = _scratch(key, "partials", split * m * n, torch.float32, device) if split > 1 else y
    if fused:
        x_hat, x_pairs = _x_hat_scratch(key, m * k, device)
        beta = _scratch(key, "beta", m, torch.bfloat16, device)
        x_arg, stride_xm = x, x.stride(0)
    else:
        if x_hat.stride(0) != k:
            x_hat = x_hat.contiguous()
        x_arg, stride_xm, x_pairs = x_hat, 0, x_hat.view(torch.int16)
    _w4a8_decode_kernel[((m if fused else 0) + tiles * split,)](
        x_arg, x_hat, x_pairs, beta, qweight, scales, bias if bias is not None else beta, pts_exp,
        work, counters, y, m, n, k, gps, stride_xm, qweight.stride(0), scales.stride(0), y.stride(0),
        BLOCK_N=bn, GROUP=GROUP_SIZE, SPLIT_K=split, FUSED=fused,
        SWAP=cfg.get("swap", 0), QBLOCK=min(DECODE_QBLOCK, next_pow2(k)),
        HAS_BIAS=bias is not None, EMULATE=interpreting(), num_warps=cfg["num_warps"], num_stages=1,
    )


def _launch_tiled(x_hat, beta, qweight, scales, pts_exp, bias, y, cfg: dict) -> None:
    m, n = y.shape
    bm, bn = cfg["block_m"], cfg["block_n"]
    swap = cfg.get("swap", 0)
    _w4a8_gemm_kernel[(cdiv(n, bn), cdiv(m, bm))](
        x_hat, x_hat.view(torch.int16) if swap else x_hat, beta, qweight, scales,
        bias if bias is not None else beta, pts_exp, y, m, n,
        qweight.shape[1] * 2 // GROUP_SIZE, x_hat.stride(0), qweight.stride(0), scales.stride(0), y.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, GROUP=GROUP_SIZE, SWAP=swap, HAS_BIAS=bias is not None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def w4a8_gemm(
    x_hat: torch.Tensor,
    x_scale: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    pts_exp: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    config: dict | None = None,
) -> torch.Tensor:
    """``y = β · 2⁻ⁿ · Σ_g σ_g (x̂_g ŵ_gᵀ) + bias`` on quantized operands (the GEMM alone).

    Args:
        x_hat: ``float8_e4m3fn (M, K)``, K a multiple of 128, last dim contiguous.
        x_scale: ``bfloat16 (M,)`` per-token scales β.
        qweight: ``uint8 (N, K/2)`` packed INT4 (layout of :func:`~quantpatch.kernels.w4a8.w4a8_ref.quantize_weight`).
        scales: ``float8_e4m3fn (N, K/128)`` group scales σ.
        pts_exp: ``int32 ()`` PTS exponent ``n`` (on the device: read by the kernel).
        bias: ``(N,)`` or None.
        out_dtype: float16, bfloat16 or float32.
        config: launch override (a ``GEMM_CONFIGS`` entry), for benchmarks and tests.

    Returns:
        ``y (M, N)`` in ``out_dtype``.
    """
    m, k = x_hat.shape
    check_gemm_operands(m, k, qweight, scales)
    if x_hat.stride(-1) != 1:
        raise ValueError("x_hat needs a contiguous last dim")
    cfg = gemm_config(m, qweight.shape[0], k) if config is None else config
    y = torch.empty((m, qweight.shape[0]), device=x_hat.device, dtype=out_dtype)
    if m == 0 or y.shape[1] == 0:
        return y
    if cfg["kernel"] == "decode":
        _launch_decode(None, x_hat, x_scale, qweight, scales, pts_exp, bias, y, cfg)
    else:
        _launch_tiled(x_hat, x_scale, qweight, scales, pts_exp, bias, y, cfg)
    return y


def w4a8_linear_2d(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, pts_exp: torch.Tensor,
    bias: torch.Tensor | None = None, *, config: dict | None = None,
) -> torch.Tensor:
    """The whole layer on ``x (M, K)`` (last dim contiguous) → ``y (M, N)`` in ``x``'s dtype.

    :func:`uses_gluon` (sm_90, no ``config``): for M ≤ 16 the Gluon decode kernel (quantization fused where
    K ≤ ``DECODE_QBLOCK``), above the quantization (fragment order) and the Gluon prefill GEMM. Else M ≤ 16 and
    K ≤ ``DECODE_QBLOCK``: one launch (quantization fused into the Triton decode GEMM); otherwise
    :func:`quantize_activation_fp8`, then the decode or tiled GEMM.
    """
    m, k = x.shape
    n = qweight.shape[0]
    gate = _gluon_gate(m, n, k)  # (:func:`uses_gluon`, the table looked up once)
    if config is None and gate.unsupported(x.device) is None:
        try:
            return _gluon_linear(gate)(x, qweight, scales, pts_exp, bias)
        except triton.CompilationError as err:  # a Triton whose Gluon API differs: warn once, Triton serves
            gate.close(x.device, err)
    check_gemm_operands(m, k, qweight, scales)
    cfg = gemm_config(m, n, k) if config is None else config
    y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    if m == 0 or n == 0:
        return y
    if cfg["kernel"] == "decode" and cfg.get("fused", 0) and k <= DECODE_QBLOCK:
        _launch_decode(x, None, None, qweight, scales, pts_exp, bias, y, cfg)
        return y
    x_hat, beta = quantize_activation_fp8(x)
    if cfg["kernel"] == "decode":
        _launch_decode(None, x_hat, beta, qweight, scales, pts_exp, bias, y, cfg)
    else:
        _launch_tiled(x_hat, beta, qweight, scales, pts_exp, bias, y, cfg)
    return y


# --------------------------------------------------------------------------- custom op


@torch.library.custom_op("quantpatch::w4a8_linear", mutates_args=())
def w4a8_linear_op(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, pts_exp: torch.Tensor, bias: Optional[torch.Tensor],
) -> torch.Tensor:
    """The whole layer on ``x (M, K)`` as one op (:func:`w4a8_linear_2d`): what ``torch.compile`` sees."""
    return w4a8_linear_2d(x, qweight, scales, pts_exp, bias)


@w4a8_linear_op.register_fake
def _(x, qweight, scales, pts_exp, bias):
    return x.new_empty((x.shape[0], qweight.shape[0]))


def w4a8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, pts_exp: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """End to end: ``x (..., K)`` → ``y (..., N)`` in ``x``'s dtype.

    Eager calls go straight to :func:`w4a8_linear_2d` (the custom op's dispatch costs more host time than a
    decode-sized GEMM takes on the GPU); under ``torch.compile`` through the custom op.
    """
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if torch.compiler.is_compiling():
        y = w4a8_linear_op(x2, qweight, scales, pts_exp, bias)
    else:
        y = w4a8_linear_2d(x2, qweight, scales, pts_exp, bias)
    return y.view(*x.shape[:-1], qweight.shape[0])


# --------------------------------------------------------------------------- the Gluon decode kernel (sm_90)


def _gluon_gate(m: int, n: int, k: int) -> GluonGate:
    """The gate of the Gluon kernel for ``M × K → N``: the decode kernel's where the table picks the decode kernel
    (M ≤ 16), the prefill kernel's above."""
    return GLUON if gemm_config(m, n, k)["kernel"] == "decode" else PREFILL_GLUON


def _gluon_linear(gate: GluonGate) -> Callable[..., torch.Tensor]:
    """The Gluon wrapper behind ``gate`` (:func:`_gluon_gate`): the decode kernel's or the prefill kernel's."""
    return _gluon.w4a8_linear_gluon if gate is GLUON else _prefill.w4a8_linear_prefill_gluon


def linear_2d_of(m: int, n: int, k: int, device: torch.device) -> Callable[..., torch.Tensor]:
    """The function :func:`w4a8_linear_2d` hands ``M × K → N`` to on ``device`` where :func:`uses_gluon` (the Gluon
    decode or prefill wrapper; same arguments), else :func:`w4a8_linear_2d` itself: what a planned call of that
    shape runs."""
    gate = _gluon_gate(m, n, k)
    return w4a8_linear_2d if gate.unsupported(device) is not None else _gluon_linear(gate)


def uses_gluon(m: int, n: int, k: int, device: torch.device) -> bool:
    """Whether :func:`w4a8_linear_2d` runs a Gluon kernel for ``M × K → N`` on ``device``: the decode kernel for
    M ≤ 16, the prefill kernel above, where that kernel's gate (:data:`GLUON`, :data:`PREFILL_GLUON`) gives no
    reason."""
    return _gluon_gate(m, n, k).unsupported(device) is None


# --------------------------------------------------------------------------- W4A8Linear fast path (its gates)

OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def device_unsupported(x: torch.Tensor) -> str | None:
    """Why ``x``'s device cannot run the kernels (None if it can): FP8 ``tl.dot`` needs CUDA sm_89+."""
    if not x.is_cuda:
        return cuda_unsupported(x, (8, 9), "FP8 dots")
    if x.device not in _DEVICE_REASONS:  # asked once per device, not on every forward
        _DEVICE_REASONS[x.device] = cuda_unsupported(x, (8, 9), "FP8 dots")
    return _DEVICE_REASONS[x.device]


_DEVICE_REASONS: dict[torch.device, str | None] = {}


def layer_unsupported(x: torch.Tensor, module) -> str | None:
    """Why the kernels cannot take this layer or input on a capable device (None if they can)."""
    if module.group_size != GROUP_SIZE:
        return f"group_size={module.group_size} (the kernels take {GROUP_SIZE})"
    if module.in_features % GROUP_SIZE:
        return f"in_features={module.in_features} is not a multiple of {GROUP_SIZE}"
    if module.weight_operand != "group":
        return f"weight_operand={module.weight_operand!r} (the kernels take 'group')"
    if x.dtype not in OUT_DTYPES:
        return f"input dtype {x.dtype} (the kernels take float16 / bfloat16 / float32)"
    return None


# the Gluon modules need Triton 3.6's triton.experimental.gluon
try:
    from . import w4a8_gluon as _gluon
    from . import w4a8_prefill_gluon as _prefill

    _GLUON_IMPORT_ERROR = None
except ImportError as _err:
    _gluon, _prefill, _GLUON_IMPORT_ERROR = None, None, str(_err)
GLUON = GluonGate(f"W4A8 decode (M ≤ {DECODE_BLOCK_M})", "the Triton decode kernel", _GLUON_IMPORT_ERROR)
PREFILL_GLUON = GluonGate(f"W4A8 prefill (M > {DECODE_BLOCK_M})", "the Triton tiled kernel", _GLUON_IMPORT_ERROR)
