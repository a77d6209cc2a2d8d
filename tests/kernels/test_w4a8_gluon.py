"""The Gluon W4A8 decode kernel (:mod:`quantpatch.kernels.w4a8.w4a8_gluon`) against :func:`w4a8_linear_ref`.

Same operands (its fused quantization is bit-exact with the Triton one and the reference) and the same fp32
operations on the same exact products as the Triton decode kernel, so the same forward-error bound holds
(``tests/kernels/test_w4a8_triton.py``, ``_error_bound``). GPU only (Gluon has no interpreter), sm_90; the
selection logic is tested on the CPU in ``test_w4a8_triton.py``.
"""

import pytest
import torch

from quantpatch.kernels.compiled_launch import stream_key
from quantpatch.kernels.w4a8 import w4a8_scratch
from quantpatch.kernels.w4a8.w4a8_ref import w4a8_linear_ref
from tests.gpu import assert_planned_calls_follow_the_whole_path, hopper, needs_cuda
from tests.kernels.test_w4a8_triton import _assert_within_bound, _error_bound, _layer, _randn


def _check(m, n, k, *, seed, gps=None, gpc=None, pts=True, bias=True, dtype=torch.bfloat16):
    from quantpatch.kernels.w4a8 import w4a8_gluon as wg
    from quantpatch.kernels.w4a8 import w4a8_triton as wt

    packed, (qw, sc, pe, b) = _layer(n, k, seed=seed, pts=pts, bias=bias)
    x = _randn(m, k, seed=seed + 2).to(dtype)
    x_hat, beta = wt.quantize_activation_fp8(x.cuda(), fragment_order=True)
    y = wg.w4a8_gemm_gluon(x_hat, beta, qw, sc, pe, b, dtype, gps=gps, gpc=gpc)
    assert y.shape == (m, n) and y.dtype == dtype
    _assert_within_bound(y, x, packed, b, dtype)
    return y, (x_hat, beta, qw, sc, pe, b)


@pytest.mark.gpu
@needs_cuda
@hopper
@pytest.mark.parametrize("m", [1, 5, 8, 9, 16])
@pytest.mark.parametrize("n, k, gps", [(4096, 4096, None), (1000, 14336, None), (4096, 4096, 32), (200, 384, 2),
                                       (4096, 14336, 16)])
def test_gpu_gluon_gemm_matches_reference(m, n, k, gps):
    """Every output within the reference's forward-error bound; split-K tickets back at 0; deterministic."""
    from quantpatch.kernels.w4a8 import w4a8_gluon as wg

    y, ops = _check(m, n, k, seed=m + n + k, gps=gps)
    assert not w4a8_scratch._SCRATCH[(stream_key(y.device), "gluon_counters")].any()
    assert torch.equal(wg.w4a8_gemm_gluon(*ops, torch.bfloat16, gps=gps), y)


@pytest.mark.gpu
@needs_cuda
@hopper
@pytest.mark.parametrize("m, n, k, gps, gpc", [(16, 4096, 4096, 8, 8), (16, 4096, 4096, 8, 4), (9, 1000, 14336, 56, 2),
                                               (1, 1000, 14336, 28, 1)])
def test_gpu_gluon_gemm_chunks(m, n, k, gps, gpc):
    """Other chunk sizes (groups loaded at once) and run lengths: within the bound, deterministic."""
    from quantpatch.kernels.w4a8 import w4a8_gluon as wg

    y, ops = _check(m, n, k, seed=m + k + gpc, gps=gps, gpc=gpc)
    assert torch.equal(wg.w4a8_gemm_gluon(*ops, torch.bfloat16, gps=gps, gpc=gpc), y)


@pytest.mark.gpu
@needs_cuda
@hopper
@pytest.mark.parametrize("pts, bias, dtype", [(False, False, torch.float16), (True, True, torch.float32)])
def test_gpu_gluon_gemm_options(pts, bias, dtype):
    _check(16, 512, 1024, seed=3, pts=pts, bias=bias, dtype=dtype)


@pytest.mark.gpu
@needs_cuda
@hopper
@pytest.mark.parametrize("m", [1, 7, 16])
@pytest.mark.parametrize("n, k, dtype", [(4096, 4096, torch.bfloat16), (200, 384, torch.float16),
                                         (300, 2048, torch.float32), (1000, 14336, torch.bfloat16)])
