"""FireQ W4A8-FP linear in Triton: per-token FP8 activation quantization and the INT4 × FP8 GEMM.

Two kernels, each a ``torch.library.custom_op`` with ``register_fake`` (launched on the current
stream), reproducing :mod:`quantpatch.kernels.w4a8_ref` (``weight_operand="group"``):

* ``quantpatch::w4a8_quantize_activation`` (:func:`quantize_activation_fp8`), one program per
  token: ``a = max_k |x|``, ``β = bf16(a / 448)`` (1 if 0), ``x̂ = e4m3(x / β)`` saturating.
  Bit-exact with :func:`~quantpatch.kernels.w4a8_ref.quantize_activation_fp8` computing in
  float32: an IEEE division (``div_rn``), round-half-even to bf16 by integer arithmetic (the
  interpreter's own cast truncates), and the shared saturating e4m3 cast of
  :mod:`~quantpatch.kernels.qk_quant_triton`.
* ``quantpatch::w4a8_gemm`` (:func:`w4a8_gemm`)::

      P_g  = x̂[:, g] · ŵ[:, g]ᵀ        FP8 × FP8 tensor-core dot, fp32 accumulator, one per 128-group g
      acc += P_g ⊙ σ[:, g]ᵀ            the group's e4m3 scale, per output channel, fp32
      y    = (acc ⊙ β) · 2⁻ⁿ + bias    epilogue: per-token BF16 scale, exact PTS factor, bias → out dtype

  ``ŵ`` is unpacked in registers from the reference's layout (``uint8 (N, K/2)``, input channel
  ``2c`` in the low nibble of byte ``c``): an arithmetic shift sign-extends each nibble, the two
  halves are interleaved with ``tl.join``, and the integers −8…7 (exact in e4m3) become the FP8
  operand. ``n`` (``pts_exp``) is read from device memory, so a forward never syncs the host.

Tiles: ``(BLOCK_M, BLOCK_N)`` outputs per program and one 128-wide group per K step. Few tokens
(decode) use ``BLOCK_M = 16`` and, where the N tiles alone do not fill the GPU, split-K: each of
``SPLIT_K`` programs sums its run of groups into an fp32 workspace ``(SPLIT_K, M, N)`` and
:func:`_w4a8_splitk_epilogue_kernel` adds the runs in a fixed order, so results are deterministic
(no atomics). ``SWAP_AB`` computes ``ŵ x̂ᵀ`` instead (weights as the MMA's M side, which Hopper's
wgmma needs to be ≥ 64, tokens as its N side). Configurations come from one fixed table
(:func:`gemm_config`), not a run-time autotuner, so a given shape always runs the same program.

Difference to the reference: only the order of the fp32 sums (within a group, the dot's own
order; across groups, sequential here and per split-K run); the products ``x̂ ŵ`` are exact in
fp32 and the epilogue applies the same operations in the same order. On Hopper the FP8 MMA
accumulates in a narrower register (≈ 13 mantissa bits, SageAttention2 §3.4; DeepSeek-V3 §3.3.2),
which is why each group's partial is promoted to fp32 after 128 products (see the tests' bounds).
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

ACT_BLOCK_K = 2048  # activation-quantization chunk along K (two passes over a row: absmax, then quantize)


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
    """Token ``m``: ``β = bf16(max|x| / 448)`` (1 if 0), ``x̂ = e4m3(x / β)`` (saturating, RNE)."""
    m = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(X_ptr + m * stride_xm + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    beta = tl.math.div_rn(tl.max(amax, 0), 448.0)  # e4m3 max
    beta = tl.where(beta == 0.0, 1.0, beta)  # symmetric_scale: an all-zero token gets 1
    beta = _bf16_rne(beta)
    beta = tl.where(beta == 0.0, 1.0, beta)  # bf16 underflow (absmax < ~1e-36)
    for k0 in range(0, K, BLOCK_K):
        mask = k0 + offs < K
        x = tl.load(X_ptr + m * stride_xm + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(XQ_ptr + m * stride_qm + k0 + offs, _to_fp8e4m3(tl.math.div_rn(x, beta), EMULATE), mask=mask)
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
            BLOCK_K=block_k, EMULATE=interpreting(), num_warps=4 if block_k >= 1024 else 1,
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
    M, N, GROUPS, GROUPS_PER_SPLIT,
    stride_am, stride_wn, stride_sn, stride_ym, stride_ys,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr, SPLIT_K: tl.constexpr,
    SWAP_AB: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """Outputs ``[BLOCK_M, BLOCK_N]`` over groups ``[pid_k·GPS, (pid_k+1)·GPS)``: Σ_g σ_g (x̂_g ŵ_gᵀ).

    ``SPLIT_K == 1``: apply the epilogue and store ``y``; else store the fp32 run sum at
    ``Y_ptr + pid_k·stride_ys`` (the split-K workspace).
    """
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    offs_k = tl.arange(0, GROUP)
    offs_b = tl.arange(0, GROUP // 2)
    a_ptrs = A_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    w_ptrs = W_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_b[None, :]
    s_ptrs = WS_ptr + offs_n.to(tl.int64) * stride_sn
    g0 = pid_k * GROUPS_PER_SPLIT
    g1 = tl.minimum(g0 + GROUPS_PER_SPLIT, GROUPS)
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g in range(g0, g1):
        a = tl.load(a_ptrs + g * GROUP, mask=m_ok[:, None], other=0.0)
        w = _unpack_int4_fp8(tl.load(w_ptrs + g * (GROUP // 2), mask=n_ok[:, None], other=0), BLOCK_N, GROUP)
        sigma = tl.load(s_ptrs + g, mask=n_ok, other=0.0).to(tl.float32)
        if SWAP_AB:
            acc += tl.dot(w, tl.trans(a)) * sigma[:, None]  # the group's own fp32 partial, then × σ
        else:
            acc += tl.dot(a, tl.trans(w)) * sigma[None, :]
    if SWAP_AB:
        acc = tl.trans(acc)
    out_mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        y = _epilogue(acc, AS_ptr, B_ptr, PTS_ptr, offs_m, offs_n, m_ok, n_ok, HAS_BIAS)
        tl.store(Y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :],
                 y.to(Y_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(Y_ptr + pid_k * stride_ys + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], acc,
                 mask=out_mask)


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


@triton.jit
def _w4a8_splitk_epilogue_kernel(
    P_ptr, AS_ptr, B_ptr, PTS_ptr, Y_ptr,
    M, N, stride_ps, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """Sum the ``SPLIT_K`` fp32 runs in order (deterministic), then the epilogue of :func:`_epilogue`."""
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    mask = m_ok[:, None] & n_ok[None, :]
    ptrs = P_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    acc = tl.load(ptrs, mask=mask, other=0.0)
    for s in range(1, SPLIT_K):
        acc += tl.load(ptrs + s * stride_ps, mask=mask, other=0.0)
    y = _epilogue(acc, AS_ptr, B_ptr, PTS_ptr, offs_m, offs_n, m_ok, n_ok, HAS_BIAS)
    tl.store(Y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], y.to(Y_ptr.dtype.element_ty),
             mask=mask)


# (max M, config): the first row whose max M ≥ M; split_k is capped so each run keeps ≥ 4 groups. Picked by
# ``eval/bench_linear.py --tune`` on an H200 (best geometric mean over the Llama-8B shapes at M ∈ {1, 16} /
# {128} / {4096}; eval/results/bench_linear/h200/tune.csv): decode runs BLOCK_N = 64 output channels as wgmma's
# M side (SWAP_AB) in 8 split-K runs, larger M 128 × 64 tiles.
GEMM_CONFIGS = (
    (16, dict(block_m=16, block_n=64, split_k=8, swap_ab=True, num_warps=4, num_stages=4)),
    (256, dict(block_m=128, block_n=64, split_k=1, swap_ab=False, num_warps=4, num_stages=4)),
    (None, dict(block_m=128, block_n=64, split_k=1, swap_ab=False, num_warps=4, num_stages=3)),
)
MIN_GROUPS_PER_SPLIT = 4


def gemm_config(m: int, n: int, k: int) -> dict:
    """The launch configuration of :func:`w4a8_gemm` for ``M × K → N`` (a fixed table: deterministic)."""
    for max_m, cfg in GEMM_CONFIGS:
        if max_m is None or m <= max_m:
            break
    cfg = dict(cfg)
    cfg["split_k"] = max(1, min(cfg["split_k"], k // GROUP_SIZE // MIN_GROUPS_PER_SPLIT))
    return cfg


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
        config: launch override (keys of :func:`gemm_config`), for benchmarks and tests.

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
    split = max(1, min(cfg["split_k"], groups))
    gps = triton.cdiv(groups, split)
    split = triton.cdiv(groups, gps)  # no empty runs
    y = torch.empty((m, n), device=x_hat.device, dtype=out_dtype)
    if m == 0 or n == 0:
        return y
    bm, bn = cfg["block_m"], cfg["block_n"]
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), split)
    has_bias = bias is not None
    bias_arg = bias if has_bias else x_scale  # placeholder pointer, never read
    dst = y if split == 1 else torch.empty((split, m, n), device=x_hat.device, dtype=torch.float32)
    _w4a8_gemm_kernel[grid](
        x_hat, x_scale, qweight, scales, bias_arg, pts_exp, dst,
        m, n, groups, gps,
        x_hat.stride(0), qweight.stride(0), scales.stride(0), n, m * n,
        BLOCK_M=bm, BLOCK_N=bn, GROUP=GROUP_SIZE, SPLIT_K=split, SWAP_AB=cfg["swap_ab"], HAS_BIAS=has_bias,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if split > 1:
        ebm, ebn = 16, 128
        _w4a8_splitk_epilogue_kernel[(triton.cdiv(n, ebn), triton.cdiv(m, ebm))](
            dst, x_scale, bias_arg, pts_exp, y, m, n, m * n, n,
            BLOCK_M=ebm, BLOCK_N=ebn, SPLIT_K=split, HAS_BIAS=has_bias, num_warps=4,
        )
    return y


# --------------------------------------------------------------------------- custom ops


@torch.library.custom_op("quantpatch::w4a8_quantize_activation", mutates_args=())
def quantize_activation_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Custom-op form of :func:`quantize_activation_fp8`."""
    return quantize_activation_fp8(x)


