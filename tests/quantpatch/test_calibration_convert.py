"""FireQ calibration (hooks, statistics) and convert (CAS / RPN / CRS merging, linear swap) on tiny models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from quantpatch.calibration import CalibrationStats, calibrate, calibration_key, decoder_layers
from quantpatch.conversion import FireQOptions, convert
from quantpatch.crs import CRS_FACTORS, CRS_PAIRS, apply_online_crs, crs_buffers
from quantpatch.fallback import UnsupportedError
from quantpatch.metrics import cos_sim
from quantpatch.modes import get_mode
from quantpatch.w4a8_linear import W4A8Linear
from tests.patches.conftest import tiny_model

ROOT = Path(__file__).resolve().parents[2]


def _texts(n=3, length=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (length + i,), generator=g) for i in range(n)]


def _inputs(seed=1):
    return torch.randint(0, 128, (2, 19), generator=torch.Generator().manual_seed(seed))


def _capture_keys(model, ids):
    """Pre-RoPE keys (k_proj outputs) and post-RoPE keys (what attention receives), per attention module."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    pre, post = {}, {}
    sdpa = AttentionInterface._global_mapping["sdpa"]

    def attn(module, q, k, v, mask, **kw):
        post[id(module)] = k.detach()
        return sdpa(module, q, k, v, mask, **kw)

    hooks = [m.self_attn.k_proj.register_forward_hook(
        lambda mod, a, out, m=m: pre.__setitem__(id(m.self_attn), out.detach())) for m in model.model.layers]
    original = model.config._attn_implementation
    AttentionInterface._global_mapping["qp_test_capture"] = attn
    masks = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    masks["qp_test_capture"] = masks["sdpa"]
    try:
        model.set_attn_implementation("qp_test_capture")
        with torch.no_grad():
            model(ids, use_cache=False)
    finally:
        model.set_attn_implementation(original)
        del AttentionInterface._global_mapping["qp_test_capture"]
        del ALL_MASK_ATTENTION_FUNCTIONS._global_mapping["qp_test_capture"]
        for h in hooks:
            h.remove()
    return pre, post


def _hook_count(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


# --------------------------------------------------------------------------- calibration


def test_calibrate_collects_fireq_statistics_and_removes_hooks():
    model = tiny_model("llama").double()
    before = _hook_count(model)
    texts = _texts()
    stats = calibrate(model, texts, "fireq", samples=2, seq_len=20, progress=False)
    assert _hook_count(model) == before
    assert stats.meta["samples"] == 2 and stats.meta["tokens"] == 40 and stats.meta["mode"] == "fireq"
    attn = "model.layers.1.self_attn"
    assert stats.get(attn, "k_pair_norm_max").shape == (1, 16)
    assert stats.get(attn, "k_absmax").shape == (1, 32)
    assert stats.get("model.layers.0.mlp.down_proj", "act_absmean").shape == (128,)
    # The statistics are what the model computes: pre-RoPE pair norms, post-RoPE channel absmax.
    ids = torch.cat([t[:20] for t in texts[:2]]).reshape(2, 20)
    pre, post = _capture_keys(model, ids)
    module = model.model.layers[1].self_attn
    k_pre = pre[id(module)].reshape(2, 20, 1, 32).transpose(1, 2)
    pair = torch.sqrt(k_pre[..., :16] ** 2 + k_pre[..., 16:] ** 2).amax(dim=(0, 2))
    torch.testing.assert_close(stats.get(attn, "k_pair_norm_max").double(), pair, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(stats.get(attn, "k_absmax").double(), post[id(module)].abs().amax(dim=(0, 2)),
                               rtol=1e-6, atol=1e-7)


def test_hooks_are_removed_when_a_forward_raises():
    model = tiny_model("llama")
    before = _hook_count(model)
    boom = model.model.layers[1].mlp.register_forward_pre_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("x")))
    with pytest.raises(RuntimeError):
        calibrate(model, _texts(), "fireq", progress=False)
    boom.remove()
    assert _hook_count(model) == before


