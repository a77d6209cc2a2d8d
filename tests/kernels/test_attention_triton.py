"""Triton attention kernels against the mode references.

Without CUDA the kernels run in the Triton interpreter (``conftest.py``) on small shapes; on a
GPU the same tests run compiled, plus the ``gpu``-marked larger shapes.

What is checked, and the bounds (one table below):
* quantization (``quantize_qkv``): every INT8 / INT4-range / FP8 value and every scale equals
  ``quant_ref`` on the same smoothed input, bit for bit. The means (K̄, q̄, V̄) are sums whose
  rounding depends on the summation order, so the reference is given the kernel's means and
  they are checked separately to float32 rounding; ΔS_raw = q̄·Kᵀ is a float dot (exact
  products, fp32 sums), checked to 1e-5 of its largest magnitude. The reference runs on the
  CPU: on CUDA, PyTorch divides by a Python scalar through a multiply by its reciprocal, so
  ``absmax / qmax`` there is not the IEEE quotient that the kernels (and the CPU) compute.
* attention with the reference's key block (``block_n = block_k``): the same P̃ blocks, so the
  only differences are exp2-vs-exp and summation-order rounding (which can flip an FP8/INT8
  rounding of P̃ at a tie, rarely) and the output rounding to fp16/bf16: rel-L1 ≤ OUT_TOL.
  OUT_TOL is 4× the rel-L1 that rounding the output alone gives (fp16 1.8e-4, bf16 1.4e-3,
  2.8e-3 in the interpreter, whose fp32→bf16 cast truncates). FP8 Q·Kᵀ on the GPU (fireq)
  accumulates in Hopper's FP22 register, which the reference does not model: measured up to
  2.5e-3 at fp16, bound OUT_TOL_FP8_QK = 4e-3.
* attention with the production key block (128 ≠ block_k = 64): P̃ is rounded after a
  different running max, a different draw of the same FP8 noise, so the kernel must be as
  accurate as the reference against float64: err(kernel) ≤ NOISE_FACTOR · err(ref) + OUT_TOL.
* LSE to 2e-4 absolute (float32 softmax in exp2 vs the reference's exp; ℓ ≥ 1; measured up to
  1.07e-4 on an H200, sage2-8b causal fp16 with the production blocks), −inf exactly where a row
  sees no key. Two
  modes get their own bound. FP8 Q·Kᵀ (fireq): Hopper's FP8 MMA accumulates in FP22 (13
  mantissa bits, truncated), |ΔS| ≲ 2⁻¹³·Σ|q̂k̂|·scale; measured ≤ 5.5e-4, bound 2e-3. ℓ
  summed from the INT8 P (int8-flash): each P̂ is rounded by up to 0.5/127 and, with other key
  blocks than the reference's, after another running max, so ℓ moves by ~√(Nk/12)/127;
  measured ≤ 0.016 at Nk = 1000, bound 0.03.
"""

import math

import pytest
import torch
import triton
import triton.language as tl

from quantpatch.kernels.attention.attention_ref import attention_exact
from quantpatch.kernels.attention.quant_attention_ref import quant_attention_ref
from quantpatch.kernels.rounding_triton import _div_by
from quantpatch.metrics import rel_l1
from quantpatch.modes import get_mode
from quantpatch.synthetic import attention_inputs
from tests.gpu import CUDA, DEVICE, assert_graph_replays_follow_eager, needs_cuda

gpu = pytest.mark.gpu

# Tolerance table (see the module docstring for where each number comes from).
OUT_TOL = {torch.float16: 1e-3, torch.bfloat16: 1.2e-2}
NOISE_FACTOR = 1.25
OUT_TOL_FP8_QK = 4e-3
LSE_ATOL = 2e-4
LSE_ATOL_FP8_QK = 2e-3
LSE_ATOL_L_FROM_P = 3e-2
DELTA_S_RTOL = 1e-5
MEAN_RTOL = 1e-5

