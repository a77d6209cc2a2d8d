"""The Gluon sage2 kernel (:mod:`quantpatch.kernels.attn_gluon`) against the Triton kernel over the same operands.

Both compute the same numerics in the same key-block order (block_n 128); S differs by fp32 rounding only (the
Gluon kernel multiplies by δQ·δK, the Triton kernel by δK then δQ; FMA contractions), which flips an FP8 rounding of P̃
now and then: rel-L1 ≤ OUT_TOL (the Triton suite's bound for bf16 outputs; ~1e-5 measured at 4k–32k keys) and
LSE to LSE_ATOL. GPU only (Gluon has no interpreter), sm_90; the key permutation and launch checks run everywhere.
"""

import pytest
import torch

from quantpatch.metrics import rel_l1
from quantpatch.synthetic import attention_inputs
from tests.gpu import DEVICE, hopper, needs_cuda

OUT_TOL = 1.2e-2  # bf16 output (tests/kernels/test_attention_triton.py)
LSE_ATOL = 2e-4


def test_wgmma_key_order_is_a_permutation_within_each_32_keys():
    from quantpatch.kernels.attn_gluon import wgmma_key_order

    order = wgmma_key_order(96, torch.device("cpu"))
    assert sorted(order.tolist()) == list(range(96))
    assert torch.equal(order // 32, torch.arange(96) // 32)
    assert order[:8].tolist() == [0, 1, 8, 9, 2, 3, 10, 11]  # position k holds 16k₄ + 8k₁ + 4k₃ + 2k₂ + k₀


def test_permute_v_keys_moves_whole_key_columns():
    from quantpatch.kernels.attn_gluon import permute_v_keys, wgmma_key_order

    v = torch.randn(1, 2, 4, 64).to(torch.float8_e4m3fn)
    out = permute_v_keys(v)
    order = wgmma_key_order(64, v.device)
    assert torch.equal(out.view(torch.uint8), v.view(torch.uint8)[..., order])


def _operands(nq, nk, heads, kv_heads, smooth_q=True, seed=0):
    import quantpatch as qp
    from quantpatch.kernels import fast_paths
    from quantpatch.kernels.qk_quant_triton import QuantizedQKV

    q, k, v = attention_inputs("outliers", batch=2, heads=heads, kv_heads=kv_heads, seq_q=nq, seq_k=nk,
                               head_dim=128, seed=seed)
    q, k, v = (t.to("cuda", torch.bfloat16) for t in (q, k, v))
    cfg = qp.get_mode("sage2-8b").attention
    opts = fast_paths.quant_options(cfg) | dict(smooth_q=smooth_q)
    return QuantizedQKV(*fast_paths.quantize_qkv_op(q, k, v, **opts)), cfg


@pytest.mark.gpu
@needs_cuda
@hopper
@pytest.mark.parametrize("nq, nk", [(1, 1), (113, 239), (1000, 1000), (239, 4096), (4096, 4096)])
@pytest.mark.parametrize("smooth_q", [True, False])
@pytest.mark.parametrize("stages, causal", [(2, False), (3, False), (4, False), (2, True), (3, True), (4, True)])
def test_gpu_gluon_matches_the_triton_kernel(nq, nk, smooth_q, stages, causal):
    from quantpatch.kernels.attn_gluon import attn_sage2_gluon
    from quantpatch.kernels.attn_qk_int8_pv_fp8_triton import attn_qk_int8_pv_fp8

    x, cfg = _operands(nq, nk, heads=4, kv_heads=2, smooth_q=smooth_q, seed=nq + nk)
    ref, ref_lse = attn_qk_int8_pv_fp8(x, nk, is_causal=causal, return_lse=True, block_q=cfg.block_q, block_m=64,
                                       block_n=128, num_warps=4, num_stages=2)
    out, lse = attn_sage2_gluon(x, nk, is_causal=causal, return_lse=True, block_q=cfg.block_q, stages=stages)
    assert torch.isfinite(out).all()
    assert rel_l1(out.float(), ref.float()) <= OUT_TOL
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=LSE_ATOL)


@pytest.mark.parametrize(
    "mode, head_dim, nk, is_causal, takes",
    [("sage2-8b", 128, 2048, False, True), ("sage2-4b", 128, 8192, False, True),
     ("sage2-8b", 128, 2047, False, False), ("sage2-8b", 128, 4096, True, False),
     ("sage2-8b", 128, 32768, True, False),
     ("sage2-8b", 64, 4096, False, False), ("int8-flash", 128, 4096, False, False),
     ("fireq", 128, 4096, False, False)],
)
def test_gluon_takes_sage2_head_dim_128_long_calls_only(mode, head_dim, nk, is_causal, takes):
    import quantpatch as qp
    from quantpatch.kernels.fast_paths import gluon_takes, uses_gluon

    assert gluon_takes(qp.get_mode(mode).attention, head_dim, nk, is_causal) is takes
    assert not uses_gluon(qp.get_mode(mode).attention, torch.device("cpu"), head_dim, nk, is_causal)  # sm_90 only


