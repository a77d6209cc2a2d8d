"""The Gluon W4A8 prefill GEMM (:mod:`quantpatch.kernels.w4a8.w4a8_prefill_gluon`) against :func:`w4a8_linear_ref`, and
the fragment-order activation quantization it reads.

The kernel computes the products of the tiled Triton kernel (FP8 wgmma, one group's 128 products into a fresh
accumulator, promoted with σ in group order): its outputs are held to the same forward-error bound
(``tests/kernels/test_w4a8_triton.py``, ``_error_bound``). Its weight operand is ``ŵ · 2⁻⁹`` (e4m3 subnormals) and
σ is taken as ``σ · 2⁹``, so a tensor core that flushed subnormal FP8 inputs would fail these tests by orders of
magnitude. GPU only (Gluon has no interpreter), sm_90; the quantization runs everywhere.
"""

import pytest
import torch

from quantpatch.kernels.w4a8 import w4a8_act_quant_triton as wq
from quantpatch.kernels.w4a8.w4a8_ref import GROUP_SIZE
from tests.gpu import DEVICE, hopper, needs_cuda
from tests.kernels.test_w4a8_triton import _assert_within_bound, _layer, _randn


def test_fragment_slots_are_a_permutation_matching_the_kernels_formula():
    """Each slot holds one channel; the Triton formula (channel → slot) is the inverse of :func:`fragment_slots`."""
    slots = wq.fragment_slots()
    assert sorted(slots.tolist()) == list(range(GROUP_SIZE))
    c = slots  # channel held by slot p, so c's slot is p
    q, s, j, h = (c >> 5) & 3, (c >> 3) & 3, (c >> 1) & 3, c & 1
    assert torch.equal(32 * s + 16 * h + 4 * q + j, torch.arange(GROUP_SIZE))


@pytest.mark.parametrize("m, k", [(3, 128), (2, 384), (5, 1024)])
def test_fragment_order_quantization_is_the_plain_one_reordered(m, k):
    """x̂ in fragment order: bit for bit the plain x̂ with each group's channels moved; β unchanged."""
    x = _randn(m, k, seed=m + k).to(torch.bfloat16).to(DEVICE)
    x_hat, beta = wq.quantize_activation_fp8(x)
    frag, frag_beta = wq.quantize_activation_fp8(x, fragment_order=True)
    assert torch.equal(frag_beta, beta)
    assert torch.equal(frag.view(torch.uint8), wq.to_fragment_order(x_hat).view(torch.uint8))


def test_quantization_of_many_long_rows_in_chunks(monkeypatch):
    """More than 16 tokens of rows longer than two chunks: chunked passes (``LONG_ROW_CHUNK``, shrunk here), bit
    for bit the reference, in both orders."""
    from quantpatch.kernels.w4a8.w4a8_ref import quantize_activation_fp8 as quantize_ref

    monkeypatch.setattr(wq, "LONG_ROW_CHUNK", 128)
    x = _randn(18, 640, seed=4, scale=2.0).to(torch.bfloat16)
    ref_hat, ref_beta = quantize_ref(x, compute_dtype=torch.float32)
    for fragment in (False, True):
        x_hat, beta = wq.quantize_activation_fp8(x.to(DEVICE), fragment_order=fragment)
        want = wq.to_fragment_order(ref_hat) if fragment else ref_hat
        assert torch.equal(x_hat.cpu().float(), want) and torch.equal(beta.cpu().float(), ref_beta[:, 0])


@pytest.mark.parametrize("options", [dict(stages=0), dict(block_t=100), dict(block_t=512)])
def test_prefill_gemm_rejects_bad_tiles_before_any_launch(options):
    """Checked on the host (CPU tensors here), so a bad tile never reaches the kernel's compile or launch."""
    from quantpatch.kernels.w4a8 import w4a8_prefill_gluon as wp

    qw = torch.zeros(128, 64, dtype=torch.uint8)
    sc = torch.ones(128, 1).to(torch.float8_e4m3fn)
    x_hat = torch.zeros(16, 128, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="block_t must be"):
        wp.w4a8_gemm_prefill_gluon(x_hat, torch.ones(16, dtype=torch.bfloat16), qw, sc, torch.tensor(0), **options)


def test_fragment_order_needs_whole_groups():
    with pytest.raises(ValueError, match="multiple of 128"):
        wq.quantize_activation_fp8(torch.zeros(2, 200), fragment_order=True)