def test_gpu_gluon_layer(m, n, k, dtype):
    """The layer: output bit for bit that of quantizing first (:func:`quantize_activation_fp8`, fragment order)
    and then the Gluon GEMM; fused (K ≤ DECODE_QBLOCK, one launch) x̂ and β in the workspace bit for bit those of
    :func:`quantize_activation_fp8` and the flag, count and tickets back at 0; deterministic."""
    from quantpatch.kernels.w4a8 import w4a8_gluon as wg
    from quantpatch.kernels.w4a8 import w4a8_triton as wt

    _, (qw, sc, pe, b) = _layer(n, k, seed=m + k)
    x = (_randn(m, k, seed=k + 1) * _randn(1, k, seed=2).exp()).to(dtype).cuda()
    y = wg.w4a8_linear_gluon(x, qw, sc, pe, b)
    x_hat, beta = wt.quantize_activation_fp8(x, fragment_order=True)
    assert torch.equal(y, wg.w4a8_gemm_gluon(x_hat, beta, qw, sc, pe, b, dtype))
    key = stream_key(y.device)
    if k <= wt.DECODE_QBLOCK:
        fused_hat = wt._x_hat_scratch(key, m * k, y.device)[0][: m * k]
        assert torch.equal(fused_hat.view(torch.uint8), x_hat.view(torch.uint8).flatten())
        assert torch.equal(w4a8_scratch._SCRATCH[(key, "beta")][:m], beta)
    assert not w4a8_scratch._SCRATCH[(key, "gluon_counters")].any()
    assert torch.equal(wg.w4a8_linear_gluon(x, qw, sc, pe, b), y)


@pytest.mark.gpu
@needs_cuda
@hopper
def test_gpu_gluon_layer_under_a_cuda_graph_and_against_the_triton_layer():
    """The fused layer captured once and replayed on new inputs: the eager result bit for bit, and within the
    bound's distance of the Triton decode path on the same inputs."""
    from quantpatch.kernels.w4a8 import w4a8_gluon as wg
    from quantpatch.kernels.w4a8 import w4a8_triton as wt

    packed, (qw, sc, pe, b) = _layer(4096, 4096, seed=40)
    x = _randn(16, 4096, seed=41).to(torch.bfloat16).cuda()
    wg.w4a8_linear_gluon(x, qw, sc, pe, b)  # compiled and its scratch made outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = wg.w4a8_linear_gluon(x, qw, sc, pe, b)
    for seed in (41, 42):
        x.copy_(_randn(16, 4096, seed=seed).to(torch.bfloat16))
        graph.replay()
        assert torch.equal(out, wg.w4a8_linear_gluon(x, qw, sc, pe, b))
    y_ref = w4a8_linear_ref(x.cpu(), packed, b.cpu(), compute_dtype=torch.float32)
    bound = _error_bound(x.cpu(), packed, b, y_ref, torch.bfloat16)
    triton_path = wt.w4a8_linear_2d(x, qw, sc, pe, b, config=wt.gemm_config(16, 4096, 4096))
    assert ((out.cpu().double() - triton_path.cpu().double()).abs() <= 2 * bound).all()


@pytest.mark.gpu
@needs_cuda
@hopper
@pytest.mark.parametrize("shape", [(1, 4096), (3, 5, 4096), (17, 4096)])
def test_gpu_module_runs_the_gluon_kernels(shape):
    """``W4A8Linear`` on sm_90: the Gluon decode kernel for M ≤ 16, the Gluon prefill kernel above (both recorded
    as "gluon" on the site); within the reference's bound; the same bits eager and under ``torch.compile`` (the
    custom op)."""
    from quantpatch.fallback import SiteRecord, running_site
    from quantpatch.w4a8_linear import W4A8Linear

    lin = torch.nn.Linear(4096, 1024)
    with torch.no_grad():
        lin.weight.copy_(_randn(1024, 4096, seed=60, scale=0.02))
    mod = W4A8Linear.from_linear(lin).cuda()
    x = _randn(*shape, seed=61).to(torch.bfloat16).cuda()
    site = SiteRecord("layer", "linear", "w4a8")
    with running_site(site):
        y = mod(x)
    m = x.numel() // 4096
    assert site.implementations == {"gluon"} and y.shape == (*shape[:-1], 1024)
    packed = mod.packed()
    packed = packed._replace(qweight=packed.qweight.cpu(), scales=packed.scales.cpu())
    _assert_within_bound(y.reshape(m, 1024), x.reshape(m, 4096), packed, mod.bias, torch.bfloat16)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(mod)(x), y)


