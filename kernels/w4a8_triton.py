"""FireQ W4A8-FP linear in Triton: per-token FP8 activation quantization and the INT4 × FP8 GEMM.

Three kernels behind one ``torch.library.custom_op``, ``quantpatch::w4a8_linear`` (:func:`w4a8_linear_op`,
with ``register_fake``; launched on the current stream), reproducing :mod:`quantpatch.kernels.w4a8_ref`
(``weight_operand="group"``):

* activation quantization (:func:`quantize_activation_fp8`), one program per token:
  ``a = max_k |x|``, ``β = bf16(a / 448)`` (1 if 0), ``x̂ = e4m3(x / β)`` saturating.
  Bit-exact with :func:`~quantpatch.kernels.w4a8_ref.quantize_activation_fp8` computing in
  float32: an IEEE division (``div_rn``), round-half-even to bf16 by integer arithmetic (the
  interpreter's own cast truncates), and the shared saturating e4m3 cast of
  :mod:`~quantpatch.kernels.qk_quant_triton`. A row of up to ``ACT_BLOCK_K`` is read once.
* the GEMM (:func:`w4a8_gemm`)::

      P_g  = x̂[:, g] · ŵ[:, g]ᵀ        one dot per 128-group g, fp32 accumulator
      acc += P_g ⊙ σ[:, g]ᵀ            the group's e4m3 scale, per output channel, fp32
      y    = (acc ⊙ β) · 2⁻ⁿ + bias    epilogue: per-token BF16 scale, exact PTS factor, bias → out dtype

  in two kernels. Decode (M ≤ 16, :func:`_w4a8_decode_kernel`): ``BLOCK_N`` output channels per
  program streaming the packed bytes as stored, even/odd input channels as two fp16 ``mma`` dots,
  split-K with the runs summed in a fixed order by the last program to arrive (one launch,
  deterministic). Larger M (:func:`_w4a8_gemm_kernel`): FP8 tensor-core tiles over all of K, ``ŵ``
  unpacked in registers (sign-extending shifts, ``tl.join``) to e4m3. ``n`` (``pts_exp``) is read
  from device memory, so a forward never syncs the host.

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

from typing import Optional

import torch
import triton
import triton.language as tl

from quantpatch.dispatch import cuda_unsupported
from quantpatch.fallback import fall_back, note_implementation
from quantpatch.w4a8_linear import register_w4a8_fast_path

from .qk_quant_triton import _to_fp8e4m3, interpreting
from .w4a8_ref import GROUP_SIZE

ACT_BLOCK_K = 16384  # activation-quantization chunk along K: a row up to this long is read once


# --------------------------------------------------------------------------- activation quantization


@triton.jit
def _bf16_rne(x):
    """Round positive finite fp32 ``x`` to the nearest bf16 (ties to even), returned as fp32."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536 = 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _w4a8_quantize_activation_kernel(
    X_ptr, XQ_ptr, S_ptr,
    K, stride_xm, stride_qm,
    BLOCK_K: tl.constexpr, EMULATE: tl.constexpr,
):
    """Token ``m``: ``β = bf16(max|x| / 448)`` (1 if 0), ``x̂ = e4m3(x / β)`` (saturating, RNE).

    A row of ``K ≤ BLOCK_K`` is loaded once and quantized from registers; a longer one in two passes.
    """
    m = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    x_row = X_ptr + m * stride_xm
    q_row = XQ_ptr + m * stride_qm
    x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
    amax = tl.abs(x)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        amax = tl.maximum(amax, tl.abs(tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)))
    beta = tl.math.div_rn(tl.max(amax, 0), 448.0)  # e4m3 max
    beta = tl.where(beta == 0.0, 1.0, beta)  # symmetric_scale: an all-zero token gets 1
    beta = _bf16_rne(beta)
    beta = tl.where(beta == 0.0, 1.0, beta)  # bf16 underflow (absmax < ~1e-36)
    tl.store(q_row + offs, _to_fp8e4m3(tl.math.div_rn(x, beta), EMULATE), mask=offs < K)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        mask = k0 + offs < K
        x = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(q_row + k0 + offs, _to_fp8e4m3(tl.math.div_rn(x, beta), EMULATE), mask=mask)
    tl.store(S_ptr + m, beta.to(tl.bfloat16))  # exact: beta is on the bf16 grid


