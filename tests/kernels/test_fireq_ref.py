"""FireQ attention-side reference: INT4 per-token K/V with FP8 scales, FP8 Q, decode attention, RPN/CRS."""

from __future__ import annotations

import math

import pytest
import torch

from quantpatch.kernels.attention.attention_ref import attention_exact, expand_kv
from quantpatch.kernels.attention.quant_attention_ref import quantize_qk
from quantpatch.kernels.fireq_kv.fireq_ref import (
    PackedInt4,
    apply_crs,
    channel_absmax,
    crs_factors,
    crs_scale_key,
    dequantize_kv_cache,
    dequantize_kv_int4,
    fireq_attention_config,
    fireq_decode_attention_ref,
    fireq_key_factors,
    pack_int4_signed,
    quantize_kv_cache,
    quantize_kv_int4,
    quantize_query_fp8,
    rope_partner,
    rpn_factors,
    select_crs_pairs,
    unpack_int4_signed,
)
from quantpatch.kernels.quant_ref import cast_fp8
from quantpatch.metrics import cos_sim, rel_l1
from quantpatch.modes import get_mode
from tests.tolerances import FIREQ_DECODE_RANDN_COS_FLOOR, FIREQ_DECODE_RANDN_REL_L1_CEIL

E4M3_MIN_NORMAL = 2.0**-6


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x, base=10000.0):
    """Llama rotate_half RoPE at positions 0..N-1 (pairs (i, i + D/2))."""
    d, n = x.shape[-1], x.shape[-2]
    inv_freq = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq[None]
    ang = torch.cat((ang, ang), dim=-1)
    return (x.to(torch.float64) * ang.cos() + _rotate_half(x.to(torch.float64)) * ang.sin()).to(x.dtype)


# --------------------------------------------------------------------------- INT4 K/V quantizer


def test_quantize_kv_int4_hand_example():
    sub = 2.0**-9  # smallest e4m3 subnormal
    x = torch.tensor(
        [
            # absmax 7.7: σ = 7.7/7 = 1.1 → e4m3 1.125; x/σ = ±6.84, 1.5, 0.5, 2.5, −3.5 (half-even)
            [7.7, -7.7, 1.6875, 0.5625, 2.8125, -3.9375, 0.0, 0.0],
            # all zeros: σ = 1 (no 0/0), x̂ = 0
            [0.0] * 8,
            # absmax 0.003: σ = 4.3e-4 < 2^-10 rounds to e4m3 0 (App. B Lemma B.1): x̂ = 0, σ = 0
            [0.003, -0.001, 0.002, 0.0, 0.0, 0.0, 0.0, 0.0],
            # subnormal σ = 1.45·2^-9 → 2^-9: x/σ = ∓10.15 clamps to −8 / 7 (eq. 1 range [−8, 7])
            [-10.15 * sub, 10.15 * sub, 3 * sub, -2.5 * sub, 0.0, 0.0, 0.0, 0.0],
        ]
    )
    q, scale = quantize_kv_int4(x)
    expected_q = torch.tensor(
        [
            [7, -7, 2, 0, 2, -4, 0, 0],
            [0] * 8,
            [0] * 8,
            [-8, 7, 3, -2, 0, 0, 0, 0],
        ],
        dtype=torch.float32,
    )
    torch.testing.assert_close(q, expected_q, rtol=0, atol=0)
    torch.testing.assert_close(scale, torch.tensor([[1.125], [1.0], [0.0], [sub]]), rtol=0, atol=0)
    # FireQ's LUT operand e4m3(x̂σ): 7 × 1.125 = 7.875 → 8 (spacing 0.5 in [4, 8)); −4 × 1.125 = −4.5 exact.
    fp8 = dequantize_kv_int4(q, scale, "fp8")
    torch.testing.assert_close(fp8[0, :6], torch.tensor([8.0, -8.0, 2.25, 0.0, 2.25, -4.5]), rtol=0, atol=0)
    exact = dequantize_kv_int4(q, scale, "exact")
    assert exact[0, 0].item() == 7.875
    assert torch.isfinite(fp8).all() and (fp8[1:3] == 0).all()


