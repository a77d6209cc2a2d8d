"""FireQ W4A8-FP linear: INT4/e4m3-group weights, PTS, FP8 activations, the reference product and ``W4A8Linear``."""

from __future__ import annotations

import pytest
import torch

from quantpatch.kernels.fireq_kv.fireq_ref import unpack_int4_signed
from quantpatch.kernels.quant_ref import cast_fp8
from quantpatch.kernels.w4a8.w4a8_ref import (
    PTS_UNDERFLOW,
    dequantize_weight,
    pts_exponent,
    pts_underflow_score,
    quantize_activation_fp8,
    quantize_weight,
    quantize_weight_int4,
    w4a8_linear_ref,
    weight_nbytes,
)
from quantpatch.metrics import cos_sim
from quantpatch.w4a8_linear import W4A8Linear, w4a8_matmul
from tests.gpu import needs_cuda

# W4A8 on randn weights/activations, group 128: INT4 gives SQNR ≈ 20 dB (σ = absmax/7 over a
# 128-group of N(0,1) ≈ 0.39, error std σ/√12) → CosSim ≈ 0.995; FP8 activations add < 0.001.
# Measured 0.9944-0.9952 on the shapes below; floor with margin.
W4A8_RANDN_COS_FLOOR = 0.99


def _randn(*shape, seed=0, scale=1.0, dtype=torch.float32):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale).to(dtype)


# --------------------------------------------------------------------------- weight quantizer