def _check(m, n, k, *, seed, pts=True, bias=True, dtype=torch.bfloat16, **options):
    from quantpatch.kernels.w4a8 import w4a8_prefill_gluon as wp

    packed, (qw, sc, pe, b) = _layer(n, k, seed=seed, pts=pts, bias=bias)
    x = _randn(m, k, seed=seed + 2).to(dtype)
    x_hat, beta = wq.quantize_activation_fp8(x.cuda(), fragment_order=True)
    y = wp.w4a8_gemm_prefill_gluon(x_hat, beta, qw, sc, pe, b, dtype, **options)
    assert y.shape == (m, n) and y.dtype == dtype
    _assert_within_bound(y, x, packed, b, dtype)
    assert torch.equal(wp.w4a8_gemm_prefill_gluon(x_hat, beta, qw, sc, pe, b, dtype, **options), y)  # deterministic
    return y, (x, qw, sc, pe, b)


@pytest.mark.gpu
@needs_cuda
@hopper
@pytest.mark.parametrize("m, n, k", [(17, 200, 128), (128, 4096, 4096), (1000, 1000, 384), (300, 4096, 14336),
                                     (256, 14336, 4096), (4100, 256, 640)])
def test_gpu_prefill_gemm_matches_reference(m, n, k):
    """Ragged M (TMA zero-fills past M) and N (masked rows), odd group counts, Llama shapes: within the bound."""
    _check(m, n, k, seed=m + n + k)


@pytest.mark.gpu
@needs_cuda
@hopper
@pytest.mark.parametrize("block_t, stages", [(64, 2), (128, 2), (128, 3), (128, 4), (128, 6), (256, 2)])
def test_gpu_prefill_gemm_tiles_and_ring_depths(block_t, stages):
    _check(333, 640, 1664, seed=block_t + stages, block_t=block_t, stages=stages)


@pytest.mark.gpu
@needs_cuda
@hopper
@pytest.mark.parametrize("pts, bias, dtype", [(False, False, torch.float16), (True, True, torch.float32)])
def test_gpu_prefill_gemm_options(pts, bias, dtype):
    _check(64, 512, 1024, seed=5, pts=pts, bias=bias, dtype=dtype)


@pytest.mark.gpu
@needs_cuda
@hopper
def test_gpu_prefill_gemm_full_int4_range():
    """Weights at −8 (a subnormal σ lets ŵ reach it) and 7: every nibble value through the e4m3 conversion."""
    from quantpatch.kernels.w4a8 import w4a8_prefill_gluon as wp
    from quantpatch.kernels.w4a8.w4a8_ref import PackedWeight

    n, k = 128, 256
    codes = torch.arange(n * k // 2, dtype=torch.int64).remainder(256).to(torch.uint8).reshape(n, k // 2)
    scales = torch.full((n, k // GROUP_SIZE), 0.5).to(torch.float8_e4m3fn)
    packed = PackedWeight(codes, scales, 0, k, GROUP_SIZE)
    x = _randn(40, k, seed=9).float()
    x_hat, beta = wq.quantize_activation_fp8(x.cuda(), fragment_order=True)
    pe = torch.zeros((), dtype=torch.int32, device="cuda")
    y = wp.w4a8_gemm_prefill_gluon(x_hat, beta, codes.cuda(), scales.cuda(), pe, None, torch.float32)
    _assert_within_bound(y, x, packed, None, torch.float32)


@pytest.mark.gpu
@needs_cuda
@hopper
def test_gpu_prefill_layer_is_quantize_then_gemm():
    from quantpatch.kernels.w4a8 import w4a8_prefill_gluon as wp

    y, (x, qw, sc, pe, b) = _check(200, 384, 512, seed=11)
    assert torch.equal(wp.w4a8_linear_prefill_gluon(x.cuda(), qw, sc, pe, b), y)


@pytest.mark.gpu
@needs_cuda
@hopper
def test_gpu_prefill_gemm_rejects_bad_operands():
    from quantpatch.kernels.w4a8 import w4a8_prefill_gluon as wp

    _, (qw, sc, pe, b) = _layer(256, 512, seed=1)
    x_hat = torch.zeros(16, 512, device="cuda", dtype=torch.float8_e4m3fn)
    beta = torch.ones(16, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="K=384"):
        wp.w4a8_gemm_prefill_gluon(x_hat[:, :384], beta, qw, sc, pe)
    with pytest.raises(ValueError, match="contiguous float8_e4m3fn"):
        wp.w4a8_gemm_prefill_gluon(x_hat.float(), beta, qw, sc, pe)