def test_quantize_kv_int4_properties():
    # Rows spanning the e4m3 scale range: underflow, subnormal, normal and saturating scales.
    mags = torch.logspace(-4, 4, 64).unsqueeze(-1)
    x = _randn(3, 64, 128, seed=0) * mags
    q, scale = quantize_kv_int4(x)
    assert torch.equal(q, q.round()) and q.min() >= -8 and q.max() <= 7
    assert torch.equal(cast_fp8(scale, "fp8_e4m3"), scale)
    # Normal, unsaturated σ: rounding σ to e4m3 moves absmax/σ by ≤ 1/16, never past 7.4375, so
    # x̂ stays in [−7, 7] and the error is at most σ/2; −8 and clipping need subnormal or saturated σ.
    ok = ((scale >= E4M3_MIN_NORMAL) & (scale < 448)).expand_as(q)
    assert q[ok].abs().max() == 7
    assert (q[(scale == 448).expand_as(q)].abs() == 8).any()
    err = (q * scale - x).abs()
    assert (err[ok] <= (scale.expand_as(q)[ok] / 2) * (1 + 1e-6)).all()
    assert torch.isfinite(dequantize_kv_int4(q, scale, "fp8")).all()


def test_pack_unpack_round_trip():
    q = torch.randint(-8, 8, (2, 3, 113, 128), generator=torch.Generator().manual_seed(0))
    packed = pack_int4_signed(q)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 3, 113, 64)
    assert torch.equal(unpack_int4_signed(packed).to(torch.int64), q)
    every = torch.arange(-8, 8, dtype=torch.float32)  # each nibble value, float input
    assert torch.equal(unpack_int4_signed(pack_int4_signed(every), torch.float32), every)
    # byte layout: channel 2c in the low nibble, 2c + 1 in the high nibble, two's complement
    assert pack_int4_signed(torch.tensor([1, -1, -8, 7])).tolist() == [0xF1, 0x78]


def test_pack_int4_rejects_bad_input():
    with pytest.raises(ValueError, match="even"):
        pack_int4_signed(torch.zeros(3))
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        pack_int4_signed(torch.tensor([8, 0]))
    with pytest.raises(ValueError, match="integer"):
        pack_int4_signed(torch.tensor([0.5, 0.0]))


def test_kv_cache_round_trip():
    x = _randn(1, 2, 239, 64, seed=1)
    cache = quantize_kv_cache(x)
    q, scale = quantize_kv_int4(x)
    assert isinstance(cache, PackedInt4) and cache.data.shape == (1, 2, 239, 32)
    torch.testing.assert_close(cache.scale, scale, rtol=0, atol=0)
    torch.testing.assert_close(dequantize_kv_cache(cache, "exact"), q * scale, rtol=0, atol=0)
    torch.testing.assert_close(dequantize_kv_cache(cache), cast_fp8(q * scale, "fp8_e4m3"), rtol=0, atol=0)
    with pytest.raises(ValueError, match="operand"):
        dequantize_kv_cache(cache, "int8")


# --------------------------------------------------------------------------- FP8 Q quantizer


def test_quantize_query_fp8_hand_example():
    q = torch.tensor([[1.0, -0.5, 3.0, 0.1], [0.0, 0.0, 0.0, 0.0]])
    q_hat, beta = quantize_query_fp8(q)
    # β = bf16(3/448 = 0.0066964) = 219·2^-15 = 0.006683349609375; q/β = 149.6, −74.8, 448.9, 14.96
    # → e4m3: 144 (spacing 16), −72 (spacing 8), 448 (saturated), 15.
    torch.testing.assert_close(beta, torch.tensor([[0.006683349609375], [1.0]]), rtol=0, atol=0)
    torch.testing.assert_close(q_hat, torch.tensor([[144.0, -72.0, 448.0, 15.0], [0.0] * 4]), rtol=0, atol=0)


def test_engine_requantizes_fp8_query_exactly():
    """Passing β q̂ to the engine gives back exactly (q̂, β): the decode path relies on it."""
    cfg = get_mode("fireq").attention
    q = _randn(2, 4, 37, 128, seed=2) * torch.logspace(-3, 3, 37).unsqueeze(-1)
    q[0, 0, 5] = 0.0
    for dtype in (torch.float32, torch.float64):
        q_hat, beta = quantize_query_fp8(q, compute_dtype=dtype)
        assert (q_hat.abs().amax(-1)[beta.squeeze(-1) != 1] == 448).all()
        q_hat2, beta2 = quantize_qk(q_hat * beta, cfg, "q")
        torch.testing.assert_close(q_hat2, q_hat, rtol=0, atol=0)
        nonzero = q_hat.abs().amax(-1, keepdim=True) > 0
        torch.testing.assert_close(beta2[nonzero], beta[nonzero], rtol=0, atol=0)


# --------------------------------------------------------------------------- decode attention


