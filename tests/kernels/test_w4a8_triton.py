"""FireQ W4A8-FP Triton kernels against :mod:`quantpatch.kernels.w4a8.w4a8_ref`.

Without CUDA the kernels run in the Triton interpreter (``conftest.py``) on small shapes; the
interpreter runs the FP8 ``tl.dot`` too (in fp32 over the exact e4m3 values, checked below against
float64). On a GPU the same tests run compiled, plus the ``gpu``-marked Llama-sized shapes.

Bounds (no tuned numbers):
* activation quantization: bit-exact (every e4m3 value and every BF16 scale) against the reference
  computing in float32, the precision ``W4A8Linear`` runs it in.
* GEMM: the kernel and the reference compute the same fp32 operations on the same exact products
  ``x̂ ŵ`` and differ only in the order of the sums, so each output differs by at most a forward
  error bound: ``|y − y_ref| ≤ 2 (γ + (G + 4) u) (mag + |bias|) + eps_out |y_ref|`` with
  ``mag = β 2⁻ⁿ Σ_g σ_g Σ_k |x̂ ŵ|``, ``u = 2⁻²⁴`` (fp32), ``G`` groups (the sum over groups, the ×σ,
  ×β and +bias roundings), the factor 2 for the two implementations, and ``eps_out`` for the two
  roundings to the output dtype. ``γ`` bounds one group's 128-term dot: ``127 u`` in fp32 (CPU and
  interpreter); on Hopper the FP8 MMA accumulates in a register of ≈ 13 mantissa bits that
  truncates (SageAttention2 §3.4, measured FP22), bounded here by 8 truncations (4 K-steps of 32,
  alignment and sum) of ≤ 2⁻¹² of the running magnitude each: ``γ_gpu = 2⁻⁹``. The decode kernel
  (M ≤ 16) sums a group as two 64-term fp16-operand dots (even, then odd channels) into fp32: only
  the order differs, inside the same bound; its split-K runs are added in a fixed order.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from quantpatch.dispatch import W4A8_KERNELS_MODULE, load_kernels
from quantpatch.fallback import QuantpatchFallbackWarning, SiteRecord, reset_fallback_warnings, running_site
from quantpatch.kernels.device import gluon_reason
from quantpatch.kernels.w4a8 import w4a8_act_quant_triton as wq
from quantpatch.kernels.w4a8 import w4a8_scratch
from quantpatch.kernels.w4a8 import w4a8_triton as wt
from quantpatch.kernels.w4a8.w4a8_ref import (
    GROUP_SIZE,
    quantize_activation_fp8,
    quantize_weight,
    unpack_weight,
    w4a8_linear_ref,
)
from quantpatch.w4a8_linear import W4A8Linear
from tests.gpu import CUDA, DEVICE, needs_cuda

gpu = pytest.mark.gpu

U_FP32 = 2.0**-24
GAMMA_GROUP = 2.0**-9 if CUDA else (GROUP_SIZE - 1) * U_FP32  # one group's dot (module docstring)


def _randn(*shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


def _layer(n, k, *, seed, pts=True, bias=True):
    """A packed weight (LLM-like scale, so PTS picks n > 0) and an optional bias, on DEVICE."""
    w = _randn(n, k, seed=seed, scale=0.02).float()
    packed = quantize_weight(w, pts=pts)
    b = _randn(n, seed=seed + 1).float().to(DEVICE) if bias else None
    pts_exp = torch.tensor(packed.pts_exp, dtype=torch.int32, device=DEVICE)
    return packed, (packed.qweight.to(DEVICE), packed.scales.to(DEVICE), pts_exp, b)


def _error_bound(x, packed, bias, y_ref, out_dtype):
    """The forward-error bound of the module docstring, elementwise ``(M, N)``, from CPU float64."""
    x_hat, beta = quantize_activation_fp8(x.cpu().float(), compute_dtype=torch.float64)
    q, sigma = unpack_weight(packed, torch.float64)
    groups = sigma.shape[1]
    mag = torch.einsum("mgk,ngk,ng->mn", x_hat.abs().reshape(x.shape[0], groups, GROUP_SIZE),
                       q.abs().reshape(q.shape[0], groups, GROUP_SIZE), sigma)
    mag = mag * beta * 2.0**-packed.pts_exp
    if bias is not None:
        mag = mag + bias.cpu().double().abs()
    eps_out = torch.finfo(out_dtype).eps
    return 2 * (GAMMA_GROUP + (groups + 4) * U_FP32) * mag + eps_out * y_ref.double().abs()


def _assert_within_bound(y, x, packed, bias, out_dtype):
    """``y (M, N)`` against :func:`w4a8_linear_ref` on the CPU (``packed`` on the CPU) within :func:`_error_bound`."""
    x = x.cpu()
    y_ref = w4a8_linear_ref(x, packed, None if bias is None else bias.cpu(), compute_dtype=torch.float32)
    err = (y.cpu().double() - y_ref.double()).abs()
    bound = _error_bound(x, packed, bias, y_ref, out_dtype)
    assert torch.isfinite(y.cpu()).all()
    assert (err <= bound).all(), f"max err {err.max():.3e}, worst err/bound {(err / bound).max():.3f}"


def _check_gemm(m, n, k, *, seed, dtype, pts=True, bias=True, config=None):
    packed, (qw, sc, pe, b) = _layer(n, k, seed=seed, pts=pts, bias=bias)
    x = _randn(m, k, seed=seed + 2).to(dtype)
    x_hat, beta = wt.quantize_activation_fp8(x.to(DEVICE))
    y = wt.w4a8_gemm(x_hat, beta, qw, sc, pe, b, dtype, config=config)
    assert y.shape == (m, n) and y.dtype == dtype
    _assert_within_bound(y, x, packed, b, dtype)
    return y


# --------------------------------------------------------------------------- activation quantization


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,k", [(1, 128), (5, 300), (3, 2500)])  # 2500 > the 1024 chunk: three chunks per pass
def test_activation_quantization_bit_exact(dtype, m, k, monkeypatch):
    monkeypatch.setattr(wq, "ACT_BLOCK_K", 1024)  # the long-row path (two passes) on a small row
    x = _randn(m, k, seed=m + k, scale=3.0)
    x[0, :7] = torch.tensor([1e4, -1e4, 0.3, -0.3, 1e-3, 448.0, -449.0])  # an outlier channel, saturation edge
    if m > 1:
        x[1] = 0.0  # an all-zero token: β = 1
    if m > 2:
        x[2] *= 1e-3
    x = x.to(dtype)
    x_hat, beta = wt.quantize_activation_fp8(x.to(DEVICE))
    ref_hat, ref_beta = quantize_activation_fp8(x, compute_dtype=torch.float32)
    assert x_hat.dtype == torch.float8_e4m3fn and beta.dtype == torch.bfloat16 and beta.shape == (m,)
    assert torch.equal(x_hat.cpu().float(), ref_hat)
    assert torch.equal(beta.cpu().float(), ref_beta[:, 0])


def test_activation_quantization_rounds_scale_and_values_to_nearest_even():
    # absmax/448 = 1 + 2^-8 is a bf16 tie (halfway between 1 and 1 + 2^-7): even → β = 1, which a truncating
    # cast also gives; 1 + 3·2^-8 is a tie that rounds up to 1 + 2^-6 (truncation would give 1 + 2^-7).
    x = torch.tensor([[448 * (1 + 2.0**-8), 1.0625, 1.1875], [448 * (1 + 3 * 2.0**-8), 0.0, 0.0]])
    x_hat, beta = wt.quantize_activation_fp8(x.to(DEVICE))
    assert beta.cpu().float().tolist() == [1.0, 1 + 2.0**-6]
    # 1.0625 and 1.1875 are e4m3 ties (step 1/8 in [1, 2)): to even → 1.0 and 1.25; the outlier saturates to 448
    assert x_hat[0].cpu().float().tolist() == [448.0, 1.0, 1.25]


# --------------------------------------------------------------------------- GEMM


@pytest.mark.parametrize("m", [1, 5, 16, 33])  # the decode kernel up to 16 tokens, then the tiled one
@pytest.mark.parametrize("pts,bias", [(True, True), (False, False)])
def test_gemm_matches_reference(m, pts, bias):
    _check_gemm(m, 67, 384, seed=m, dtype=torch.float32, pts=pts, bias=bias)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemm_output_dtypes(dtype):
    _check_gemm(5, 67, 256, seed=3, dtype=dtype)


@pytest.mark.parametrize("row", range(len(wt.GEMM_CONFIGS)))
def test_gemm_every_configuration_of_the_table(row):
    """Each row's configuration on a shape with tails in M (up to its max M) and N."""
    max_m, cfg = wt.GEMM_CONFIGS[row]
    _check_gemm(max_m or 300, 67, 5 * GROUP_SIZE, seed=10 + row, dtype=torch.float32, config=dict(cfg, num_stages=1))