@pytest.mark.parametrize("override", [dict(qk_granularity="token"), dict(qk_granularity="block"),
                                      dict(block_k=32), dict(warps=16)])
def test_gluon_takes_only_per_thread_groups_it_reads_as_one_scale_a_lane(override):
    """The kernel reads δQ·δK as one value a lane and 64-key span: other groupings go to the Triton kernel."""
    import quantpatch as qp
    from quantpatch.kernels.fast_paths import gluon_takes

    cfg = qp.get_mode("sage2-8b").attention
    assert gluon_takes(cfg, 128, 4096, False)
    assert not gluon_takes(cfg.replace(**override), 128, 4096, False)


@pytest.mark.gpu
@needs_cuda
@hopper
@pytest.mark.parametrize("causal, nk", [(False, 4096), (True, 16384)])
def test_gpu_public_api_routes_long_calls(causal, nk):
    """``quantpatch.attention`` from the route's key count on returns the Gluon kernel's output bit for bit (same
    operands) for non-causal calls and the Triton kernel's for causal ones; the two kernels agree within the
    bound."""
    import quantpatch as qp
    from quantpatch.kernels import fast_paths
    from quantpatch.kernels.attn_gluon import attn_sage2_gluon
    from quantpatch.kernels.attn_qk_int8_pv_fp8_triton import attn_qk_int8_pv_fp8
    from quantpatch.kernels.qk_quant_triton import QuantizedQKV

    q, k, v = attention_inputs("outliers", batch=1, heads=4, kv_heads=2, seq_q=300, seq_k=nk, head_dim=128, seed=3)
    q, k, v = (t.to("cuda", torch.bfloat16) for t in (q, k, v))
    cfg = qp.get_mode("sage2-8b").attention
    x = QuantizedQKV(*fast_paths.quantize_qkv_op(q, k, v, **fast_paths.quant_options(cfg)))
    o = qp.attention(q, k, v, mode="sage2-8b", is_causal=causal, strict=True)
    gluon, _ = attn_sage2_gluon(x, nk, is_causal=causal, block_q=cfg.block_q)
    triton_o, _ = attn_qk_int8_pv_fp8(x, nk, is_causal=causal, block_q=cfg.block_q,
                                      **fast_paths.kernel_blocks(cfg, 128))
    assert torch.equal(o, triton_o if causal else gluon)
    assert rel_l1(gluon.float(), triton_o.float()) <= OUT_TOL



@pytest.mark.gpu
@needs_cuda
@hopper
@pytest.mark.parametrize("nk", [1000, 4096])  # the Triton kernel's route, the Gluon kernel's
def test_gpu_later_calls_of_a_shape_relaunch_the_compiled_kernels(nk):
    """A shape's first call goes through ``JITFunction.run``; later ones go to the compiled kernels' launchers
    (``compiled_launch.LaunchPlans``, no new plan) and give the bits a first call gives, for new inputs too."""
    import quantpatch as qp
    from quantpatch.kernels.fast_paths import GLUON_MIN_KEYS
    from quantpatch.kernels.fast_paths import PREFILL_PLANS as plans
    a, b = (tuple(t.to("cuda", torch.bfloat16) for t in attention_inputs(
        "outliers", batch=1, heads=4, kv_heads=2, seq_q=300, seq_k=nk, head_dim=128, seed=seed)) for seed in (5, 6))

    def call(x):
        return qp.attention(*x, mode="sage2-8b", strict=True)

    for p in plans:
        p.clear()
    b_first = call(b)
    for p in plans:
        p.clear()
    a_first = call(a)
    counts = [len(p) for p in plans]
    assert counts == [1, 1, 1, int(nk < GLUON_MIN_KEYS), int(nk >= GLUON_MIN_KEYS)]
    assert torch.equal(call(b), b_first) and torch.equal(call(a), a_first)
    assert [len(p) for p in plans] == counts

def test_quantization_writes_v_in_the_gluon_key_order_when_asked():
    """``v_key_order=True``: ``v_hat_t`` bit for bit the plain one through :func:`permute_v_keys` (and back), every
    other output unchanged (interpreter in CI, compiled on a GPU)."""
    import quantpatch as qp
    from quantpatch.kernels import fast_paths
    from quantpatch.kernels.attn_gluon import permute_v_keys
    from quantpatch.kernels.qk_quant_triton import quantize_qkv

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
    from quantpatch.kernels.qk_quant_triton import quantize_qkv

    q = torch.zeros(1, 1, 8, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="v_key_order"):
        quantize_qkv(q, q, q, v_key_order=True, **options)