def quantize_activation_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token FP8 quantization of ``x (M, K)`` (fp16/bf16/fp32, last dim contiguous).

    Returns:
        ``x̂ float8_e4m3fn (M, K)`` and ``β bfloat16 (M,)`` with ``x ≈ β x̂``; the numerics of
        :func:`quantpatch.kernels.w4a8_ref.quantize_activation_fp8` (float32) bit for bit.
    """
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be 2-D (M, K) with a contiguous last dim, got shape {tuple(x.shape)}")
    m, k = x.shape
    x_hat = torch.empty((m, k), device=x.device, dtype=torch.float8_e4m3fn)
    beta = torch.empty((m,), device=x.device, dtype=torch.bfloat16)
    if m:
        block_k = min(ACT_BLOCK_K, triton.next_power_of_2(max(k, 16)))
        _w4a8_quantize_activation_kernel[(m,)](
            x, x_hat, beta, k, x.stride(0), x_hat.stride(0),
            BLOCK_K=block_k, EMULATE=interpreting(), num_warps=max(1, min(16, block_k // 512)),
        )
    return x_hat, beta


# --------------------------------------------------------------------------- GEMM


@triton.jit
def _unpack_int4_fp8(wb, BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
    """``uint8 [BLOCK_N, GROUP/2]`` → e4m3 ``[BLOCK_N, GROUP]``: low nibble = even channel, high = odd."""
    s = wb.to(tl.int8, bitcast=True)
    lo = (s << 4) >> 4  # arithmetic shifts sign-extend the 4-bit two's complement
    hi = s >> 4
    w = tl.reshape(tl.join(lo, hi), [BLOCK_N, GROUP])  # [n, c, 0] = channel 2c, [n, c, 1] = 2c + 1
    return w.to(tl.float16).to(tl.float8e4nv)  # −8…7: exact in fp16 and in e4m3


@triton.jit
def _w4a8_gemm_kernel(
    A_ptr, AS_ptr, W_ptr, WS_ptr, B_ptr, PTS_ptr, Y_ptr,
    M, N, GROUPS,
    stride_am, stride_wn, stride_sn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """Outputs ``[BLOCK_M, BLOCK_N]``: ``Σ_g σ_g (x̂_g ŵ_gᵀ)`` by FP8 tensor-core dots, then :func:`_epilogue`."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    offs_k = tl.arange(0, GROUP)
    offs_b = tl.arange(0, GROUP // 2)
    a_ptrs = A_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    w_ptrs = W_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_b[None, :]
    s_ptrs = WS_ptr + offs_n.to(tl.int64) * stride_sn
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
def _w4a8_decode_kernel(
    A_ptr, AS_ptr, W_ptr, WS_ptr, B_ptr, PTS_ptr, P_ptr, C_ptr, Y_ptr,
    M, N, GROUPS, GROUPS_PER_SPLIT,
    stride_am, stride_wn, stride_sn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr, SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """Few tokens (``M ≤ BLOCK_M``): ``BLOCK_N`` output channels over groups ``[pid_k·GPS, (pid_k+1)·GPS)``.

    Streams the packed bytes ``[BLOCK_N, GROUP/2]`` of each group as loaded (no nibble interleave):
    the low nibbles are the even input channels, the high nibbles the odd ones, so a group's dot is
    ``x̂_even ŵ_evenᵀ + x̂_odd ŵ_oddᵀ`` — two fp16 tensor-core dots (``mma``, any ``BLOCK_N ≥ 16``) with
    an fp32 accumulator, on operands that fp16 holds exactly (e4m3 values, integers −8…7).

    ``SPLIT_K > 1``: each run stores its fp32 sum in the workspace ``P (SPLIT_K, M, N)`` and takes a
    ticket from the N tile's counter ``C[pid_n]``; the run that draws the last ticket adds the
    ``SPLIT_K`` sums in the order ``0, 1, …`` (the same result whoever arrives last), applies the
    epilogue and sets the counter back to 0 for the next launch. One launch, no atomics on data.
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    offs_c = tl.arange(0, GROUP // 2)  # byte c of a group holds input channels 2c (low) and 2c + 1 (high)
    a_ptrs = A_ptr + offs_m[:, None] * stride_am + offs_c[None, :]  # x̂ as int16: one e4m3 pair per element
    w_ptrs = W_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_c[None, :]
    s_ptrs = WS_ptr + offs_n.to(tl.int64) * stride_sn
    g0 = pid_k * GROUPS_PER_SPLIT
    g1 = tl.minimum(g0 + GROUPS_PER_SPLIT, GROUPS)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g in range(g0, g1):
        wb = tl.load(w_ptrs + g * (GROUP // 2), mask=n_ok[:, None], other=0).to(tl.int8, bitcast=True)
        xp = tl.load(a_ptrs + g * (GROUP // 2), mask=m_ok[:, None], other=0)
        x_even = (xp & 0xFF).to(tl.int8).to(tl.float8e4nv, bitcast=True).to(tl.float16)  # low byte: channel 2c
        x_odd = (xp >> 8).to(tl.int8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        sigma = tl.load(s_ptrs + g, mask=n_ok, other=0.0).to(tl.float32)
        w_even = ((wb << 4) >> 4).to(tl.float16)  # arithmetic shifts sign-extend the nibble
        w_odd = (wb >> 4).to(tl.float16)
        part = tl.dot(x_odd, tl.trans(w_odd), tl.dot(x_even, tl.trans(w_even)))
        acc += part * sigma[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    y_ptrs = Y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    if SPLIT_K == 1:
        y = _epilogue(acc, AS_ptr, B_ptr, PTS_ptr, offs_m, offs_n, m_ok, n_ok, HAS_BIAS)
        tl.store(y_ptrs, y.to(Y_ptr.dtype.element_ty), mask=mask)
    else:
        p_ptrs = P_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(p_ptrs + pid_k * M * N, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the ticket (release) is taken
        ticket = tl.atomic_add(C_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:
            total = tl.load(p_ptrs, mask=mask, other=0.0, cache_modifier=".cg")  # .cg: from L2, not a stale L1
            for s in range(1, SPLIT_K):
                total += tl.load(p_ptrs + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            y = _epilogue(total, AS_ptr, B_ptr, PTS_ptr, offs_m, offs_n, m_ok, n_ok, HAS_BIAS)
            tl.store(y_ptrs, y.to(Y_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(C_ptr + pid_n, 0)


@triton.jit
def _epilogue(acc, AS_ptr, B_ptr, PTS_ptr, offs_m, offs_n, m_ok, n_ok, HAS_BIAS: tl.constexpr):
    """``(acc ⊙ β) · 2⁻ⁿ (+ bias)`` in fp32, in the reference's order (``acc * beta * 2**-n + bias``)."""
    beta = tl.load(AS_ptr + offs_m, mask=m_ok, other=1.0).to(tl.float32)
    n_pts = tl.load(PTS_ptr)
    inv_delta = ((127 - n_pts) << 23).to(tl.float32, bitcast=True)  # 2⁻ⁿ exactly (0 ≤ n ≤ 126)
    y = acc * beta[:, None] * inv_delta
    if HAS_BIAS:
        y += tl.load(B_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    return y


# (max M, config): the first row whose max M ≥ M. ``decode`` (M ≤ DECODE_BLOCK_M): BLOCK_N channels per program,
# split-K into enough runs that the launch has about ``programs`` programs (each run ≥ MIN_GROUPS_PER_SPLIT
# groups); ``tiled``: BLOCK_M × BLOCK_N FP8 tiles over all of K. Picked by ``eval/bench_linear.py --tune`` on an
# H200: the decode row from eval/results/bench_linear/h200/tune.csv (M ∈ {1, 16}), the tiled rows from the
# sweep of commit c46d778 (that file's earlier version).
GEMM_CONFIGS = (
    (16, dict(kernel="decode", block_n=64, programs=512, num_warps=2, num_stages=3)),
    (256, dict(kernel="tiled", block_m=128, block_n=64, num_warps=4, num_stages=4)),
    (None, dict(kernel="tiled", block_m=128, block_n=64, num_warps=4, num_stages=3)),
)
DECODE_BLOCK_M = 16  # the fp16 mma's row count: the decode kernel takes M ≤ 16
MIN_GROUPS_PER_SPLIT = 4
_SEMAPHORES: dict[tuple[torch.device, int], torch.Tensor] = {}


def gemm_config(m: int, n: int, k: int) -> dict:
    """The launch configuration of :func:`w4a8_gemm` for ``M × K → N`` (a fixed table: deterministic)."""
    for max_m, cfg in GEMM_CONFIGS:
        if max_m is None or m <= max_m:
            return cfg
    raise AssertionError("GEMM_CONFIGS must end with a max-M None row")


def decode_split(cfg: dict, n: int, groups: int) -> tuple[int, int]:
    """``(SPLIT_K, groups per run)`` of the decode kernel: ≈ ``cfg["programs"]`` programs, no empty or short runs."""
    tiles = triton.cdiv(n, cfg["block_n"])
    split = max(1, min(triton.cdiv(cfg["programs"], tiles), groups // MIN_GROUPS_PER_SPLIT))
    gps = triton.cdiv(groups, split)
    return triton.cdiv(groups, gps), gps


def _semaphores(device: torch.device, count: int) -> torch.Tensor:
    """The decode kernel's split-K tickets for the current stream: int32 counters that are 0 between launches.

    One set per (device, stream): launches on one stream run one after the other, so they can share
    counters; launches on two streams may overlap and must not.
    """
    key = (device, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)  # CPU: interpreter
    sem = _SEMAPHORES.get(key)
    if sem is None or sem.numel() < count:
        sem = _SEMAPHORES[key] = torch.zeros(max(count, 4096), dtype=torch.int32, device=device)
    return sem


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
    """``y = β · 2⁻ⁿ · Σ_g σ_g (x̂_g ŵ_gᵀ) + bias`` on quantized operands.

    Args:
        x_hat: ``float8_e4m3fn (M, K)``, K a multiple of 128, last dim contiguous.
        x_scale: ``bfloat16 (M,)`` per-token scales β.
        qweight: ``uint8 (N, K/2)`` packed INT4 (layout of :func:`~quantpatch.kernels.w4a8_ref.quantize_weight`).
        scales: ``float8_e4m3fn (N, K/128)`` group scales σ.
        pts_exp: ``int32 ()`` PTS exponent ``n`` (on the device: read by the kernel).
        bias: ``(N,)`` or None.
        out_dtype: float16, bfloat16 or float32.
        config: launch override (a ``GEMM_CONFIGS`` entry), for benchmarks and tests.

    Returns:
        ``y (M, N)`` in ``out_dtype``.
    """
    m, k = x_hat.shape
    n = qweight.shape[0]
    if k % GROUP_SIZE or qweight.shape[1] * 2 != k or scales.shape != (n, k // GROUP_SIZE):
        raise ValueError(f"shapes x_hat {tuple(x_hat.shape)}, qweight {tuple(qweight.shape)}, scales "
                         f"{tuple(scales.shape)} do not form a K={k} (multiple of {GROUP_SIZE}) W4A8 product")
    if x_hat.stride(-1) != 1 or qweight.stride(-1) != 1:
        raise ValueError("x_hat and qweight need a contiguous last dim")
    cfg = gemm_config(m, n, k) if config is None else config
    groups = k // GROUP_SIZE
    y = torch.empty((m, n), device=x_hat.device, dtype=out_dtype)
    if m == 0 or n == 0:
        return y
    has_bias = bias is not None
    bias_arg = bias if has_bias else x_scale  # placeholder pointer, never read
    common = (x_hat, x_scale, qweight, scales, bias_arg, pts_exp)
    bn = cfg["block_n"]
    if cfg["kernel"] == "decode":
        if m > DECODE_BLOCK_M:
            raise ValueError(f"the decode kernel takes M ≤ {DECODE_BLOCK_M} tokens, got {m}")
        split, gps = decode_split(cfg, n, groups)
        tiles = triton.cdiv(n, bn)
        if split > 1:
            work, sem = torch.empty((split, m, n), device=y.device, dtype=torch.float32), _semaphores(y.device, tiles)
        else:
            work = sem = y  # placeholders, never read
        _w4a8_decode_kernel[(tiles, split)](
            x_hat.view(torch.int16), *common[1:], work, sem, y, m, n, groups, gps,
            x_hat.stride(0) // 2, qweight.stride(0), scales.stride(0), y.stride(0),
            BLOCK_M=DECODE_BLOCK_M, BLOCK_N=bn, GROUP=GROUP_SIZE, SPLIT_K=split, HAS_BIAS=has_bias,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
    else:
        bm = cfg["block_m"]
        _w4a8_gemm_kernel[(triton.cdiv(n, bn), triton.cdiv(m, bm))](
            *common, y, m, n, groups,
            x_hat.stride(0), qweight.stride(0), scales.stride(0), y.stride(0),
            BLOCK_M=bm, BLOCK_N=bn, GROUP=GROUP_SIZE, HAS_BIAS=has_bias,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
    return y


# --------------------------------------------------------------------------- custom op


@torch.library.custom_op("quantpatch::w4a8_linear", mutates_args=())
def w4a8_linear_op(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, pts_exp: torch.Tensor, bias: Optional[torch.Tensor],
) -> torch.Tensor:
    """The whole layer on ``x (M, K)`` as one op: :func:`quantize_activation_fp8` then :func:`w4a8_gemm`."""
    x_hat, beta = quantize_activation_fp8(x)
    return w4a8_gemm(x_hat, beta, qweight, scales, pts_exp, bias, x.dtype)


@w4a8_linear_op.register_fake
def _(x, qweight, scales, pts_exp, bias):
    return x.new_empty((x.shape[0], qweight.shape[0]))


def w4a8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, pts_exp: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """End to end through one custom op: ``x (..., K)`` → ``y (..., N)`` in ``x``'s dtype."""
    y = w4a8_linear_op(x.reshape(-1, x.shape[-1]).contiguous(), qweight, scales, pts_exp, bias)
    return y.view(*x.shape[:-1], qweight.shape[0])


# --------------------------------------------------------------------------- W4A8Linear fast path

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


def _accepts(x: torch.Tensor, module) -> bool:
    """The kernels' gate: silent where the device cannot run them (the reference is that device's path),
    one warning per reason where a capable device gets a layer they do not take."""
    if device_unsupported(x) is not None:
        return False
    reason = layer_unsupported(x, module)
    if reason is not None:
        fall_back(f"W4A8Linear({module.in_features}->{module.out_features})", reason, strict=False,
                  to="the PyTorch reference")
        return False
    return True


def _run(x: torch.Tensor, module) -> torch.Tensor:
    note_implementation("triton")
    return w4a8_linear(x, module.qweight, module.scales, module.pts_exp, module.bias)


register_w4a8_fast_path("triton", _accepts, _run)