def _decode_cfg(block_n=16, gps=2, fused=0, swap=0):
    return dict(kernel="decode", block_n=block_n, gps=gps, fused=fused, swap=swap, num_warps=4)


def _counters_are_zero(device):
    scratch = w4a8_scratch._SCRATCH.items()
    return not any(buf.any() for (key, name), buf in scratch if name == "counters" and key[0] == device)


@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("block_n,gps,split", [(16, 5, 1), (32, 2, 3), (64, 1, 5)])
def test_decode_kernel_split_k(m, block_n, gps, split):
    """Split-K runs summed by the last program to arrive: runs of 2, 2, 1 groups (a short last run) or 1 each,
    an odd N; the tickets are back at 0 afterwards, and a second call gives the same bits."""
    n, groups = 67, 5
    cfg = _decode_cfg(block_n, gps)
    assert wt.decode_split(cfg, n, groups)[0] == split
    y = _check_gemm(m, n, groups * GROUP_SIZE, seed=20 + m + split, dtype=torch.bfloat16, config=cfg)
    assert _counters_are_zero(y.device)
    again = _check_gemm(m, n, groups * GROUP_SIZE, seed=20 + m + split, dtype=torch.bfloat16, config=cfg)
    assert torch.equal(y, again)


@pytest.mark.parametrize("m", [17, 40])
@pytest.mark.parametrize("swap", [0, 1])
def test_tiled_kernel_orientations(m, swap):
    """The tiled kernel as ``x̂ ŵᵀ`` (weights interleaved back into channel order) and as ``ŵ x̂ᵀ`` (even/odd dots)."""
    cfg = dict(kernel="tiled", block_m=32, block_n=16, swap=swap, num_warps=4, num_stages=1)
    _check_gemm(m, 67, 3 * GROUP_SIZE, seed=40 + m, dtype=torch.float16, config=cfg)