@pytest.mark.parametrize("shape", [(7, 128), (96, 200), (33, 384)])
def test_weight_int4_groups_are_symmetric_absmax_over_7_with_e4m3_scales(shape):
    w = _randn(*shape, seed=1, scale=0.05)
    for n in (0, pts_exponent(w)):
        q, s = quantize_weight_int4(w, 128, pts_exp=n)
        groups = -(-shape[1] // 128)
        assert q.shape == (shape[0], groups * 128) and s.shape == (shape[0], groups)
        assert torch.equal(cast_fp8(s, "fp8_e4m3"), s)  # σ on the e4m3 grid
        assert torch.equal(q, q.round()) and q.abs().max() <= 8
        wp = torch.nn.functional.pad(w.double() * 2.0**n, (0, groups * 128 - shape[1]))
        grouped = wp.reshape(shape[0], groups, 128)
        expect = cast_fp8(grouped.abs().amax(-1) / 7, "fp8_e4m3")
        assert torch.equal(s, expect)
        normal = s >= 2.0**-6  # a normal σ: round-to-nearest within half a step, no clamp
        err = (q.reshape_as(grouped) * s[..., None] - grouped).abs()
        assert (err <= s[..., None] / 2 + 1e-12)[normal].all()
        assert (q[:, shape[1]:] == 0).all()  # padding stays zero


def test_group_below_lemma_b1_threshold_underflows_to_zero_not_nan():
    w = torch.full((2, 128), 7 * 2.0**-11)  # absmax/7 = 2^-11: rounds to e4m3 zero (Lemma B.1)
    w[1] = 0.0  # an all-zero group keeps the house convention σ = 1
    q, s = quantize_weight_int4(w, 128)
    assert s.flatten().tolist() == [0.0, 1.0] and (q == 0).all()
    p = quantize_weight(w, pts=False)
    assert torch.isfinite(w4a8_linear_ref(torch.ones(1, 128), p)).all()


def test_pack_unpack_layout_two_nibbles_per_byte():
    w = _randn(5, 256, seed=2)
    p = quantize_weight(w)
    q, _ = quantize_weight_int4(w, 128, pts_exp=p.pts_exp)
    assert p.qweight.dtype == torch.uint8 and p.qweight.shape == (5, 128)
    assert p.scales.dtype == torch.float8_e4m3fn and p.scales.shape == (5, 2)
    assert torch.equal(unpack_int4_signed(p.qweight, torch.float64), q)
    low = (p.qweight[0, 0] & 0xF).item()
    assert (low - 16 if low >= 8 else low) == q[0, 0].item()


# --------------------------------------------------------------------------- PTS (Definition 3.2)


def _pts_by_definition(w: torch.Tensor, horizon: int = 40) -> int:
    """Eq. 8-9 literally: the first n >= 0 where 𝕊 stops changing or an element enters [7·2^(5-n), 7·2^(6-n))."""
    a = w.double().abs()
    for n in range(64):
        s_n = pts_underflow_score(w.double() * 2.0**n)
        stable = all(pts_underflow_score(w.double() * 2.0 ** (n + i)) == s_n for i in range(1, horizon))
        band = ((a >= 7 * 2.0 ** (5 - n)) & (a < 7 * 2.0 ** (6 - n))).any()
        if stable or band:
            return n
    return 64


@pytest.mark.parametrize(
    "w",
    [
        _randn(16, 128, seed=3, scale=0.02),  # LLM-like: the band condition decides (max → [224, 448))
        torch.linspace(0.005, 0.01, 128).reshape(2, 64),  # the underflow score settles first
        torch.tensor([[300.0, 1.0]]),  # already in the band at n = 0
        torch.tensor([[0.0, 1e-3, -2e-3, 0.0]]),  # zeros add a constant to 𝕊
    ],
)
def test_pts_exponent_matches_definition_3_2(w):
    assert pts_exponent(w) == _pts_by_definition(w)


def test_pts_puts_the_largest_weight_in_224_448_and_edge_cases():
    w = _randn(32, 256, seed=4, scale=0.02)
    n = pts_exponent(w)
    assert 224 <= w.abs().max().item() * 2.0**n < 448
    assert pts_exponent(torch.zeros(3, 3)) == 0
    assert pts_exponent(torch.tensor([[500.0, 1e-9]])) == 0  # scaling up can only overflow
    assert pts_underflow_score(torch.tensor([0.0, 1.0])) == pytest.approx(PTS_UNDERFLOW)


def test_pts_is_exact_power_of_two_in_the_output():
    w, x = _randn(24, 256, seed=5, scale=0.01), _randn(3, 256, seed=6)
    a, b = quantize_weight(w, pts=True), quantize_weight(w, pts=False)
    assert a.pts_exp > 0
    # PTS only moves where σ sits on the e4m3 grid; the effective weight stays within INT4 error.
    assert (dequantize_weight(a) - w.double()).abs().max() <= (dequantize_weight(b) - w.double()).abs().max() * 2
    assert cos_sim(w4a8_linear_ref(x, a), x @ w.T) > W4A8_RANDN_COS_FLOOR


# --------------------------------------------------------------------------- activations and product


def test_activation_fp8_per_token_bf16_scale():
    x = _randn(4, 300, seed=7) * torch.tensor([[1.0], [1e-3], [50.0], [0.0]])
    xh, beta = quantize_activation_fp8(x)
    assert torch.equal(beta.to(torch.bfloat16).double(), beta)
    assert torch.equal(cast_fp8(xh, "fp8_e4m3"), xh)
    assert (xh[:3].abs().amax(-1) == 448).all() and beta[3].item() == 1.0


@pytest.mark.parametrize("operand", ["group", "lut"])
@pytest.mark.parametrize("m,k,o", [(1, 128, 16), (113, 200, 96), (16, 384, 40)])
def test_w4a8_linear_ref_equals_its_formula(operand, m, k, o):
    w, x, bias = _randn(o, k, seed=8, scale=0.03), _randn(m, k, seed=9), _randn(o, seed=10)
    p = quantize_weight(w)
    y = w4a8_linear_ref(x, p, bias, operand=operand)
    xh, beta = quantize_activation_fp8(x)
    q, s = quantize_weight_int4(w, 128, pts_exp=p.pts_exp)
    w_eff = q.reshape(o, -1, 128) * s[..., None]
    if operand == "lut":
        w_eff = cast_fp8(w_eff, "fp8_e4m3")
    w_eff = w_eff.reshape(o, -1)[:, :k] * 2.0**-p.pts_exp
    expect = (xh * beta) @ w_eff.T + bias.double()
    torch.testing.assert_close(y.double(), expect.to(x.dtype).double(), rtol=1e-6, atol=1e-6)
    assert cos_sim(y, x @ w.T + bias) > W4A8_RANDN_COS_FLOOR


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_module_from_linear_matches_reference_and_keeps_dtype(dtype):
    lin = torch.nn.Linear(200, 48, bias=True)
    with torch.no_grad():
        lin.weight.copy_(_randn(48, 200, seed=11, scale=0.05))
    mod = W4A8Linear.from_linear(lin)
    x = _randn(2, 7, 200, seed=12).to(dtype)
    y = mod(x)
    assert y.shape == (2, 7, 48) and y.dtype == dtype
    ref = w4a8_linear_ref(x.float(), mod.packed(), mod.bias, compute_dtype=torch.float32)
    torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=1e-2)
    assert cos_sim(y.float(), lin(x.float())) > W4A8_RANDN_COS_FLOOR
    assert set(mod.state_dict()) == {"qweight", "scales", "pts_exp", "bias"}