@pytest.mark.parametrize("nq,nk", [(1, 1024), (4, 1024), (4, 239)])
@pytest.mark.parametrize("h,hkv", [(8, 8), (8, 2)])
def test_decode_attention_randn_floor(nq, nk, h, hkv):
    q, k, v = _randn(2, h, nq, 128, seed=3), _randn(2, hkv, nk, 128, seed=4), _randn(2, hkv, nk, 128, seed=5)
    ref = attention_exact(q, k, v, is_causal=True)
    o = fireq_decode_attention_ref(q, quantize_kv_cache(k), quantize_kv_cache(v), is_causal=True)
    assert o.dtype == torch.float32 and o.shape == ref.shape
    assert cos_sim(o, ref) >= FIREQ_DECODE_RANDN_COS_FLOOR
    assert rel_l1(o, ref) <= FIREQ_DECODE_RANDN_REL_L1_CEIL


def test_decode_attention_matches_direct_formula():
    """One key block (block_k ≥ Nk): the engine run equals the formula written out by hand."""
    cfg = get_mode("fireq").attention.replace(block_k=256)
    nq, nk, d = 4, 203, 128
    q, k, v = _randn(1, 4, nq, d, seed=6), _randn(1, 2, nk, d, seed=7), _randn(1, 2, nk, d, seed=8)
    o = fireq_decode_attention_ref(q, k, v, cfg=cfg, is_causal=True)

    q_hat, beta = quantize_query_fp8(q)
    k_op = expand_kv(dequantize_kv_int4(*quantize_kv_int4(k)), 4)
    v_op = expand_kv(dequantize_kv_int4(*quantize_kv_int4(v)), 4)
    s = torch.matmul(q_hat, k_op.transpose(-1, -2)) * beta * (1.0 / math.sqrt(d))
    allowed = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + (nk - nq)  # bottom-right causal
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.exp(s - s.amax(-1, keepdim=True))
    p_hat = cast_fp8(p / torch.tensor(1.0 / 448), "fp8_e4m3")
    expected = torch.matmul(p_hat, v_op) * (1.0 / 448) / p.sum(-1, keepdim=True)
    torch.testing.assert_close(o, expected)


def test_decode_attention_gqa_equals_expanded_heads():
    q, k, v = _randn(1, 8, 4, 128, seed=9), _randn(1, 2, 300, 128, seed=10), _randn(1, 2, 300, 128, seed=11)
    o = fireq_decode_attention_ref(q, k, v, is_causal=True)
    o_mha = fireq_decode_attention_ref(q, expand_kv(k, 8), expand_kv(v, 8), is_causal=True)
    torch.testing.assert_close(o, o_mha, rtol=0, atol=0)


def test_decode_attention_kv_operand_and_options():
    q, k, v = _randn(1, 4, 1, 128, seed=12), _randn(1, 4, 1024, 128, seed=13), _randn(1, 4, 1024, 128, seed=14)
    ref = attention_exact(q, k, v)
    o_fp8 = fireq_decode_attention_ref(q, k, v)
    o_exact = fireq_decode_attention_ref(q, k, v, kv_operand="exact")
    # the LUT's second rounding (e4m3(x̂σ)) costs little next to INT4 itself
    assert abs(cos_sim(o_fp8, ref) - cos_sim(o_exact, ref)) < 2e-3
    o64, lse = fireq_decode_attention_ref(q, k, v, return_lse=True, compute_dtype=torch.float64)
    assert o64.dtype == torch.float64 and lse.shape == (1, 4, 1)
    torch.testing.assert_close(o64.float(), o_fp8, rtol=1e-3, atol=1e-4)
    with pytest.raises(ValueError, match="kv_operand"):
        fireq_decode_attention_ref(q, k, v, kv_operand="int4")
    with pytest.raises(ValueError, match="per-token FP8"):
        fireq_decode_attention_ref(q, k, v, cfg=get_mode("sage2-8b").attention)
    with pytest.raises(TypeError, match="PackedInt4"):
        fireq_decode_attention_ref(q, (k, k), v)
    assert fireq_attention_config() == get_mode("fireq").attention


def test_decode_attention_underflowed_tokens_give_no_nan():
    q, k, v = _randn(1, 2, 2, 64, seed=15), _randn(1, 2, 128, 64, seed=16), _randn(1, 2, 128, 64, seed=17)
    k[..., :10, :] *= 1e-4  # σ underflows to 0: these keys score 0, their values read as 0
    v[..., 10:20, :] = 0.0
    v[..., 20:30, :] *= 1e-4
    o = fireq_decode_attention_ref(q, k, v, is_causal=True)
    assert torch.isfinite(o).all()
    assert cos_sim(o, attention_exact(q, k, v, is_causal=True)) > 0.95


# --------------------------------------------------------------------------- RPN / CRS