@pytest.mark.parametrize("m", [1, 7, 16])
@pytest.mark.parametrize("swap", [0, 1])
@pytest.mark.parametrize("gps", [2, 5])
def test_decode_kernel_fused_quantization(m, swap, gps, monkeypatch):
    """One launch from ``x``: the first M programs quantize, the GEMM programs wait for them. The same bits
    as quantizing first (the quantization is bit-exact either way and the GEMM is the same program), within
    the reference's bound, and the flag and counts are back at 0 for the next launch."""
    n, k = 67, 5 * GROUP_SIZE
    packed, (qw, sc, pe, b) = _layer(n, k, seed=30 + m, bias=swap == 1)
    x = _randn(m, k, seed=31 + m).to(torch.bfloat16).to(DEVICE)
    with monkeypatch.context() as patch:  # fused: the activation kernel is not launched
        patch.setattr(wt, "quantize_activation_fp8", None)
        fused = wt.w4a8_linear_2d(x, qw, sc, pe, b, config=_decode_cfg(32, gps, fused=1, swap=swap))
    assert _counters_are_zero(fused.device)
    two_step = wt.w4a8_linear_2d(x, qw, sc, pe, b, config=_decode_cfg(32, gps, fused=0, swap=swap))
    assert torch.equal(fused, two_step)
    _assert_within_bound(fused, x, packed, b, torch.bfloat16)


def test_decode_fuses_only_rows_that_fit_one_chunk(monkeypatch):
    """K above DECODE_QBLOCK: the activation kernel runs first (a multi-pass row would hold up the GEMM)."""
    _, (qw, sc, pe, b) = _layer(40, 3 * GROUP_SIZE, seed=50)
    x = _randn(2, 3 * GROUP_SIZE, seed=51).to(torch.float16).to(DEVICE)
    calls = []
    quantize = wt.quantize_activation_fp8
    monkeypatch.setattr(wt, "quantize_activation_fp8", lambda t: calls.append(t.shape) or quantize(t))
    cfg = _decode_cfg(32, 2, fused=1, swap=1)
    fused = wt.w4a8_linear_2d(x, qw, sc, pe, b, config=cfg)
    monkeypatch.setattr(wt, "DECODE_QBLOCK", 256)
    assert not calls and torch.equal(wt.w4a8_linear_2d(x, qw, sc, pe, b, config=cfg), fused) and calls == [(2, 384)]