def test_stats_json_round_trip_and_dispatch():
    stats = calibrate(tiny_model("llama"), _texts(1), "fireq", progress=False)
    again = CalibrationStats.from_dict(json.loads(json.dumps(stats.to_dict())))
    assert again.meta == stats.meta and all(torch.equal(again.tensors[k], v) for k, v in stats.tensors.items())
    assert calibration_key(get_mode("fireq")) == "fireq" and calibration_key(get_mode("turbo")) == "turbo"
    with pytest.raises(ValueError, match="nothing|no KV-cache"):
        calibrate(tiny_model("llama"), _texts(1), "sage2-8b", progress=False)
    with pytest.raises(ValueError, match="tokenizer"):
        calibrate(tiny_model("llama"), ["some text"], "fireq", progress=False)


def test_unsupported_family_is_refused():
    with pytest.raises(UnsupportedError, match="model types"):
        decoder_layers(tiny_model("gpt2"))


# --------------------------------------------------------------------------- convert: float equivalence


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v biases follow the row scalings
def test_merged_unquantized_model_computes_the_same_function(family, eval_attention):
    model = tiny_model(family).double()
    if family == "qwen2":
        with torch.no_grad():
            for layer in model.model.layers:
                for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    lin.bias.normal_(0, 0.1)
    ids = _inputs()
    with torch.no_grad():
        ref = model(ids).logits
    stats = calibrate(model, _texts(), "fireq", progress=False)
    state = convert(model, stats, "fireq", quantize=False, progress=False)
    assert not state.linears and len(state.attention) == 2
    assert isinstance(model.model.layers[0].mlp.down_proj, torch.nn.Linear)
    with torch.no_grad():
        merged = model(ids).logits  # CAS + RPN merged; CRS not applied (it is online)
        with eval_attention(model, kv_int4=False, fp8=False):  # float attention with online CRS
            crs = model(ids).logits
    torch.testing.assert_close(merged, ref, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(crs, ref, rtol=1e-9, atol=1e-9)
    # ... and the weights did change
    assert not torch.equal(model.model.layers[0].input_layernorm.weight, torch.ones(64, dtype=torch.float64))


def test_rpn_bounds_every_regular_pair_and_crs_every_outlier_channel():
    model = tiny_model("llama").double()
    texts = _texts()
    stats = calibrate(model, texts, "fireq", samples=2, seq_len=20, progress=False)
    alpha, beta = 2.0, 4.0
    convert(model, stats, "fireq", quantize=False, options=FireQOptions(rpn_alpha=alpha, crs_beta=beta),
            progress=False)
    ids = torch.cat([t[:20] for t in texts[:2]]).reshape(2, 20)  # the calibration tokens
    pre, post = _capture_keys(model, ids)
    for layer in model.model.layers:
        attn = layer.self_attn
        factors, pairs = crs_buffers(attn)
        assert factors.shape == (1, 32) and pairs.shape == (1, 8) and getattr(attn, CRS_PAIRS) is pairs
        k = pre[id(attn)].reshape(2, 20, 1, 32).transpose(1, 2)
        norms = torch.sqrt(k[..., :16] ** 2 + k[..., 16:] ** 2).amax(dim=(0, 2))[0]  # (16,)
        regular = torch.ones(16, dtype=torch.bool)
        regular[pairs[0]] = False
        assert (norms[regular] <= (1 + 1e-6) / alpha).all()  # FireQ Thm. 3.1 (statistics are float32)
        assert torch.allclose(norms[regular].max(), torch.tensor(1 / alpha, dtype=torch.float64))
        channels = torch.cat((pairs[0], pairs[0] + 16))
        _, k_crs = apply_online_crs(torch.zeros(1, 2, 1, 32, dtype=torch.float64), post[id(attn)], factors)
        assert (k_crs.abs().amax(dim=(0, 2))[0, channels] <= (1 + 1e-6) / beta).all()
        others = torch.ones(32, dtype=torch.bool)
        others[channels] = False
        assert (factors[0, others] == 1).all()


# --------------------------------------------------------------------------- convert: quantized


def test_convert_swaps_decoder_linears_only_and_stays_accurate():
    model = tiny_model("llama")
    ids = _inputs()
    with torch.no_grad():
        ref = model(ids).logits
    stats = calibrate(model, _texts(), "fireq", progress=False)
    state = convert(model, stats, "fireq", progress=False)
    assert len(state.linears) == 14 and all(isinstance(model.get_submodule(n), W4A8Linear) for n in state.linears)
    assert type(model.lm_head) is torch.nn.Linear and type(model.model.embed_tokens) is torch.nn.Embedding
    assert all(v["pts_exp"] > 0 and v["zero_scale_groups"] == 0 for v in state.linears.values())
    assert hasattr(model.model.layers[0].self_attn, CRS_FACTORS)
    with torch.no_grad():
        out = model(ids).logits
    # Measured 0.9915 (random-init 2-layer model, INT4 weights with K = 64/128): floor with margin.
    assert cos_sim(out, ref) > 0.98
    assert "W4A8 linears" in state.report()
    with pytest.raises(ValueError, match="already converted"):
        convert(model, stats, "fireq", progress=False)


def test_convert_include_exclude_and_linear_only_mode(caplog):
    model = tiny_model("llama")
    linear_only = get_mode("fireq", **{"kv_cache.kind": "none"})
    state = convert(model, None, linear_only, exclude="mlp", progress=False)  # a string is one substring
    assert sorted(n.rsplit(".", 1)[1] for n in state.linears) == sorted(["q_proj", "k_proj", "v_proj", "o_proj"] * 2)
    with caplog.at_level("WARNING", logger="quantpatch"):  # a filter that selects nothing says so
        assert not convert(tiny_model("llama"), None, linear_only, include=["mpl"], progress=False).linears
    assert any("select none of the decoder linears" in r.getMessage() for r in caplog.records)
    with pytest.raises(TypeError, match="exclude takes name substrings"):
        convert(tiny_model("llama"), None, linear_only, exclude=[3], progress=False)
    assert not state.attention and not hasattr(model.model.layers[0].self_attn, CRS_FACTORS)
    with pytest.raises(ValueError, match="calibration statistics"):
        convert(tiny_model("llama"), None, "fireq", progress=False)


def test_options_validate():
    with pytest.raises(ValueError, match="cas_sites"):
        FireQOptions(cas_sites=("qkv", "nope"))
    with pytest.raises(ValueError, match="unknown FireQOptions"):
        FireQOptions.from_dict({"alpha": 1})
    assert FireQOptions.from_dict(FireQOptions().to_dict()) == FireQOptions()


@pytest.mark.parametrize("which", ["k", "v"])
def test_ablation_int4_only_attention_quantizes_one_operand_after_crs(which):
    from quantpatch.cli_commands import load_eval_script
    from quantpatch.kernels.attention.attention_ref import attention_exact
    from quantpatch.kernels.fireq_kv.fireq_ref import dequantize_kv_int4, quantize_kv_int4

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, 37, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    t = 1 + 3 * torch.rand(2, 16, generator=g, dtype=torch.float64)
    out = load_eval_script("fireq_ablation.py").int4_only_attention(
        q, k, v, t, which, is_causal=True, scale=None, attn_mask=None)
    qt, kt = q * t.repeat_interleave(2, 0)[None, :, None], k / t[None, :, None]  # CRS: q·t, k/t (GQA 2)
    fake = dequantize_kv_int4(*quantize_kv_int4(kt if which == "k" else v), "fp8")
    kq, vq = (fake, v) if which == "k" else (kt, fake)
    want = attention_exact(qt, kq.repeat_interleave(2, 1), vq.repeat_interleave(2, 1), is_causal=True)
    torch.testing.assert_close(out, want.to(out.dtype), rtol=1e-6, atol=1e-6)
    exact = attention_exact(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    assert (out - exact).abs().max() > 1e-3  # the INT4 operand is really in the product
