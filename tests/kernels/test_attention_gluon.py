"""The Gluon attention kernel (:mod:`quantpatch.kernels.attention.pingpong_gluon`: sage2, int8-flash) against the
Triton kernel over the same operands.

Both compute the same numerics with key blocks of 128, but the Gluon kernel takes a program's blocks last first
(the tail or causal diagonal block, the only masked one), so P̂ is rounded against another running max: a
different draw of the same FP8 / INT8 rounding noise. As in the Triton suite
(``tests/kernels/test_attention_triton.py``), the Gluon kernel must then be as accurate against float64 as the
Triton kernel: err(gluon) ≤ NOISE_FACTOR · err(triton) + OUT_TOL. sage2's ℓ sums the unrounded P̃, so its LSE
holds to the Triton kernel's within LSE_ATOL. int8-flash's ℓ sums P̂ (ℓ from the quantized P): a block taken
before a row's max is found keeps P̂ that round to 0 when taken after it, so the order moves ℓ by more than
rounding (up to 0.14 in the LSE at 4k keys on outlier inputs, H200): its LSE is held to float64 as the output is,
max |Δ LSE| ≤ NOISE_FACTOR · the Triton kernel's + LSE_ATOL. GPU only (Gluon has no interpreter), sm_90; the key
permutation, route and launcher checks run everywhere.
"""

import pytest
import torch

from quantpatch.kernels.attention.attention_ref import attention_exact
from quantpatch.kernels.attention.fast_paths import GLUON_MIN_KEYS
from quantpatch.metrics import rel_l1
from quantpatch.synthetic import attention_inputs
from tests.gpu import DEVICE, hopper, needs_cuda
from tests.kernels.test_attention_triton import LSE_ATOL, NOISE_FACTOR, nan_where_unwritten
from tests.kernels.test_attention_triton import OUT_TOL as OUT_TOLS

OUT_TOL = OUT_TOLS[torch.bfloat16]