@pytest.mark.gpu
@needs_cuda
def test_gpu_split_k_tickets_are_per_stream():
    device = torch.device("cuda", torch.cuda.current_device())
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        on_side = wt._semaphores(device, 8)
    assert wt._semaphores(device, 8) is not on_side  # overlapping launches on two streams never share tickets
    assert wt._semaphores(device, 8) is wt._semaphores(device, 8)


def test_gemm_config_table():
    assert wt.gemm_config(16, 4096, 4096)["kernel"] == "decode" and wt.gemm_config(17, 4096, 4096)["kernel"] == "tiled"
    assert wt.gemm_config(4096, 4096, 4096)["block_m"] == 128
    cfg = _decode_cfg(32, gps=4)
    assert wt.decode_split(cfg, 4096, 2) == (1, 2)  # 2 groups: no split
    assert wt.decode_split(cfg, 4096, 32) == (8, 4)  # runs of 4 groups
    assert wt.decode_split(cfg, 4096, 112) == (wt.MAX_SPLIT, 7)  # at most MAX_SPLIT runs: longer ones
    assert wt.decode_split(_decode_cfg(32, gps=3), 4096, 32) == (11, 3)  # 10 runs of 3, a last one of 2
    with pytest.raises(ValueError, match="M ≤ 16"):
        wt.w4a8_gemm(torch.zeros(17, 128, dtype=torch.float8_e4m3fn), torch.ones(17, dtype=torch.bfloat16),
                      torch.zeros(4, 64, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.float8_e4m3fn),
                      torch.tensor(0, dtype=torch.int32), config=cfg)


def test_gemm_rejects_bad_shapes():
    x_hat = torch.zeros(2, 200, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="multiple of 128"):
        wt.w4a8_gemm(x_hat, torch.ones(2, dtype=torch.bfloat16), torch.zeros(4, 100, dtype=torch.uint8),
                     torch.zeros(4, 2, dtype=torch.float8_e4m3fn), torch.tensor(0, dtype=torch.int32))


@pytest.mark.parametrize("cfg", [dict(kernel="tiled", block_m=16, block_n=16, num_warps=4, num_stages=1),
                                 _decode_cfg(16, gps=1), _decode_cfg(64, gps=1, swap=1)])
def test_interpreter_dots_are_exact_on_e4m3_operands(cfg):
    """What the CPU runs rests on: the interpreter's FP8 (tiled) and fp16 (decode) dots equal float64 on
    e4m3 × INT4 operands that fp32 holds."""
    packed, (qw, sc, pe, _) = _layer(16, 128, seed=4, pts=False, bias=False)
    x_hat = (_randn(16, 128, seed=5, scale=20.0).clamp(-448, 448)).to(torch.float8_e4m3fn).to(DEVICE)
    ones = torch.ones(16, dtype=torch.bfloat16, device=DEVICE)
    y = wt.w4a8_gemm(x_hat, ones, qw, sc, pe, None, torch.float32, config=cfg)
    q, sigma = unpack_weight(packed, torch.float64)
    expect = (x_hat.cpu().double() @ q.T) * sigma[:, 0]
    if CUDA:  # Hopper's FP8 accumulator is narrower: γ_gpu of the magnitude (module docstring)
        mag = (x_hat.cpu().double().abs() @ q.abs().T) * sigma[:, 0]
        assert ((y.cpu().double() - expect).abs() <= GAMMA_GROUP * mag).all()
    else:
        assert torch.equal(y.double(), expect.float().double())  # |partial| < 2^24 in integer steps of 2^-9