MODES = ["sage2-8b", "sage2-4b", "int8-flash", "fireq", "turbo"]
# Small shapes for the interpreter: odd lengths and tails, GQA 4/2, q_len < kv_len and >.
SMALL_SHAPES = [(17, 113), (113, 17), (1, 1), (113, 113)]
EXACT_BLOCKS = dict(block_m=64, block_n=64, num_warps=4, num_stages=1)


def _inputs(nq, nk, *, d=64, heads=4, kv_heads=2, batch=1, dtype=torch.float16, kind="randn", seed=0):
    q, k, v = attention_inputs(kind, batch=batch, heads=heads, kv_heads=kv_heads, seq_q=nq, seq_k=nk,
                               head_dim=d, seed=seed)
    return tuple(t.to(device=DEVICE, dtype=dtype) for t in (q, k, v))


def _quant_kw(mode):
    from quantpatch.kernels.attention.fast_paths import quant_options

    return quant_options(get_mode(mode).attention)


def _check_quantization(q, k, v, kw, is_causal=False):
    """Every quantized value and scale of the kernels equals the reference's; the means and ΔS within rounding
    (ΔS where it is written: causal calls leave the key tiles no causal kernel reads)."""
    from quantpatch.kernels.attention.qk_quant_triton import (
        QuantizedQKV,
        delta_s_written,
        quantize_qkv,
        quantize_qkv_ref,
    )

    out = QuantizedQKV(*(t.cpu() for t in quantize_qkv(q, k, v, **kw, is_causal=is_causal)))
    q, k, v = q.cpu(), k.cpu(), v.cpu()
    means = tuple(t if t.numel() else None for t in (out.q_mean, out.k_mean, out.v_mean))
    ref = quantize_qkv_ref(q, k, v, **kw, means=means)
    own = quantize_qkv_ref(q, k, v, **kw)
    for name in ("q_hat", "q_scale", "k_hat", "k_scale", "v_hat_t", "v_scale"):
        a, r = getattr(out, name), getattr(ref, name)
        if a.dtype == torch.float8_e4m3fn:
            a, r = a.view(torch.int8), r.view(torch.int8)
        assert a.shape == r.shape, name
        assert torch.equal(a, r.to(a.dtype)), f"{name}: {(a != r.to(a.dtype)).sum().item()} values differ"
    for name in ("q_mean", "k_mean", "v_mean"):
        a, r = getattr(out, name), getattr(own, name)
        assert a.shape == r.shape, name
        torch.testing.assert_close(a, r, rtol=MEAN_RTOL, atol=MEAN_RTOL * (r.abs().max().item() if r.numel() else 1))
    if ref.delta_s.numel():
        written = delta_s_written(q.shape[2], k.shape[2], block_q=kw["block_q"], pad_to=kw["pad_to"],
                                  is_causal=is_causal)
        a, r = out.delta_s[..., written], ref.delta_s[..., written]
        scale = r[r.isfinite()].abs().max().item() + 1e-30 if r.isfinite().any() else 1.0
        torch.testing.assert_close(a, r, rtol=0, atol=DELTA_S_RTOL * scale)


