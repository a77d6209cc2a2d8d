"""The reference engine: exactness where nothing is quantized, paper behaviours where it is."""

import pytest
import torch

import quantpatch as qp
from quantpatch.config import AttentionConfig
from quantpatch.kernels.attention.attention_ref import attention_exact
from quantpatch.kernels.attention.quant_attention_ref import block_mean, quant_attention_ref
from quantpatch.synthetic import attention_inputs
from tests.tolerances import FLOAT32_ENGINE_RTOL, OUTLIER_COS_FLOOR, RANDN_COS_FLOOR

# Every quantization step off: the engine must then be plain (blocked) attention.
UNQUANTIZED = AttentionConfig(numerics="fireq", qk_format="none", pv_format="none", two_level_accum=False)
QUANT_MODES = ["sage2-8b", "sage2-4b", "int8-flash", "turbo", "fireq"]


@pytest.mark.parametrize("nq, nk", [(1, 1), (113, 113), (17, 203), (64, 239), (1, 300)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_unquantized_engine_is_exact_attention(nq, nk, is_causal):
    q, k, v = attention_inputs("randn", heads=4, kv_heads=2, seq_q=nq, seq_k=nk, head_dim=64, seed=nq + nk)
    o, lse = quant_attention_ref(
        q, k, v, UNQUANTIZED, is_causal=is_causal, return_lse=True, compute_dtype=torch.float64
    )
    ref, ref_lse = attention_exact(q, k, v, is_causal=is_causal, return_lse=True)
    torch.testing.assert_close(o, ref, rtol=FLOAT32_ENGINE_RTOL, atol=FLOAT32_ENGINE_RTOL)
    torch.testing.assert_close(lse, ref_lse, rtol=FLOAT32_ENGINE_RTOL, atol=FLOAT32_ENGINE_RTOL)


def test_causal_rows_without_keys_give_zeros_and_minus_inf_lse():
    q, k, v = attention_inputs("randn", heads=2, seq_q=8, seq_k=8, head_dim=32)
    mask = torch.ones(8, 8, dtype=torch.bool)
    mask[3] = False  # row 3 sees nothing
    o, lse = quant_attention_ref(q, k, v, qp.get_mode("sage2-8b").attention, attn_mask=mask, return_lse=True)
    assert torch.all(o[:, :, 3] == 0) and torch.all(lse[:, :, 3] == float("-inf"))
    assert torch.isfinite(o).all()


def test_attn_mask_matches_exact_attention():
    q, k, v = attention_inputs("randn", heads=2, seq_q=40, seq_k=70, head_dim=32, seed=3)
    keep = torch.rand(1, 1, 40, 70, generator=torch.Generator().manual_seed(1)) > 0.3
    additive = torch.zeros(1, 2, 40, 70).masked_fill(~keep, float("-inf"))
    for mask in (keep, additive):
        o = quant_attention_ref(q, k, v, UNQUANTIZED, attn_mask=mask, compute_dtype=torch.float64)
        torch.testing.assert_close(o, attention_exact(q, k, v, attn_mask=keep), rtol=1e-5, atol=1e-5)


def test_gqa_equals_repeated_heads():
    q, k, v = attention_inputs("randn", heads=8, kv_heads=2, seq_q=100, head_dim=64, seed=5)
    cfg = qp.get_mode("sage2-8b").attention.replace(smooth_k=False)  # K mean is per KV head either way
    grouped = quant_attention_ref(q, k, v, cfg)
    repeated = quant_attention_ref(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), cfg)
    torch.testing.assert_close(grouped, repeated, rtol=0, atol=0)


@pytest.mark.parametrize("mode", QUANT_MODES)
def test_mode_accuracy_on_randn(mode):
    q, k, v = attention_inputs("randn", heads=4, seq_q=1024, head_dim=128)
    o = quant_attention_ref(q, k, v, qp.get_mode(mode).attention)
    assert qp.cos_sim(o, attention_exact(q, k, v)) >= RANDN_COS_FLOOR[mode]


@pytest.mark.parametrize("mode", QUANT_MODES)
def test_mode_accuracy_on_channel_outliers(mode):
    q, k, v = attention_inputs("outliers", heads=4, seq_q=1024, head_dim=128)
    o = quant_attention_ref(q, k, v, qp.get_mode(mode).attention)
    assert qp.cos_sim(o, attention_exact(q, k, v)) >= OUTLIER_COS_FLOOR[mode]


def test_smoothing_qk_beats_no_smoothing_for_int4():
    # SageAttention2 Table 4: smooth Q+K > smooth Q > smooth K > none. Measured CosSim
    # 0.9974 / 0.9940 / 0.9894 / 0.9846 (rel-L1 0.055 / 0.083 / 0.114 / 0.142).
    q, k, v = attention_inputs("outliers", heads=4, seq_q=1024, head_dim=128)
    ref = attention_exact(q, k, v)
    cfg = qp.get_mode("sage2-4b").attention
    err = {
        name: qp.rel_l1(quant_attention_ref(q, k, v, c), ref)
        for name, c in {
            "none": cfg.replace(smooth_q=False, smooth_k=False),
            "k": cfg.replace(smooth_q=False),
            "q": cfg.replace(smooth_k=False),
            "qk": cfg,
        }.items()
    }
    assert err["qk"] < err["q"] < err["k"] < err["none"]
    assert err["none"] - err["qk"] > 0.05  # smoothing removes over a third of the INT4 error


def test_smoothing_k_is_exact_in_float():
    # Subtracting the K mean adds the same q·k̄ to a whole score row: softmax-invariant.
    q, k, v = attention_inputs("outliers", heads=2, seq_q=100, head_dim=64)
    on = quant_attention_ref(q, k, v, UNQUANTIZED.replace(smooth_k=True, smooth_q=True), compute_dtype=torch.float64)
    off = quant_attention_ref(q, k, v, UNQUANTIZED, compute_dtype=torch.float64)
    torch.testing.assert_close(on, off, rtol=1e-9, atol=1e-9)


def test_block_mean_handles_the_tail_block():
    x = torch.arange(5.0).reshape(5, 1)
    assert block_mean(x, 2).flatten().tolist() == [0.5, 0.5, 2.5, 2.5, 4.0]


def test_int8_flash_hand_example():
    # Scores 0 and -1: P̃ = [1, e^-1] → P = round(127·P̃) = [127, 47]; ℓ accumulates the
    # quantized P, so O = (127·v0 + 47·v1) / 174 (not softmax's 0.7311 / 0.2689).
    q = torch.tensor([1.0, 0, 0, 0]).reshape(1, 1, 1, 4)
    k = torch.tensor([[0.0, 0, 0, 0], [1.0, 0, 0, 0]]).reshape(1, 1, 2, 4)
    v = torch.tensor([[1.0, 0, 0, 0], [0.0, 1, 0, 0]]).reshape(1, 1, 2, 4)
    o = quant_attention_ref(q, k, v, qp.get_mode("int8-flash").attention, scale=-1.0, compute_dtype=torch.float64)
    torch.testing.assert_close(o.flatten()[:2], torch.tensor([127 / 174, 47 / 174], dtype=torch.float64))


def test_two_level_accumulation_beats_a_single_fp22_accumulator():
    # SageAttention2 §3.4: the FP8 MMA accumulator is FP22; accumulating each key block in
    # its own register and then in FP32 confines the error; smooth V shrinks it further.
    # Flat softmax over a biased V (CogVideoX-like). Measured rel-L1: two-level FP22 7.5e-4,
    # single FP22 1.79e-3, single FP22 + smooth V 8.1e-5.
    g = torch.Generator().manual_seed(0)
    q = 0.3 * torch.randn(1, 1, 128, 64, generator=g)
    k = 0.3 * torch.randn(1, 1, 2048, 64, generator=g)
    v = torch.randn(1, 1, 2048, 64, generator=g) + 8
    ref = attention_exact(q, k, v)
    cfg = qp.get_mode("sage2-8b").attention.replace(emulate_fp22=True, smooth_v=False)
    two_level = qp.rel_l1(quant_attention_ref(q, k, v, cfg), ref)
    single = qp.rel_l1(quant_attention_ref(q, k, v, cfg.replace(two_level_accum=False)), ref)
    smooth_v = qp.rel_l1(quant_attention_ref(q, k, v, cfg.replace(two_level_accum=False, smooth_v=True)), ref)
    assert two_level * 2 < single and smooth_v < two_level / 4


def test_sas_turbo_prefill_drops_scores_below_threshold():
    # One dominant key: the others sit 7 below it, beyond n_r = -6, so SAS gives them 0.
    q = torch.ones(1, 1, 1, 32)
    k = torch.zeros(1, 1, 3, 32)
    k[0, 0, 0] = 1.0
    v = torch.eye(3, 32).reshape(1, 1, 3, 32)
    o = quant_attention_ref(q, k, v, qp.get_mode("turbo").attention, scale=7 / 32, compute_dtype=torch.float64)
    assert o[0, 0, 0, 1] == 0 and o[0, 0, 0, 2] == 0 and o[0, 0, 0, 0] > 0.99


@pytest.mark.parametrize("mode, options, bound", [("sage2-8b", {"smooth_q": True}, 0.5), ("sage2-8b", {}, 0.7),
                                                  ("sage2-4b", {}, 6.0)])
def test_lse_is_that_of_the_unsmoothed_scores(mode, options, bound):
    # Smooth K removes q_i·k̄ from each score row; the returned LSE must include it again. Here
    # that term reaches 55 (mean 19); with it restored the max LSE error is 0.29 (INT8 Q/K with smooth Q),
    # 0.63 (INT8 Q/K without: the biased Q channels cost INT8 levels) and 4.6 (INT4) on scores of magnitude up to 104.
    q, k, v = attention_inputs("outliers", heads=4, kv_heads=2, seq_q=100, seq_k=150, head_dim=64, seed=4)
    _, lse = quant_attention_ref(q, k, v, qp.get_mode(mode, **options).attention, is_causal=True, return_lse=True)
    _, ref = attention_exact(q, k, v, is_causal=True, return_lse=True)
    assert (lse - ref).abs().max() < bound