def _keys_with_outlier_pairs(seed, outlier_channels=(3, 20, 41, 100)):
    """Post-RoPE keys (1, 2, 1024, 128) whose pre-RoPE channels ``outlier_channels`` are biased to ~12."""
    k = _randn(1, 2, 1024, 128, seed=seed)
    k[..., list(outlier_channels)] = k[..., list(outlier_channels)] * 2 + 12
    return _rope(k)


def test_select_crs_pairs_finds_outliers():
    k = _keys_with_outlier_pairs(seed=18)
    pairs = select_crs_pairs(channel_absmax(k), 8)
    assert pairs.shape == (2, 8)
    for head in range(2):  # channel 100 is pair 36's partner (100 = 36 + 64)
        assert set(pairs[head, :4].tolist()) == {3, 20, 36, 41}
    assert rope_partner(8).tolist() == [4, 5, 6, 7, 0, 1, 2, 3]
    with pytest.raises(ValueError, match="n_pairs"):
        select_crs_pairs(channel_absmax(k), 65)


@pytest.mark.parametrize("factors_from", ["crs", "fireq"])
def test_crs_leaves_float_attention_unchanged(factors_from):
    k = _keys_with_outlier_pairs(seed=19).double()
    q = _rope(_randn(1, 8, 1024, 128, seed=20).double())[..., -4:, :]
    v = _randn(1, 2, 1024, 128, seed=21).double()
    absmax = channel_absmax(k)
    if factors_from == "crs":
        t = crs_factors(absmax, select_crs_pairs(absmax, 8), beta=8.0)
    else:
        t, _ = fireq_key_factors(k)
    q2, k2 = apply_crs(q, k, t)
    assert (k2.abs().amax(dim=(0, 2)) < absmax).any()
    torch.testing.assert_close(q2 @ expand_kv(k2, 8).transpose(-1, -2), q @ expand_kv(k, 8).transpose(-1, -2))
    ref = attention_exact(q, k, v, is_causal=True)
    torch.testing.assert_close(attention_exact(q2, k2, v, is_causal=True), ref, rtol=1e-12, atol=1e-12)


def test_crs_reduces_int4_key_error():
    k = _keys_with_outlier_pairs(seed=22)
    q = _rope(_randn(1, 8, 1024, 128, seed=23))[..., -4:, :]
    v = _randn(1, 2, 1024, 128, seed=24)
    absmax = channel_absmax(k)
    # Without RPN the regular channels keep their own scale, so β maps the outliers onto it.
    t = crs_factors(absmax, select_crs_pairs(absmax, 8), beta=float(1 / absmax.median()))

    def key_error(factors):
        k_hat = dequantize_kv_int4(*quantize_kv_int4(crs_scale_key(k, factors)), "fp8") * factors.unsqueeze(-2)
        return float((k_hat - k).norm() / k.norm())

    # Measured (seeds 22/30/40): relative K error 0.226-0.228 → 0.083 (FireQ α = β = 8: 0.084);
    # attention CosSim 0.876-0.905 → 0.971-0.975 (α = β = 8: 0.972-0.974).
    err_plain, err_crs = key_error(torch.ones_like(t)), key_error(t)
    assert err_crs < 0.5 * err_plain
    ref = attention_exact(q, k, v, is_causal=True)
    cos_plain = cos_sim(fireq_decode_attention_ref(q, k, v, is_causal=True), ref)
    cos_crs = cos_sim(fireq_decode_attention_ref(*apply_crs(q, k, t), v, is_causal=True), ref)
    t_fireq, _ = fireq_key_factors(k)
    cos_fireq = cos_sim(fireq_decode_attention_ref(*apply_crs(q, k, t_fireq), v, is_causal=True), ref)
    assert cos_plain < 0.92 and cos_crs > 0.965 and cos_fireq > 0.965


def test_rpn_bounds_pair_norms_and_commutes_with_rope():
    k_pre = _randn(1, 2, 512, 64, seed=25) * torch.linspace(0.1, 10, 64)
    s = rpn_factors(k_pre, alpha=8.0)
    torch.testing.assert_close(s[:, :32], s[:, 32:], rtol=0, atol=0)  # shared across each RoPE pair
    kn = k_pre / s.unsqueeze(-2)
    pair_norm = torch.sqrt(kn[..., :32] ** 2 + kn[..., 32:] ** 2)
    assert pair_norm.max() <= 1 / 8 * (1 + 1e-6)  # Thm. 3.1
    torch.testing.assert_close(rpn_factors(_rope(k_pre)), s, rtol=1e-5, atol=0)
    torch.testing.assert_close(_rope(k_pre) / s.unsqueeze(-2), _rope(kn), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="Hkv, D"):
        apply_crs(torch.zeros(1, 2, 1, 64), k_pre, s[:, :32])