@quantize_activation_op.register_fake
def _(x):
    return x.new_empty(x.shape, dtype=torch.float8_e4m3fn), x.new_empty(x.shape[:1], dtype=torch.bfloat16)


@torch.library.custom_op("quantpatch::w4a8_gemm", mutates_args=())
def w4a8_gemm_op(
    x_hat: torch.Tensor, x_scale: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, pts_exp: torch.Tensor,
    bias: Optional[torch.Tensor], out_dtype: torch.dtype,
) -> torch.Tensor:
    """Custom-op form of :func:`w4a8_gemm` (configuration from :func:`gemm_config`)."""
    return w4a8_gemm(x_hat, x_scale, qweight, scales, pts_exp, bias, out_dtype)


@w4a8_gemm_op.register_fake
def _(x_hat, x_scale, qweight, scales, pts_exp, bias, out_dtype):
    return x_hat.new_empty((x_hat.shape[0], qweight.shape[0]), dtype=out_dtype)


def w4a8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, pts_exp: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """End to end through the two custom ops: ``x (..., K)`` → ``y (..., N)`` in ``x``'s dtype."""
    lead = x.shape[:-1]
    x_hat, beta = quantize_activation_op(x.reshape(-1, x.shape[-1]).contiguous())
    y = w4a8_gemm_op(x_hat, beta, qweight, scales, pts_exp, bias, x.dtype)
    return y.reshape(*lead, qweight.shape[0])


# --------------------------------------------------------------------------- W4A8Linear fast path

OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def device_unsupported(x: torch.Tensor) -> str | None:
    """Why ``x``'s device cannot run the kernels (None if it can): FP8 ``tl.dot`` needs CUDA sm_89+."""
    return cuda_unsupported(x, (8, 9), "FP8 dots")


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