@pytest.mark.parametrize("m,dtype,bias", [(3, torch.bfloat16, True), (20, torch.float16, False)])
def test_custom_op_has_a_consistent_fake_kernel(m, dtype, bias):
    packed, (qw, sc, pe, b) = _layer(67, 256, seed=6, bias=bias)
    x = _randn(m, 256, seed=7).to(dtype).to(DEVICE)
    # opcheck's test_schema compares tensors by arithmetic that PyTorch lacks for float8; fake vs real it can check
    torch.library.opcheck(wt.w4a8_linear_op, (x, qw, sc, pe, b), test_utils=("test_faketensor",))


# --------------------------------------------------------------------------- W4A8Linear dispatch


@pytest.fixture
def kernels_on_this_device(monkeypatch):
    """Let the Triton path take CPU tensors (it runs in the interpreter) so the dispatch is testable here; registered
    with ``W4A8Linear`` as a first CUDA input would."""
    load_kernels(W4A8_KERNELS_MODULE)
    if not CUDA:
        monkeypatch.setattr(wt, "device_unsupported", lambda x: None)
    reset_fallback_warnings()
    yield
    reset_fallback_warnings()


def _module(k, n, *, seed, **kw):
    lin = torch.nn.Linear(k, n)
    with torch.no_grad():
        lin.weight.copy_(_randn(n, k, seed=seed, scale=0.02))
        lin.bias.copy_(_randn(n, seed=seed + 1))
    return W4A8Linear.from_linear(lin, **kw).to(DEVICE)


def test_module_takes_the_kernel_for_multiples_of_128(kernels_on_this_device, recwarn):
    mod = _module(256, 67, seed=8)
    x = _randn(2, 3, 256, seed=9).to(torch.bfloat16).to(DEVICE)
    site = SiteRecord("layer", "linear", "w4a8")
    with running_site(site):
        y = mod(x)
    assert site.implementations == {"gluon" if wt.uses_gluon(6, 67, 256, x.device) else "triton"}
    assert not site.fallbacks and y.shape == (2, 3, 67) and y.dtype == torch.bfloat16
    expect = wt.w4a8_linear(x, mod.qweight, mod.scales, mod.pts_exp, mod.bias)
    assert torch.equal(y, expect)
    assert not [w for w in recwarn if issubclass(w.category, QuantpatchFallbackWarning)]


@pytest.mark.parametrize("k,kw,reason", [(200, {}, "not a multiple of 128"),
                                         (256, dict(weight_operand="lut"), "weight_operand")])
def test_module_falls_back_to_reference_with_one_warning(kernels_on_this_device, k, kw, reason):
    mod = _module(k, 24, seed=11, **kw)
    x = _randn(3, k, seed=12).float().to(DEVICE)
    site = SiteRecord("layer", "linear", "w4a8")
    with pytest.warns(QuantpatchFallbackWarning, match=reason) as caught, running_site(site):
        y1 = mod(x)
        y2 = mod(x)
    assert len([w for w in caught if issubclass(w.category, QuantpatchFallbackWarning)]) == 1
    assert site.implementations == set() and len(site.fallbacks) == 1
    ref = w4a8_linear_ref(x, mod.packed(), mod.bias, operand=mod.weight_operand, compute_dtype=torch.float32)
    assert torch.equal(y1, ref) and torch.equal(y2, y1)  # the fallback is the reference, on the module's device


def test_gluon_decode_kernel_needs_sm90_and_gluon():
    assert gluon_reason((9, 0), None) is None
    assert "compute capability 8.9" in gluon_reason((8, 9), None)
    assert "compute capability 10.0" in gluon_reason((10, 0), None)
    assert "does not import (no gluon)" in gluon_reason((9, 0), "no gluon")
    assert gluon_reason(None, None) == "not a CUDA device"
    assert wt.GLUON.unsupported(torch.device("cpu")) == "not a CUDA device"


def test_gluon_unsupported_asks_a_device_once_and_logs_why(monkeypatch, caplog):
    device = torch.device("cuda", 99)  # fictitious: its capability is monkeypatched
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: asked.append(d) or (8, 9))
    monkeypatch.setattr(wt.GLUON, "reasons", {})
    with caplog.at_level(logging.INFO, logger="quantpatch"):
        assert "compute capability 8.9" in wt.GLUON.unsupported(device)
        assert not wt.uses_gluon(16, 64, 256, device)
    assert asked == [device]
    assert len([r for r in caplog.records if "the Triton decode kernel, not the Gluon one" in r.getMessage()]) == 1
    monkeypatch.setattr(wt.GLUON, "reasons", {device: None})  # an sm_90 device
    assert wt.uses_gluon(16, 64, 256, device) and wt.uses_gluon(1, 64, 256, device)
    assert not wt.uses_gluon(17, 64, 256, device)