@pytest.mark.gpu
@needs_cuda
@hopper
@pytest.mark.parametrize("shape", [(1, 4096), (3, 5, 4096), (17, 4096), (1, 14336)])
def test_gpu_planned_module_calls_give_the_general_paths_bits(shape, monkeypatch):
    """From the second call of an input signature on, ``W4A8Linear`` runs that signature's planned call
    (``dispatch.LinearPlans``: the Gluon kernel called directly, no dispatch): on new input contents the bits of the
    whole path, still recorded as "gluon" on the running site."""
    from quantpatch import w4a8_linear
    from quantpatch.fallback import SiteRecord, running_site
    from quantpatch.w4a8_linear import W4A8Linear

    k = shape[-1]
    lin = torch.nn.Linear(k, 1024)
    with torch.no_grad():
        lin.weight.copy_(_randn(1024, k, seed=62, scale=0.02))
    mod = W4A8Linear.from_linear(lin).cuda()
    xs = [_randn(*shape, seed=63 + i).to(torch.bfloat16).cuda() for i in range(3)]
    site = SiteRecord("layer", "linear", "w4a8")
    with running_site(site):
        assert_planned_calls_follow_the_whole_path(mod, xs, w4a8_linear, monkeypatch)
    assert site.routes == {"gluon": 6}


@pytest.mark.gpu
@needs_cuda
@hopper
def test_gpu_gluon_launch_plans_follow_the_callers_layout_and_stream():
    """Launch plans (:func:`~quantpatch.kernels.w4a8.w4a8_gluon._launch`): ``x (16, 1024)`` 2 bytes off 16-byte
    alignment, with a longer row stride, and on a side stream, each called twice (first through
    ``JITFunction.run``, then the plan): the bits of the aligned contiguous call; every stream's counters at 0."""
    from quantpatch.kernels.w4a8 import w4a8_gluon as wg

    _, (qw, sc, pe, b) = _layer(512, 1024, seed=70)
    flat = _randn(1, 16 * 1032 + 1, seed=71).to(torch.bfloat16).cuda()
    strided = flat[0, : 16 * 1032].view(16, 1032)[:, :1024]
    unaligned = flat[0, 1 : 1 + 16 * 1024].view(16, 1024)
    for x in (unaligned, strided):
        ref = wg.w4a8_linear_gluon(x.contiguous(), qw, sc, pe, b)
        for _ in range(2):
            assert torch.equal(wg.w4a8_linear_gluon(x, qw, sc, pe, b), ref)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ys = [wg.w4a8_linear_gluon(strided, qw, sc, pe, b) for _ in range(2)]
    side.synchronize()
    assert all(torch.equal(y, ref) for y in ys)
    for stream in (torch.cuda.current_stream(), side):
        with torch.cuda.stream(stream):
            assert not w4a8_scratch._SCRATCH[(stream_key(ref.device), "gluon_counters")].any()


def test_weight_words_rejects_views_the_words_cannot_be_read_from():
    """Both Gluon GEMMs read qweight as int32 words: a row stride or an address off a multiple of 4 is a clear
    ValueError on the host, not a torch view error or a misaligned load."""
    from quantpatch.kernels.w4a8.w4a8_gluon_operand import weight_words

    q = torch.arange(4 * 68, dtype=torch.int32).to(torch.uint8).view(4, 68)
    words = weight_words(q[:, :64].contiguous())
    assert words.shape == (4, 16) and words.dtype == torch.int32
    assert torch.equal(words.view(torch.uint8), q[:, :64])
    with pytest.raises(ValueError, match="4-byte words"):
        weight_words(torch.zeros(4, 66, dtype=torch.uint8)[:, :64])  # row stride 66
    with pytest.raises(ValueError, match="4-byte words"):
        weight_words(q.view(-1)[1:257].view(4, 64))  # address + 1


def test_gemm_takes_only_contiguous_e4m3_x_hat():
    """``w4a8_gemm_gluon`` reads x̂ as e4m3 bytes in fragment order: another dtype or a strided view is a ValueError
    on the host, before any launch."""
    from quantpatch.kernels.w4a8 import w4a8_gluon as wg

    qw = torch.zeros(64, 64, dtype=torch.uint8)
    sc = torch.ones(64, 1).to(torch.float8_e4m3fn)
    beta = torch.ones(2, dtype=torch.bfloat16)
    pe = torch.zeros((), dtype=torch.int32)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        wg.w4a8_gemm_gluon(torch.zeros(2, 128, dtype=torch.bfloat16), beta, qw, sc, pe)
    with pytest.raises(ValueError, match="contiguous"):
        wg.w4a8_gemm_gluon(torch.zeros(2, 256).to(torch.float8_e4m3fn)[:, :128], beta, qw, sc, pe)