def test_wgmma_key_order_is_a_permutation_within_each_32_keys():
    from quantpatch.kernels.attention.pingpong_gluon import wgmma_key_order

    order = wgmma_key_order(96, torch.device("cpu"))
    assert sorted(order.tolist()) == list(range(96))
    assert torch.equal(order // 32, torch.arange(96) // 32)
    assert order[:8].tolist() == [0, 1, 8, 9, 2, 3, 10, 11]  # position k holds 16k₄ + 8k₁ + 4k₃ + 2k₂ + k₀


def test_permute_v_keys_moves_whole_key_columns():
    from quantpatch.kernels.attention.pingpong_gluon import permute_v_keys, wgmma_key_order

    v = torch.randn(1, 2, 4, 64).to(torch.float8_e4m3fn)
    out = permute_v_keys(v)
    order = wgmma_key_order(64, v.device)
    assert torch.equal(out.view(torch.uint8), v.view(torch.uint8)[..., order])


def _operands(nq, nk, heads, kv_heads, mode="sage2-8b", smooth_q=True, seed=0, causal=False):
    """Quantized operands; causal ones with ΔS NaN where causal quantization leaves it unwritten (so a kernel that
    reads there gives NaN)."""
    import quantpatch as qp
    from quantpatch.kernels.attention import fast_paths
    from quantpatch.kernels.attention.qk_quant_triton import QuantizedQKV

    q, k, v = attention_inputs("outliers", batch=2, heads=heads, kv_heads=kv_heads, seq_q=nq, seq_k=nk,
                               head_dim=128, seed=seed)
    q, k, v = (t.to("cuda", torch.bfloat16) for t in (q, k, v))
    cfg = qp.get_mode(mode).attention
    opts = fast_paths.quant_options(cfg) | (dict(smooth_q=smooth_q) if cfg.numerics == "sage2" else {})
    x = QuantizedQKV(*fast_paths.quantize_qkv_op(q, k, v, **opts, is_causal=causal))
    return nan_where_unwritten(x, nq, nk, opts, is_causal=causal), cfg, (q, k, v)


SHAPES = [(1, 1), (113, 239), (1000, 1000), (239, 4096), (4096, 4096)]
# causal: Nk - Nq a multiple of 128 (the kernel's diagonal), Nq > Nk included (rows that see no key)
CAUSAL_SHAPES = [(1, 1), (113, 113), (1000, 872), (239, 4079), (4096, 4096)]


@pytest.mark.gpu
@needs_cuda
@hopper
@pytest.mark.parametrize("shape", range(len(SHAPES)))
@pytest.mark.parametrize("mode, smooth_q, stages, warpgroups, causal", [
    *((mode, smooth_q, stages, 2, causal) for mode, smooth_q in (("sage2-8b", True), ("sage2-8b", False))
      for stages in (2, 3, 4) for causal in (False, True)),
    ("int8-flash", False, None, None, False),  # the defaults: three warpgroups, 4 stages
    ("int8-flash", False, 3, 2, False), ("int8-flash", False, None, None, True),
    ("sage2-8b", True, 4, 3, False), ("sage2-8b", False, 3, 3, False),  # three warpgroups: ΔS rows of two q blocks
])
def test_gpu_gluon_matches_the_triton_kernel(shape, mode, smooth_q, stages, warpgroups, causal):
    from quantpatch.kernels.attention.pingpong_gluon import attn_qk_int8_gluon
    from quantpatch.kernels.attention.quant_attn_triton import attn_qk_int8_pv_fp8

    nq, nk = (CAUSAL_SHAPES if causal else SHAPES)[shape]
    x, cfg, qkv = _operands(nq, nk, heads=4, kv_heads=2, mode=mode, smooth_q=smooth_q, seed=nq + nk, causal=causal)
    ref, ref_lse = attn_qk_int8_pv_fp8(x, nk, is_causal=causal, return_lse=True, block_q=cfg.block_q, block_m=64,
                                       block_n=128, num_warps=4, num_stages=2,
                                       l_from_quantized_p=cfg.l_from_quantized_p, two_level_accum=cfg.two_level_accum)
    out, lse = attn_qk_int8_gluon(x, nk, qk_granularity=cfg.qk_granularity, is_causal=causal, return_lse=True,
                                  block_q=cfg.block_q, stages=stages, warpgroups=warpgroups)
    assert_as_accurate_as_triton("gluon", out, lse, ref, ref_lse, qkv, cfg, causal)


def assert_as_accurate_as_triton(name, out, lse, ref, ref_lse, qkv, cfg, causal):
    """A Gluon kernel's ``(out, lse)`` against the Triton kernel's ``(ref, ref_lse)`` on the same operands: error
    against float64 within ``NOISE_FACTOR`` × the Triton kernel's (+ ``OUT_TOL``); the same rows see no key; LSE
    equal to ``LSE_ATOL`` (ℓ from P̂: within the same error bound)."""
    assert torch.isfinite(out).all()
    exact, exact_lse = attention_exact(*qkv, is_causal=causal, return_lse=True)
    err, triton_err = rel_l1(out.double(), exact), rel_l1(ref.double(), exact)
    assert err <= NOISE_FACTOR * triton_err + OUT_TOL, f"{name} {err:.3e} vs triton {triton_err:.3e}"
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))  # rows that see no key
    if cfg.l_from_quantized_p:
        seen = ~torch.isinf(exact_lse)
        lse_err, triton_lse_err = ((t.double() - exact_lse)[seen].abs().max().item() for t in (lse, ref_lse))
        assert lse_err <= NOISE_FACTOR * triton_lse_err + LSE_ATOL, f"LSE {lse_err:.3e} vs {triton_lse_err:.3e}"
    else:
        torch.testing.assert_close(lse, ref_lse, rtol=0, atol=LSE_ATOL)