def test_module_sends_up_to_16_tokens_to_the_gluon_kernel_where_it_serves(kernels_on_this_device, monkeypatch):
    """``W4A8Linear`` → the fast path → :func:`w4a8_linear_2d` (the custom op's body): M ≤ 16 tokens to
    ``w4a8_gluon.w4a8_linear_gluon`` (2-D, recorded as "gluon"), 17 to the Triton tiled path (the prefill
    kernel's gate closed here). Gluon has no interpreter: its launcher is replaced by the Triton decode path."""
    calls = []

    def gluon_layer(x, qweight, scales, pts_exp, bias):
        calls.append(tuple(x.shape))
        return wt.w4a8_linear_2d(x, qweight, scales, pts_exp, bias, config=wt.gemm_config(16, 67, 256))

    monkeypatch.setattr(wt.GLUON, "unsupported", lambda device: None)
    monkeypatch.setattr(wt.PREFILL_GLUON, "unsupported", lambda device: "off in this test")
    monkeypatch.setattr(wt, "_gluon", SimpleNamespace(w4a8_linear_gluon=gluon_layer))
    mod = _module(256, 67, seed=70)
    for shape, impl in (((2, 8, 256), "gluon"), ((17, 256), "triton")):
        x = _randn(*shape, seed=71).to(torch.bfloat16).to(DEVICE)
        site = SiteRecord("layer", "linear", "w4a8")
        with running_site(site):
            y = mod(x)
        assert site.implementations == {impl}
        x2 = x.reshape(-1, 256)
        cfg = wt.gemm_config(x2.shape[0], 67, 256)
        assert torch.equal(y.reshape(-1, 67), wt.w4a8_linear_2d(x2, mod.qweight, mod.scales, mod.pts_exp, mod.bias,
                                                                 config=cfg))
    assert calls == [(16, 256)]