# --------------------------------------------------------------------------- quantization


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("nq, nk", SMALL_SHAPES[:3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_quantization_bit_exact(mode, nq, nk, dtype):
    q, k, v = _inputs(nq, nk, dtype=dtype, kind="outliers", seed=nq + nk)
    _check_quantization(q, k, v, _quant_kw(mode))


@pytest.mark.parametrize(
    "options",
    [
        dict(qk_granularity="token"),
        dict(qk_granularity="block"),
        dict(qk_granularity="warp"),
        dict(smooth_v=True),
        dict(smooth_q=False, smooth_k=False),
        dict(pv_format="int8", v_granularity="channel"),
    ],
    ids=["token", "block", "warp", "smooth_v", "no_smoothing", "v_int8_channel"],
)
def test_quantization_variants_bit_exact(options):
    q, k, v = _inputs(113, 113, kind="outliers", seed=7)
    kw = {**_quant_kw("sage2-8b"), **options}
    _check_quantization(q, k, v, kw)


def _poison_stats_scratch(device):
    """Fill the current stream's statistics partials (kept across calls) with NaN: a partial that a call reads
    before it writes it shows."""
    from quantpatch.kernels.attention.qk_quant_triton import _STATS_SCRATCH
    from quantpatch.kernels.compiled_launch import stream_key

    scratch = _STATS_SCRATCH.get(stream_key(device))
    if scratch is not None:
        for row in (scratch.ksum, scratch.vsum, scratch.vmax, scratch.vmin):
            row.fill_(float("nan"))


def test_statistics_of_a_head_over_many_programs():
    """K̄, V̄ and the V channel scales of a kv head whose statistics span several programs: the program that
    finishes a head's last chunk reduces every chunk's partials (a ticket), so each must be visible to it. The
    partials are filled with NaN before each call, so a partial read before it was written shows; two calls must
    agree bit for bit (a fixed reduction order), and the means match float64 ones."""
    from quantpatch.kernels.attention.qk_quant_triton import STATS_TILE, STATS_TILES, quantize_qkv

    nk = 3 * STATS_TILE * STATS_TILES + 5  # four chunks, the last one partial
    q, k, v = _inputs(64, nk, kind="outliers", seed=3)
    kw = {**_quant_kw("sage2-8b"), "smooth_v": True}
    outs = []
    for _ in range(2):
        _poison_stats_scratch(q.device)
        outs.append(quantize_qkv(q, k, v, **kw))
    for name, a, b in zip(outs[0]._fields, *outs):
        assert torch.equal(a.view(torch.int8) if a.element_size() == 1 else a,
                           b.view(torch.int8) if b.element_size() == 1 else b), name
    k64, v64 = k.double(), v.double()
    torch.testing.assert_close(outs[0].k_mean.double(), k64.mean(-2), rtol=MEAN_RTOL, atol=MEAN_RTOL * 10)
    v_mean = v64.mean(-2)
    torch.testing.assert_close(outs[0].v_mean.double(), v_mean, rtol=MEAN_RTOL, atol=MEAN_RTOL)
    v_scale = (v64 - v_mean.unsqueeze(-2)).abs().amax(-2) / 448
    torch.testing.assert_close(outs[0].v_scale.double(), v_scale, rtol=MEAN_RTOL, atol=0)


def test_statistics_scratch_is_kept_per_stream_with_its_tickets_back_at_zero():
    """Launch 1's partials and tickets are the stream's scratch, kept across calls and grown for a larger one: each
    kv head's finalizing program sets its ticket back to 0 (left at the chunk count, the next call's heads would
    never finalize and K̄, V̄ and the V scales would be stale). Calls of two shapes in turn stay bit-exact."""
    from quantpatch.kernels.attention.qk_quant_triton import _STATS_SCRATCH, STATS_TILE, STATS_TILES
    from quantpatch.kernels.compiled_launch import stream_key

    chunk = STATS_TILE * STATS_TILES
    small = _inputs(17, chunk + 3, kind="outliers", seed=5)  # 2 kv heads of two chunks
    large = _inputs(17, 2 * chunk + 5, heads=8, kv_heads=4, kind="outliers", seed=6)  # 4 kv heads of three chunks
    kw = {**_quant_kw("sage2-8b"), "smooth_v": True}
    for q, k, v in (small, large, small):
        _poison_stats_scratch(q.device)
        _check_quantization(q, k, v, kw)
        scratch = _STATS_SCRATCH[stream_key(q.device)]
        assert scratch.tickets.numel() >= k.shape[0] * k.shape[1] and not scratch.tickets.any()
    assert scratch.ksum.numel() >= large[1].shape[1] * 3 * large[1].shape[-1]  # grown for the large call, kept


@triton.jit
def _divide_kernel(X, D, Y, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(Y + i, _div_by(tl.load(X + i), tl.load(D + i)))


def test_division_is_the_ieee_quotient():
    """``_div_by`` (one reciprocal per divisor, Markstein's FMA correction) gives ``x / d`` bit for bit, for
    divisors from subnormal to 2.5e36 and quotients up to ±127 (what the quantizers divide)."""
    g = torch.Generator().manual_seed(0)
    divisors = torch.tensor([3e-39, 2.0**-126, 2.0**-70, 2.0**-64, 0.99 * 2.0**-64, 1e-30, 1e-5, 1 / 127, 0.7, 1.0,
                             3.3, 1e10, 2.0**64, 1.01 * 2.0**64, 2.0**100, 2.5e36])  # 16 (the kernel's N: 2^k)
    d = divisors.repeat_interleave(64)
    x = (torch.rand(d.numel(), generator=g) * 254 - 127) * d
    x[::64] = 127 * d[::64]  # the absmax row element: quotient 127 up to rounding
    x[1::64] = 0.0
    y = torch.empty_like(x, device=DEVICE)
    _divide_kernel[(1,)](x.to(DEVICE), d.to(DEVICE), y, N=x.numel())
    want = x / d  # IEEE on the CPU
    y = y.cpu()
    normal = want.abs() >= 2.0**-126
    assert torch.equal(y[normal].view(torch.int32), want[normal].view(torch.int32))
    assert (y[~normal].abs() < 2.0**-120).all()  # below every quantizer's smallest step


# --------------------------------------------------------------------------- attention


def _attention(q, k, v, cfg, *, is_causal, blocks=None):
    from quantpatch.kernels.attention.fast_paths import quantized_attention

    return quantized_attention(q, k, v, cfg, is_causal=is_causal, return_lse=True, blocks=blocks)


def _check_attention(q, k, v, mode, *, is_causal, blocks, dtype):
    cfg = get_mode(mode).attention if isinstance(mode, str) else mode
    o, lse = _attention(q, k, v, cfg, is_causal=is_causal, blocks=blocks)
    assert o.dtype == dtype and o.shape == q.shape and lse.shape == q.shape[:3]
    assert torch.isfinite(o).all()
    o, lse = o.cpu(), lse.cpu()
    q, k, v = q.cpu(), k.cpu(), v.cpu()  # the reference's own quantizer is exact on the CPU only
    o_ref, lse_ref = quant_attention_ref(q, k, v, cfg, is_causal=is_causal, return_lse=True)
    empty = torch.isinf(lse_ref)
    assert torch.equal(torch.isinf(lse), empty)
    if (~empty).any():
        atol = LSE_ATOL_L_FROM_P if cfg.l_from_quantized_p else LSE_ATOL
        atol = max(atol, LSE_ATOL_FP8_QK) if cfg.qk_format.startswith("fp8") and CUDA else atol
        assert (lse - lse_ref)[~empty].abs().max().item() <= atol
    tol = OUT_TOL[dtype]
    if cfg.qk_format.startswith("fp8") and CUDA:
        tol = max(tol, OUT_TOL_FP8_QK)
    if blocks is EXACT_BLOCKS:
        err = rel_l1(o.float(), o_ref)
        assert err <= tol, f"rel-L1 vs reference {err:.2e} > {tol:.1e}"
    else:
        exact = attention_exact(q, k, v, is_causal=is_causal)
        err, ref_err = rel_l1(o.float(), exact), rel_l1(o_ref, exact)
        assert err <= NOISE_FACTOR * ref_err + tol, f"kernel {err:.3e} vs reference {ref_err:.3e}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("nq, nk", SMALL_SHAPES)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_attention_matches_reference(mode, nq, nk, is_causal, dtype):
    q, k, v = _inputs(nq, nk, dtype=dtype, seed=3 * nq + nk)
    _check_attention(q, k, v, mode, is_causal=is_causal, blocks=EXACT_BLOCKS, dtype=dtype)


@pytest.mark.parametrize("mode", ["sage2-8b", "int8-flash"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_attention_production_blocks(mode, is_causal):
    q, k, v = _inputs(113, 239, dtype=torch.float16, kind="outliers", seed=11)
    _check_attention(q, k, v, mode, is_causal=is_causal, blocks=None, dtype=torch.float16)


@pytest.mark.parametrize("is_causal", [False, True])
def test_attention_smooth_v(is_causal):
    q, k, v = _inputs(113, 239, dtype=torch.float16, kind="outliers", seed=5)
    cfg = get_mode("sage2-8b").attention.replace(smooth_v=True)
    _check_attention(q, k, v, cfg, is_causal=is_causal, blocks=EXACT_BLOCKS, dtype=torch.float16)


def nan_where_unwritten(x, nq, nk, kw, *, is_causal):
    """``x`` with ΔS NaN where quantization with ``is_causal`` leaves it unwritten (``delta_s_written``), so that a
    kernel reading there gives NaN; ``kw`` the quantization options (``block_q``, ``pad_to``)."""
    from quantpatch.kernels.attention.qk_quant_triton import delta_s_written

    if not x.delta_s.numel():
        return x
    written = delta_s_written(nq, nk, block_q=kw["block_q"], pad_to=kw["pad_to"], is_causal=is_causal,
                              device=x.delta_s.device)
    return x._replace(delta_s=torch.where(written, x.delta_s, float("nan")))


@pytest.mark.parametrize("nq, nk", [(300, 300), (300, 170), (170, 420)])
def test_causal_quantization_writes_the_delta_s_that_causal_kernels_read(nq, nk):
    """Causal quantization leaves ΔS's key tiles past each query block's diagonal unwritten. What it writes equals
    the reference; and with the rest NaN the causal Triton kernel (the reference's tiles and the production ones)
    gives the bits it gives over the full ΔS, so it reads none of them. (300, 170): rows that see no key."""
    from quantpatch.kernels.attention.fast_paths import kernel_blocks, quant_options
    from quantpatch.kernels.attention.qk_quant_triton import quantize_qkv
    from quantpatch.kernels.attention.quant_attn_triton import attn_qk_int8_pv_fp8

    cfg = get_mode("sage2-8b", smooth_q=True).attention  # ΔS exists only with smooth Q
    kw = quant_options(cfg)
    q, k, v = _inputs(nq, nk, kind="outliers", seed=nq - nk)
    _check_quantization(q, k, v, kw, is_causal=True)
    full = quantize_qkv(q, k, v, **kw)
    poisoned = nan_where_unwritten(full, nq, nk, kw, is_causal=True)
    assert poisoned.delta_s.isnan().any()  # some tiles are left unwritten
    for blocks in (EXACT_BLOCKS, kernel_blocks(cfg, q.shape[-1])):
        want, got = (attn_qk_int8_pv_fp8(x, nk, is_causal=True, return_lse=True, out_dtype=q.dtype,
                                         block_q=cfg.block_q, **blocks) for x in (full, poisoned))
        for a, b in zip(want, got):
            assert torch.equal(a, b), blocks


def test_custom_op_fake_shapes_match_the_kernels():
    from quantpatch.kernels.attention import fast_paths

    q, k, v = _inputs(17, 113)
    options = fast_paths.quant_options(get_mode("sage2-8b").attention)
    real = fast_paths.quantize_qkv_op(q, k, v, **options)
    attn_args = (113, True, 0.125, True, torch.float16, 128, False, True, 64, 64, 4, 1, False, 119, "triton", "thread")
    real_o = fast_paths.attn_qk_int8_pv_fp8_op(*real, *attn_args)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        parts = torch.ops.quantpatch.quantize_qkv(*(mode.from_tensor(t) for t in (q, k, v)), **options)
        fake_o = torch.ops.quantpatch.attn_qk_int8_pv_fp8(*parts, *attn_args)
    assert [(tuple(p.shape), p.dtype) for p in parts] == [(tuple(r.shape), r.dtype) for r in real]
    assert [(tuple(p.shape), p.dtype) for p in fake_o] == [(tuple(r.shape), r.dtype) for r in real_o]


def test_unsupported_reasons():
    from quantpatch.dispatch import AttentionCall
    from quantpatch.kernels.attention.fast_paths import call_unsupported, config_unsupported

    q, k, v = _inputs(17, 17)
    cfg = get_mode("sage2-8b").attention
    reason = call_unsupported(AttentionCall(q, k, v, cfg, False, None, None, False))
    if not CUDA:
        assert "CUDA" in reason
    turbo = get_mode("turbo").attention
    assert config_unsupported(turbo) is None
    assert "n_r" in config_unsupported(turbo.replace(sas_threshold=-8.0))
    assert "SAS" in config_unsupported(turbo.replace(v_granularity="channel"))
    assert "only with SAS" in config_unsupported(turbo.replace(exp="exact"))
    assert "emulate_fp22" in config_unsupported(cfg.replace(emulate_fp22=True))
    assert config_unsupported(cfg) is None


# --------------------------------------------------------------------------- GPU (larger shapes)

GPU_SHAPES = [(1000, 1000), (239, 1000), (239, 239)]


@gpu
@needs_cuda
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("nq, nk", GPU_SHAPES + [(4096, 4096)])
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_quantization_bit_exact(mode, nq, nk, d):
    q, k, v = _inputs(nq, nk, d=d, batch=2, dtype=torch.bfloat16, kind="outliers", seed=nq)
    _check_quantization(q, k, v, _quant_kw(mode))


@gpu
@needs_cuda
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("nq, nk", GPU_SHAPES)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_attention(mode, nq, nk, is_causal, d):
    dtype = torch.bfloat16 if d == 128 else torch.float16
    q, k, v = _inputs(nq, nk, d=d, batch=2, dtype=dtype, seed=nk + d)
    _check_attention(q, k, v, mode, is_causal=is_causal, blocks=EXACT_BLOCKS, dtype=dtype)
    _check_attention(q, k, v, mode, is_causal=is_causal, blocks=None, dtype=dtype)


@gpu
@needs_cuda
@pytest.mark.parametrize("is_causal", [False, True])
def test_gpu_attention_long(is_causal):
    q, k, v = _inputs(4096, 4096, d=128, batch=1, heads=2, kv_heads=1, dtype=torch.bfloat16, kind="outliers")
    _check_attention(q, k, v, "sage2-8b", is_causal=is_causal, blocks=None, dtype=torch.bfloat16)


@gpu
@needs_cuda
@pytest.mark.parametrize("layout", ["BHSD", "BSHD"])
def test_gpu_public_api_takes_the_triton_path(layout):
    import quantpatch as qp
    from quantpatch.dispatch import select

    q, k, v = _inputs(239, 239, d=128, dtype=torch.bfloat16, kind="outliers")
    cfg = get_mode("sage2-8b").attention
    from quantpatch.dispatch import AttentionCall

    impl, declined = select("attention", cfg.numerics, AttentionCall(q, k, v, cfg, True, None, None, False))
    assert impl is not None and impl.name == "triton", declined
    args = (q, k, v) if layout == "BHSD" else tuple(t.transpose(1, 2) for t in (q, k, v))
    o = qp.attention(*args, mode="sage2-8b", is_causal=True, layout=layout, strict=True)
    if layout == "BSHD":
        o = o.transpose(1, 2)
    q, k, v, o = q.cpu(), k.cpu(), v.cpu(), o.cpu()
    exact = attention_exact(q, k, v, is_causal=True)
    ref_err = rel_l1(quant_attention_ref(q, k, v, cfg, is_causal=True), exact)
    assert rel_l1(o.float(), exact) <= NOISE_FACTOR * ref_err + OUT_TOL[torch.bfloat16]
    assert math.isfinite(o.float().sum().item())


@gpu
@needs_cuda
@pytest.mark.parametrize("mode", ["sage2-8b", "sage2-4b", "int8-flash"])
def test_gpu_attention_replays_in_a_cuda_graph_beside_eager_calls(mode):
    """Launch 1's scratch is the stream's, kept across eager calls; a CUDA graph captured after an eager call on the
    same inputs gets its own, so its replays follow the new contents of the captured inputs and eager calls between
    replays stay exact: every output equals an eager call's on the same values, bit for bit."""
    import quantpatch

    def inputs(seed):
        return attention_inputs("outliers", batch=2, heads=4, seq_q=1500, dtype=torch.bfloat16, device=DEVICE,
                                seed=seed)

    def call(q, k, v):
        return quantpatch.attention(q, k, v, mode=mode, policy="always", strict=True)

    assert_graph_replays_follow_eager(call, [t.clone() for t in inputs(21)], inputs(22))


@gpu
@needs_cuda
def test_gpu_attention_on_two_streams_at_once():
    """Each stream has its own launch-1 scratch: calls on two streams that overlap give each stream's eager result."""
    import quantpatch

    inputs = [attention_inputs("outliers", heads=8, seq_q=3000, dtype=torch.bfloat16, device=DEVICE, seed=s)
              for s in (31, 32)]
    want = [quantpatch.attention(*x, mode="sage2-8b", policy="always", strict=True) for x in inputs]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    outs = [[], []]
    for _ in range(4):
        for i, s in enumerate(streams):
            with torch.cuda.stream(s):
                outs[i].append(quantpatch.attention(*inputs[i], mode="sage2-8b", policy="always", strict=True))
    torch.cuda.synchronize()
    for i in range(2):
        assert all(torch.equal(o, want[i]) for o in outs[i])


@pytest.mark.parametrize("mode", ["sage2-8b", "sage2-4b", "int8-flash"])
def test_quantize_plan_carves_every_output_apart(mode):
    """``QuantizePlan.carve`` puts each output of ``quantize_qkv`` at its own 256-byte aligned offset of one
    allocation, each with room for its bytes and none overlapping the next; ``allocate`` makes tensors of the layout
    ``quantize_qkv`` returns."""
    from quantpatch.kernels.attention import fast_paths
    from quantpatch.kernels.attention.qk_quant_triton import QuantizePlan, quantize_qkv

    q, k, v = attention_inputs("outliers", batch=2, heads=4, kv_heads=2, seq_q=300, seq_k=333, head_dim=64,
                               dtype=torch.bfloat16, seed=3)
    options = fast_paths.quant_options(get_mode(mode).attention)
    plan = QuantizePlan(q, k, v, **options)
    workspace, x = plan.carve(q.device)
    base = workspace.data_ptr()
    assert workspace.numel() == plan.nbytes and workspace.dtype == torch.uint8
    ends = [a - base for a in x[1:]] + [plan.nbytes]
    for address, end, (shape, dtype) in zip(x, ends, plan.layout):
        assert (address - base) % 256 == 0 and address - base + math.prod(shape) * dtype.itemsize <= end
    made = quantize_qkv(q, k, v, **options)
    assert [(tuple(t.shape), t.dtype) for t in made] == [(tuple(s), d) for s, d in plan.layout]
    assert [(tuple(t.shape), t.dtype) for t in plan.allocate(q.device)] == [(tuple(s), d) for s, d in plan.layout]


@pytest.mark.parametrize("change, error, match", [
    (lambda t: t.float(), TypeError, "float16 or bfloat16"),
    (lambda t: t[..., :96], ValueError, "head_dim must be 64 or 128"),  # a strided head dim: copied, then refused
    (lambda t: t[0], ValueError, r"expected q \(B, H, Nq, D\)"),
])
def test_quantize_qkv_refuses_inputs_the_kernels_cannot_take(change, error, match):
    """Wrong dtypes, head dims and ranks raise before any launch (the check ``QuantizePlan`` runs)."""
    from quantpatch.kernels.attention.qk_quant_triton import quantize_qkv

    q, k, v = attention_inputs("outliers", batch=1, heads=2, seq_q=40, seq_k=40, head_dim=128, dtype=torch.bfloat16,
                               seed=1)
    with pytest.raises(error, match=match):
        quantize_qkv(*(change(t) for t in (q, k, v)))