@pytest.mark.parametrize("mode", ["sage2-8b", "sage2-4b", "int8-flash"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_gluon_takes_its_numerics_from_the_route_lengths(mode, is_causal):
    """From ``GLUON_MIN_KEYS[numerics, causal]`` keys on (causal: with Nk - Nq a multiple of 128), never below; never
    on a CPU."""
    import quantpatch as qp
    from quantpatch.kernels.attention.fast_paths import attention_kernel, gluon_takes

    cfg = qp.get_mode(mode).attention
    n = GLUON_MIN_KEYS[cfg.numerics, is_causal]
    for nq, nk, takes in [(n, n, True), (300, n + 300, True), (300, n + 256, not is_causal),
                          (n - 128, n - 128, False), (300, n - 1, False)]:
        assert gluon_takes(cfg, 128, nq, nk, is_causal) is takes, (nq, nk)
        assert attention_kernel(cfg, torch.device("cpu"), 128, nq, nk, is_causal) == "triton"  # Gluon: sm_90 only


@pytest.mark.parametrize("mode, head_dim", [("sage2-8b", 64), ("fireq", 128), ("turbo", 128)])
def test_gluon_takes_neither_other_head_dims_nor_other_numerics(mode, head_dim):
    import quantpatch as qp
    from quantpatch.kernels.attention.fast_paths import gluon_takes

    for causal in (False, True):
        assert not gluon_takes(qp.get_mode(mode).attention, head_dim, 32768, 32768, causal)


@pytest.mark.parametrize("override", [dict(qk_granularity="token"), dict(qk_granularity="block"),
                                      dict(block_k=32), dict(warps=16)])
def test_gluon_takes_only_per_thread_groups_it_reads_as_one_scale_a_lane(override):
    """The kernel reads δQ·δK as one value a lane and 64-key span: other groupings go to the Triton kernel."""
    import quantpatch as qp
    from quantpatch.kernels.attention.fast_paths import gluon_takes

    cfg = qp.get_mode("sage2-8b").attention
    assert gluon_takes(cfg, 128, 4096, 4096, False)
    assert not gluon_takes(cfg.replace(**override), 128, 4096, 4096, False)


@pytest.mark.parametrize("override", [dict(qk_granularity="thread"), dict(v_granularity="channel"),
                                      dict(l_from_quantized_p=False), dict(pv_format="fp8_e4m3")])
def test_gluon_takes_int8_flash_only_with_its_own_steps(override):
    """Per-token Q/K, INT8 P̂ with one V scale and ℓ from P̂: variants of int8-flash go to the Triton kernel."""
    import quantpatch as qp
    from quantpatch.kernels.attention.fast_paths import gluon_takes

    cfg = qp.get_mode("int8-flash").attention
    assert gluon_takes(cfg, 128, 32768, 32768, False)
    assert not gluon_takes(cfg.replace(**override), 128, 32768, 32768, False)


def _cpu_operands(nq, nk, v_dtype=torch.float8_e4m3fn, v_scale_shape=(1, 1, 128)):
    from quantpatch.kernels.attention.qk_quant_triton import QuantizedQKV

    i8, f32, empty = torch.int8, torch.float32, torch.empty(0)
    return QuantizedQKV(torch.zeros(1, 1, nq, 128, dtype=i8), torch.ones(1, 1, nq), empty,
                        torch.zeros(1, 1, 128, 128, dtype=i8), torch.ones(1, 1, 128), empty, empty,
                        torch.zeros(1, 1, 128, 128).to(v_dtype), torch.ones(v_scale_shape, dtype=f32), empty)


@pytest.mark.parametrize("call, match", [
    (dict(nq=100, nk=110, is_causal=True), "causal calls need Nk - Nq"),
    (dict(nq=128, nk=128, is_causal=True, warpgroups=3), "warpgroups=3"),
    (dict(nq=100, nk=100, warpgroups=4), "warpgroups=4"),
    (dict(nq=100, nk=100, qk_granularity="block"), "qk_granularity"),
    (dict(nq=100, nk=100, v_dtype=torch.int8), "INT8 V and one V scale"),
    (dict(nq=100, nk=100, v_scale_shape=(1,)), "per-channel V scales"),
])
def test_gluon_launcher_rejects_what_the_kernel_does_not_compute(call, match):
    """Checked before anything reaches the GPU: an unaligned causal diagonal, a schedule the call cannot take,
    unknown Q/K groups, V operands of neither numerics."""
    from quantpatch.kernels.attention.pingpong_gluon import attn_qk_int8_gluon

    shapes = {key: call.pop(key) for key in ("nq", "v_dtype", "v_scale_shape") if key in call}
    x = _cpu_operands(shapes.pop("nq"), call["nk"], **shapes)
    with pytest.raises(ValueError, match=match):
        attn_qk_int8_gluon(x, call.pop("nk"), **call)


@pytest.mark.gpu
@needs_cuda
@hopper
@pytest.mark.parametrize("mode, causal, nq, nk, route", [
    ("sage2-8b", False, 300, 4096, "sm90"), ("int8-flash", False, 300, 16384, "sm90"),
    ("int8-flash", False, 300, 512, "triton"), ("sage2-8b", True, 4096, 4096, "sm90"),
    ("sage2-4b", False, 300, 4096, "gluon"), ("sage2-4b", True, 300, 300 + 128 * 32, "gluon"),
    ("sage2-4b", True, 300, 16384, "triton"),  # Nk - Nq not a multiple of 128: the Triton kernel
])
def test_gpu_public_api_routes_long_calls(mode, causal, nq, nk, route):
    """``quantpatch.attention`` returns the output of the kernel its route names bit for bit (same operands)."""
    import quantpatch as qp
    from quantpatch.kernels.attention import fast_paths
    from quantpatch.kernels.attention.one_warpgroup_gluon import attn_qk_int8_pv_fp8_sm90
    from quantpatch.kernels.attention.pingpong_gluon import attn_qk_int8_gluon
    from quantpatch.kernels.attention.qk_quant_triton import QuantizedQKV
    from quantpatch.kernels.attention.quant_attn_triton import attn_qk_int8_pv_fp8

    q, k, v = attention_inputs("outliers", batch=1, heads=4, kv_heads=2, seq_q=nq, seq_k=nk, head_dim=128, seed=3)
    q, k, v = (t.to("cuda", torch.bfloat16) for t in (q, k, v))
    cfg = qp.get_mode(mode).attention
    assert fast_paths.attention_kernel(cfg, q.device, 128, nq, nk, causal) == route
    x = QuantizedQKV(*fast_paths.quantize_qkv_op(q, k, v, **fast_paths.quant_options(cfg),
                                                 v_key_order=route != "triton", is_causal=causal))
    o = qp.attention(q, k, v, mode=mode, is_causal=causal, strict=True)
    if route == "sm90":
        expected, _ = attn_qk_int8_pv_fp8_sm90(x, nk, qk_granularity=cfg.qk_granularity, is_causal=causal)
    elif route == "gluon":
        expected, _ = attn_qk_int8_gluon(x, nk, qk_granularity=cfg.qk_granularity, is_causal=causal,
                                         block_q=cfg.block_q, v_keys_permuted=x.v_hat_t)
    else:
        expected, _ = attn_qk_int8_pv_fp8(x, nk, is_causal=causal, block_q=cfg.block_q,
                                          l_from_quantized_p=cfg.l_from_quantized_p,
                                          two_level_accum=cfg.two_level_accum, **fast_paths.kernel_blocks(cfg, 128))
    assert torch.equal(o, expected)


@pytest.mark.gpu
@needs_cuda
@hopper
@pytest.mark.parametrize("nk", [1000, 4096])  # the Triton kernel's route, the sm_90 kernel's
def test_gpu_later_calls_of_a_shape_relaunch_the_compiled_kernels(nk, monkeypatch):
    """A shape's first call goes through ``JITFunction.run``; later ones go to the compiled kernels' launchers
    (``compiled_launch.LaunchPlans``, no new plan) and give the bits a first call gives, for new inputs too. Each
    first call starts from no planned call and no ``Sm90Prefill`` of any signature (their bound launches outlive
    ``LaunchPlans.clear``, so a signature an earlier call ran would make no plan)."""
    import quantpatch as qp
    from quantpatch import dispatch
    from quantpatch.kernels.attention import fast_paths
    from quantpatch.kernels.attention.fast_paths import PREFILL_PLANS as plans
    from quantpatch.kernels.attention.fast_paths import SM90_MIN_KEYS

    min_keys = SM90_MIN_KEYS[False]
    a, b = (tuple(t.to("cuda", torch.bfloat16) for t in attention_inputs(
        "outliers", batch=1, heads=4, kv_heads=2, seq_q=300, seq_k=nk, head_dim=128, seed=seed)) for seed in (5, 6))

    def call(x):
        return qp.attention(*x, mode="sage2-8b", strict=True)

    def first_call(x):
        monkeypatch.setattr(dispatch, "_PLANNED", {})
        monkeypatch.setattr(fast_paths, "_SM90_PREFILLS", {})
        for p in plans:
            p.clear()
        return call(x)

    b_first = first_call(b)
    a_first = first_call(a)
    counts = [len(p) for p in plans]
    # statistics, ΔS (none: sage2-8b has no smooth Q), K/V, then the Triton / ping-pong / sm_90 attention kernel
    assert counts == [1, 0, 1, int(nk < min_keys), 0, int(nk >= min_keys)]
    assert torch.equal(call(b), b_first) and torch.equal(call(a), a_first)
    assert [len(p) for p in plans] == counts


def test_quantization_writes_v_in_the_gluon_key_order_when_asked():
    """``v_key_order=True``: ``v_hat_t`` bit for bit the plain one through :func:`permute_v_keys` (and back), every
    other output unchanged (interpreter in CI, compiled on a GPU)."""
    import quantpatch as qp
    from quantpatch.kernels.attention import fast_paths
    from quantpatch.kernels.attention.pingpong_gluon import permute_v_keys
    from quantpatch.kernels.attention.qk_quant_triton import quantize_qkv

    q, k, v = (t.to(DEVICE, torch.float16) for t in attention_inputs(
        "outliers", batch=1, heads=2, kv_heads=1, seq_q=40, seq_k=200, head_dim=64, seed=5))
    opts = fast_paths.quant_options(qp.get_mode("sage2-8b").attention)
    plain = quantize_qkv(q, k, v, **opts)
    ordered = quantize_qkv(q, k, v, **opts, v_key_order=True)
    assert torch.equal(ordered.v_hat_t.view(torch.uint8), permute_v_keys(plain.v_hat_t).view(torch.uint8))
    assert torch.equal(permute_v_keys(ordered.v_hat_t, inverse=True).view(torch.uint8),
                       plain.v_hat_t.view(torch.uint8))
    for name in plain._fields:
        if name != "v_hat_t":
            assert torch.equal(getattr(ordered, name), getattr(plain, name)), name


@pytest.mark.parametrize("options", [dict(block_k=16), dict(v_granularity="block", pv_format="int8")])
def test_v_key_order_rejects_key_blocks_it_would_cross(options):
    from quantpatch.kernels.attention.qk_quant_triton import quantize_qkv

    q = torch.zeros(1, 1, 8, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="v_key_order"):
        quantize_qkv(q, q, q, v_key_order=True, **options)