def test_module_sends_more_than_16_tokens_to_the_gluon_prefill_kernel_where_it_serves(kernels_on_this_device,
                                                                                       monkeypatch, caplog):
    """Above 16 tokens, ``w4a8_prefill_gluon.w4a8_linear_prefill_gluon`` (recorded as "gluon") where its gate
    opens; a shape whose kernel does not compile closes the gate with one warning and the Triton tiled kernel serves
    it and every later call, the shapes planned before included (the launcher is replaced here: Gluon has no
    interpreter)."""
    import triton

    calls = []

    def prefill_layer(x, qweight, scales, pts_exp, bias):
        calls.append(tuple(x.shape))
        if x.shape[0] != 300:
            raise triton.CompilationError("def kernel(): ...", None, "no attribute 'async_load'")
        return wt.w4a8_linear_2d(x, qweight, scales, pts_exp, bias, config=wt.gemm_config(300, 67, 256))

    monkeypatch.setattr(wt.PREFILL_GLUON, "reasons", {torch.device(DEVICE): None})  # as on an sm_90 device
    monkeypatch.setattr(wt, "_prefill", SimpleNamespace(w4a8_linear_prefill_gluon=prefill_layer))
    assert wt.uses_gluon(17, 67, 256, torch.device(DEVICE)) and wt.uses_gluon(4096, 67, 256, torch.device(DEVICE))
    mod = _module(256, 67, seed=74)
    xs = [_randn(3, tokens, 256, seed=75).to(torch.bfloat16).to(DEVICE) for tokens in (100, 101)]
    wants = [wt.w4a8_linear_2d(x.reshape(-1, 256), mod.qweight, mod.scales, mod.pts_exp, mod.bias,
                               config=wt.gemm_config(x.numel() // 256, 67, 256)) for x in xs]
    for i, impl in ((0, "gluon"), (0, "gluon"), (1, "triton"), (0, "triton"), (1, "triton")):
        site = SiteRecord("layer", "linear", "w4a8")
        with caplog.at_level(logging.WARNING, logger="quantpatch"), running_site(site):
            y = mod(xs[i])
        assert site.implementations == {impl} and torch.equal(y.reshape(-1, 67), wants[i])
    assert calls == [(300, 256), (300, 256), (303, 256)]
    assert len([r for r in caplog.records if "W4A8 prefill" in r.getMessage()]) == 1


def test_gluon_kernel_that_does_not_compile_warns_once_and_triton_serves(kernels_on_this_device, monkeypatch,
                                                                        caplog):
    """A Triton whose Gluon API differs from the one the kernel is written for: the first call logs a warning,
    the Triton decode kernel serves it and every later call, and the call is recorded as "triton"."""
    import triton

    def gluon_layer(*args):
        calls.append(1)
        raise triton.CompilationError("def kernel(): ...", None, "no attribute 'thread_barrier'")

    calls = []
    monkeypatch.setattr(wt.GLUON, "reasons", {torch.device(DEVICE): None})  # as on an sm_90 device
    monkeypatch.setattr(wt, "_gluon", SimpleNamespace(w4a8_linear_gluon=gluon_layer))
    mod = _module(256, 67, seed=72)
    x = _randn(4, 256, seed=73).to(torch.bfloat16).to(DEVICE)
    site = SiteRecord("layer", "linear", "w4a8")
    with caplog.at_level(logging.WARNING, logger="quantpatch"), running_site(site):
        y1, y2 = mod(x), mod(x)
    assert calls == [1] and site.implementations == {"triton"}
    assert len([r for r in caplog.records if "does not compile with Triton" in r.getMessage()]) == 1
    want = wt.w4a8_linear_2d(x, mod.qweight, mod.scales, mod.pts_exp, mod.bias, config=wt.gemm_config(4, 67, 256))
    assert torch.equal(y1, want) and torch.equal(y2, want)


@pytest.mark.skipif(CUDA, reason="the CPU-only path")
def test_module_on_cpu_uses_the_reference_silently(recwarn):
    reset_fallback_warnings()
    mod = _module(256, 24, seed=13)
    x = _randn(3, 256, seed=14).float()
    assert torch.equal(mod(x), w4a8_linear_ref(x, mod.packed(), mod.bias, compute_dtype=torch.float32))
    assert not [w for w in recwarn if issubclass(w.category, QuantpatchFallbackWarning)]


# --------------------------------------------------------------------------- GPU: Llama-sized shapes


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 16, 100, 300])
@pytest.mark.parametrize("n,k", [(4096, 4096), (1000, 14336)])
def test_gpu_gemm_llama_shapes(m, n, k):
    _check_gemm(m, n, k, seed=m + n, dtype=torch.bfloat16)


@gpu
@needs_cuda
@pytest.mark.parametrize("k", [4096, 14336])
def test_gpu_activation_quantization_bit_exact(k):
    x = (_randn(64, k, seed=k, scale=2.0) * _randn(1, k, seed=1).exp()).to(torch.bfloat16)
    x_hat, beta = wt.quantize_activation_fp8(x.cuda())
    ref_hat, ref_beta = quantize_activation_fp8(x, compute_dtype=torch.float32)
    assert torch.equal(x_hat.cpu().float(), ref_hat) and torch.equal(beta.cpu().float(), ref_beta[:, 0])


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 16])
def test_gpu_module_under_a_cuda_graph(m):
    """Capture the layer call once and replay it (as a decode server does): the eager result, bit for bit."""
    mod = _module(4096, 4096, seed=22)
    x = _randn(m, 4096, seed=23).to(torch.bfloat16).cuda()
    eager = mod(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mod(x)
    for seed in (24, 25):
        x.copy_(_randn(m, 4096, seed=seed).to(torch.bfloat16))
        graph.replay()
        assert torch.equal(out, mod(x))
    x.copy_(_randn(m, 4096, seed=23).to(torch.bfloat16))
    graph.replay()
    assert torch.equal(out, eager)


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 16, 2048])
def test_gpu_gemm_is_deterministic(m):
    """Split-K runs are summed in a fixed order (no atomics): bitwise equal results run to run."""
    _, (qw, sc, pe, b) = _layer(4096, 4096, seed=20)
    x = _randn(m, 4096, seed=21).to(torch.bfloat16).cuda()
    first = wt.w4a8_linear(x, qw, sc, pe, b)
    for _ in range(3):
        assert torch.equal(wt.w4a8_linear(x, qw, sc, pe, b), first)