def test_module_to_dtype_keeps_e4m3_scales_and_unpack_cache_tracks_reloads():
    mod = W4A8Linear.from_linear(torch.nn.Linear(128, 8))
    x = _randn(3, 128, seed=13)
    mod.cache_unpacked = True
    y = mod(x)
    mod.to(torch.bfloat16)
    assert mod.scales.dtype == torch.float8_e4m3fn and mod.bias.dtype == torch.bfloat16
    other = W4A8Linear.from_linear(torch.nn.Linear(128, 8))
    mod.load_packed(other.packed())
    assert not torch.equal(mod(x), y)  # the cache saw the new weights


def test_weight_memory_is_over_3_5x_smaller_than_bf16():
    for o, k in [(4096, 4096), (14336, 4096), (4096, 14336)]:
        mod = W4A8Linear(k, o, bias=False, device="meta")
        assert mod.weight_nbytes() == weight_nbytes(o, k) == o * k // 2 + o * k // 128
        assert o * k * 2 / mod.weight_nbytes() >= 3.5
    lin = torch.nn.Linear(512, 256, bias=False)
    mod = W4A8Linear.from_linear(lin)
    fp = mod.memory_footprint()
    assert fp["bf16_weight"] / (fp["qweight"] + fp["scales"]) >= 3.5


def test_a_registered_implementation_is_tried_first(monkeypatch):
    from quantpatch import dispatch

    monkeypatch.setattr(dispatch, "_REGISTRY", {**dispatch._REGISTRY, "w4a8_linear": {
        key: list(impls) for key, impls in dispatch._REGISTRY["w4a8_linear"].items()}})
    mod = W4A8Linear.from_linear(torch.nn.Linear(128, 4))
    calls = []
    dispatch.register("w4a8_linear", "w4a8_fp8", dispatch.Implementation(
        "test-sentinel", 100, lambda call: None if call.x.shape[0] == 1 else dispatch.Quiet("more than one token"),
        lambda call: calls.append(1) or call.x[:, :4]))
    one = w4a8_matmul(torch.ones(1, 128), mod)
    two = w4a8_matmul(torch.ones(2, 128), mod)
    assert calls == [1] and torch.equal(one, torch.ones(1, 4))
    assert torch.equal(two, w4a8_linear_ref(torch.ones(2, 128), mod.packed(), mod.bias, compute_dtype=torch.float32))


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="weight_operand"):
        W4A8Linear(128, 4, weight_operand="bogus")
    with pytest.raises(ValueError, match="input features"):
        w4a8_linear_ref(torch.ones(1, 64), quantize_weight(torch.ones(4, 128)))
    with pytest.raises(ValueError, match="2-D"):
        quantize_weight_int4(torch.ones(4))


@pytest.mark.gpu
@needs_cuda
def test_gpu_module_runs_the_kernels():
    """15 tokens: the Gluon decode kernel on sm_90, the Triton one elsewhere (``w4a8_triton.uses_gluon``)."""
    from quantpatch.fallback import SiteRecord, running_site
    from quantpatch.kernels.w4a8 import w4a8_triton as wt

    lin = torch.nn.Linear(4096, 1024, bias=True)
    with torch.no_grad():
        lin.weight.copy_(_randn(1024, 4096, seed=15, scale=0.02))
    mod = W4A8Linear.from_linear(lin).cuda()
    x = _randn(3, 5, 4096, seed=16).to(torch.bfloat16)
    site = SiteRecord("layer", "linear", "w4a8")
    with running_site(site):
        y = mod(x.cuda())
    assert site.implementations == {"gluon" if wt.uses_gluon(15, 1024, 4096, y.device) else "triton"}
    assert y.dtype == torch.bfloat16 and y.shape == (3, 5, 1024)
    packed = mod.packed()
    packed = packed._replace(qweight=packed.qweight.cpu(), scales=packed.scales.cpu())
    ref = w4a8_linear_ref(x, packed, mod.bias.cpu(), compute_dtype=torch.float32)
    # the same numerics up to summation order and bf16 output rounding (bounds: tests/kernels/test_w4a8_triton.py)
    assert cos_sim(y.cpu().float(), ref.float()) > 0.9999
