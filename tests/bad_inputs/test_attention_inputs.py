"""Unusual and bad inputs to the attention path: each gives a correct result, a clear error or a warned fallback.

Functional calls (``quantpatch.attention``) run on the CPU reference; patched-model cases run tiny models built
from config and ``pydoc-llama-21m`` (skipped, saying so, where that asset is absent).
"""

import inspect
import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import quantpatch as qp
from quantpatch.fallback import reset_fallback_warnings
from quantpatch.kernels.attention.attention_ref import attention_exact
from quantpatch.kernels.attention.quant_attention_ref import quant_attention_ref
from quantpatch.range_check import forget_checks
from quantpatch.synthetic import attention_inputs
from tests.gpu import needs_cuda
from tests.patches.conftest import tiny_model
from tests.tolerances import RANDN_COS_FLOOR

QUANTIZED = ("sage2-8b", "sage2-4b", "int8-flash", "turbo", "fireq")
MODES = ("off", *QUANTIZED)
SHARED = Path(__file__).resolve().parents[2].parent / "shared"
PYDOC = SHARED / "models" / "pydoc-llama-21m"


@pytest.fixture(autouse=True)
def _fresh_warnings():
    reset_fallback_warnings()
    forget_checks()
    yield
    reset_fallback_warnings()
    forget_checks()


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def exact(q, k, v, **kw) -> torch.Tensor:
    return attention_exact(q.double(), k.double(), v.double(), **kw)


# --------------------------------------------------------------------------- functional calls


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8])
def test_integer_mask_is_rejected_like_sdpa(mode, dtype):
    q, k, v = attention_inputs("randn", heads=2, seq_q=8, head_dim=32)
    mask = torch.ones(8, 8, dtype=dtype)
    with pytest.raises(TypeError, match="bool mask .* additive float mask"):
        qp.attention(q, k, v, mode=mode, attn_mask=mask)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", [(1, 1, 36, 1), (1, 1, 1, 100), (100,), (36, 1)])
def test_mask_broadcast_along_either_dimension(mode, shape):
    q, k, v = attention_inputs("randn", heads=2, seq_q=36, seq_k=100, head_dim=32)
    mask = torch.randn(shape)
    o = qp.attention(q, k, v, mode=mode, attn_mask=mask)
    full = mask.expand(1, 1, 36, 100)
    if mode == "off":
        torch.testing.assert_close(o, exact(q, k, v, attn_mask=full).float(), rtol=1e-5, atol=1e-5)
    else:
        ref = quant_attention_ref(q, k, v, qp.get_mode(mode).attention, attn_mask=full.contiguous())
        torch.testing.assert_close(o, ref.to(o.dtype))


def test_mask_that_broadcasts_to_more_dimensions_is_rejected():
    q, k, v = attention_inputs("randn", heads=2, seq_q=8, head_dim=32)
    with pytest.raises(ValueError, match="broadcasts to"):
        qp.attention(q, k, v, mode="sage2-8b", attn_mask=torch.zeros(3, 1, 1, 8, 8))
    with pytest.raises(ValueError, match="does not broadcast"):
        qp.attention(q, k, v, mode="sage2-8b", attn_mask=torch.zeros(7, 8))


@pytest.mark.parametrize("head_dim", [1, 8, 16, 31, 32, 48, 64, 80, 96, 128, 160, 256, 257, 320, 512])
def test_every_head_dim_gives_a_correct_result_or_a_warned_fallback(head_dim):
    q, k, v = attention_inputs("randn", heads=2, seq_q=40, head_dim=head_dim, seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        o = qp.attention(q, k, v, mode="sage2-8b", is_causal=True)
    ref = exact(q, k, v, is_causal=True)
    fell_back = [w for w in caught if issubclass(w.category, qp.QuantpatchFallbackWarning)]
    if 32 <= head_dim <= 256:
        assert not fell_back
        assert cos(o, ref) >= RANDN_COS_FLOOR["sage2-8b"]
    else:
        assert len(fell_back) == 1 and f"head_dim {head_dim}" in str(fell_back[0].message)
        torch.testing.assert_close(o, ref.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_float_dtypes_keep_their_dtype(mode, dtype):
    q, k, v = attention_inputs("randn", heads=2, seq_q=33, head_dim=64, dtype=dtype)
    o = qp.attention(q, k, v, mode=mode)
    assert o.dtype == dtype and o.shape == q.shape
    assert cos(o, exact(q, k, v)) >= RANDN_COS_FLOOR.get(mode, 0.9999)


@pytest.mark.parametrize("bad", ["int", "mixed", "3d", "list"])
def test_bad_operands_raise_clear_errors(bad):
    q, k, v = attention_inputs("randn", heads=2, seq_q=8, head_dim=32)
    if bad == "int":
        q, k, v = (t.to(torch.int32) for t in (q, k, v))
        err, match = TypeError, "dtype torch.int32"
    elif bad == "mixed":
        k = k.half()
        err, match = TypeError, "dtypes differ"
    elif bad == "3d":
        q = q[0]
        err, match = ValueError, "must be 4-D"
    else:
        q = q.tolist()
        err, match = TypeError, "must be a torch.Tensor"
    with pytest.raises(err, match=match):
        qp.attention(q, k, v, mode="sage2-8b")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("nq, nk", [(0, 16), (16, 0), (0, 0)])
def test_empty_inputs_give_empty_or_zero_outputs(mode, nq, nk):
    q, k, v = torch.randn(1, 2, nq, 32), torch.randn(1, 2, nk, 32), torch.randn(1, 2, nk, 32)
    o, lse = qp.attention(q, k, v, mode=mode, return_lse=True)
    assert o.shape == (1, 2, nq, 32) and not o.any()
    assert lse.shape == (1, 2, nq) and bool((lse == float("-inf")).all())


@pytest.mark.parametrize("mode", QUANTIZED)
@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_inf_inputs_raise_naming_the_tensor(mode, name, bad):
    tensors = dict(zip("qkv", attention_inputs("randn", heads=2, seq_q=16, head_dim=32)))
    tensors[name][0, 0, 3, 5] = bad
    with pytest.raises(ValueError, match=f"{name} contains NaN or Inf"):
        qp.attention(tensors["q"], tensors["k"], tensors["v"], mode=mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("nq, nk", [(1, 50), (7, 50), (50, 50), (50, 7), (1, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_query_and_key_lengths_bottom_right_causal(mode, nq, nk, causal):
    q, k, v = attention_inputs("randn", heads=4, kv_heads=2, seq_q=nq, seq_k=nk, head_dim=32, seed=2)
    o = qp.attention(q, k, v, mode=mode, is_causal=causal)
    ref = exact(q, k, v, is_causal=causal)
    seen = ref.abs().sum(-1) > 0  # bottom-right causal with nq > nk: the first nq - nk rows see no key
    assert not o[~seen].any(), "a row that sees no key must be zero"
    if seen.any():
        assert cos(o[seen], ref[seen]) >= RANDN_COS_FLOOR.get(mode, 0.9999)


@pytest.mark.parametrize("mode", QUANTIZED)
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (8, 2), (8, 1)])
def test_gqa_ratios_match_repeated_kv(mode, heads, kv_heads):
    q, k, v = attention_inputs("randn", heads=heads, kv_heads=kv_heads, seq_q=24, head_dim=32)
    o = qp.attention(q, k, v, mode=mode)
    rep = heads // kv_heads
    repeated = qp.attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), mode=mode)
    # per-tensor / per-block scales see the same values either way, so the results agree to rounding
    assert cos(o, repeated) >= 0.9999


def test_gqa_head_counts_that_do_not_divide_raise():
    q, k, v = attention_inputs("randn", heads=3, kv_heads=3, seq_q=8, head_dim=32)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        qp.attention(q, k[:, :2], v[:, :2], mode="sage2-8b")


@pytest.mark.parametrize("mode", MODES)
def test_non_contiguous_inputs_and_layouts_agree(mode):
    q, k, v = attention_inputs("randn", heads=2, seq_q=30, head_dim=32)
    base = qp.attention(q, k, v, mode=mode)
    strided = [torch.randn(t.shape[0], t.shape[2], t.shape[1], t.shape[3]).transpose(1, 2) for t in (q, k, v)]
    for s, t in zip(strided, (q, k, v)):
        s.copy_(t)
    assert not strided[0].is_contiguous()
    torch.testing.assert_close(qp.attention(*strided, mode=mode), base)
    bshd = qp.attention(*(t.transpose(1, 2) for t in (q, k, v)), mode=mode, layout="BSHD")
    torch.testing.assert_close(bshd.transpose(1, 2), base)
    with pytest.raises(ValueError, match="layout="):
        qp.attention(q, k, v, mode=mode, layout="SBHD")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scale", [0.0, -0.125, 1e-3])
def test_zero_and_negative_scales(mode, scale):
    q, k, v = attention_inputs("randn", heads=2, seq_q=20, head_dim=64, seed=3)
    o = qp.attention(q, k, v, mode=mode, scale=scale)
    ref = exact(q, k, v, scale=scale)
    assert cos(o, ref) >= RANDN_COS_FLOOR.get(mode, 0.9999)
    if scale == 0.0:  # uniform weights: every row is the mean of V (to the mode's V quantization)
        assert cos(o, v.double().mean(2, keepdim=True).expand_as(ref)) >= RANDN_COS_FLOOR.get(mode, 0.9999)


def _large_key_channel(value: float):
    q, k, v = attention_inputs("randn", heads=4, seq_q=600, head_dim=128, seed=0)
    k[..., 5] = value
    return q, k, v


@pytest.mark.parametrize("mode, value, warns", [
    ("int8-flash", 100.0, True), ("turbo", 100.0, True), ("sage2-8b", 100.0, False), ("sage2-4b", 100.0, False),
    ("int8-flash", 1e4, True), ("turbo", 1e4, True), ("fireq", 100.0, False),
])
def test_accuracy_collapse_on_large_key_channels_warns_once_naming_a_mode_that_copes(mode, value, warns):
    q, k, v = _large_key_channel(value)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        o = qp.attention(q, k, v, mode=mode)
        qp.attention(q, k, v, mode=mode)
    accuracy = [w for w in caught if issubclass(w.category, qp.QuantpatchAccuracyWarning)]
    assert len(accuracy) == int(warns)
    if warns:
        assert "sage2-8b" in str(accuracy[0].message) and "CosSim" in str(accuracy[0].message)
        assert cos(o, exact(q, k, v)) < 0.99  # the warning is about a real loss
    else:
        assert cos(o, exact(q, k, v)) >= 0.97


@pytest.mark.parametrize("mode", QUANTIZED)
def test_ordinary_inputs_raise_no_accuracy_warning(mode):
    q, k, v = attention_inputs("outliers", heads=4, seq_q=600, head_dim=128, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", qp.QuantpatchAccuracyWarning)
        qp.attention(q, k, v, mode=mode, is_causal=True)


def test_a_collapsing_site_is_reported_once(one_cpu_thread):
    model = tiny_model("llama")
    with torch.no_grad():
        for layer in model.model.layers:  # unit-scale queries and keys, and a key projection with one channel at 1e4
            attn = layer.self_attn
            for proj in (attn.q_proj, attn.k_proj):
                proj.weight.normal_(0, proj.in_features ** -0.5)
            attn.k_proj.bias = torch.nn.Parameter(torch.zeros(attn.k_proj.out_features))
            attn.k_proj.bias[3] = 1e4
    ids = torch.randint(3, 100, (1, 40), generator=torch.Generator().manual_seed(0))
    with pytest.warns(qp.QuantpatchAccuracyWarning, match="model.layers.0.self_attn"):
        with qp.patch_model(model, "int8-flash", policy="always") as handle, torch.no_grad():
            model(ids)
            model(ids)
    assert any("accuracy: CosSim" in r for r in handle.fallbacks()["model.layers.0.self_attn"])


# --------------------------------------------------------------------------- patched models


def _pydoc():
    if not PYDOC.is_dir():
        pytest.skip(f"optional asset absent: {PYDOC}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(PYDOC, dtype=torch.float32).eval()
    text = json.loads((SHARED / "data" / "pydoc-val.jsonl").read_text().splitlines()[0])["text"]
    ids = AutoTokenizer.from_pretrained(PYDOC)(text, return_tensors="pt").input_ids[:, :19]
    return model, ids


@pytest.mark.parametrize("mode", ["off", "sage2-8b", "int8-flash"])
def test_prefill_into_a_static_cache(mode, one_cpu_thread):
    """No mask reaches the attention for a prefill into an empty StaticCache (SDPA's top-left is_causal)."""
    from transformers import StaticCache

    model, ids = _pydoc()
    # transformers renames past_key_values to cache in 5.x; take whichever this version's forward names
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def logits():
        with torch.no_grad():
            return model(ids, **{cache_kw: StaticCache(config=model.config, max_cache_len=64)}).logits

    ref = logits()
    with qp.patch_model(model, mode, policy="always"):
        out = logits()
    if mode == "off":
        assert torch.equal(out, ref)
    else:
        assert cos(out, ref) >= 0.999


def test_generate_with_a_static_cache_matches_unpatched(one_cpu_thread):
    model, ids = _pydoc()
    kw = dict(max_new_tokens=12, do_sample=False, cache_implementation="static")
    ref = model.generate(ids, **kw)
    with qp.patch_model(model, "off", policy="always"):
        assert torch.equal(model.generate(ids, **kw), ref)
    with qp.patch_model(model, "sage2-8b", policy="always"):
        out = model.generate(ids, **kw)
    assert (out[0, 19:] == ref[0, 19:]).sum() >= 11


@pytest.mark.parametrize("family", ["mistral", "llama"])
def test_generate_with_left_padding_and_sliding_windows_is_exact_under_off(family, one_cpu_thread):
    model = tiny_model(family)
    ids = torch.randint(3, 100, (2, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0  # left padding
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    ref = model.generate(ids, **kw)
    with qp.patch_model(model, "off", policy="always"):
        assert torch.equal(model.generate(ids, **kw), ref)
    with qp.patch_model(model, "sage2-8b", policy="always"):
        assert model.generate(ids, **kw).shape == ref.shape


def _t5():
    import transformers as T

    torch.manual_seed(0)
    config = T.T5Config(vocab_size=128, d_model=64, d_kv=32, d_ff=128, num_layers=2, num_decoder_layers=2,
                        num_heads=2, decoder_start_token_id=0, pad_token_id=0)
    model = T.T5ForConditionalGeneration(config).eval()
    with torch.no_grad():  # a bias of trained scale (a few units), so dropping it would show
        for module in model.modules():
            if getattr(module, "has_relative_attention_bias", False):
                module.relative_attention_bias.weight.normal_(0, 3.0)
    return model


@pytest.mark.parametrize("mode", ["off", "sage2-8b", "int8-flash"])
def test_t5_position_bias_is_honoured(mode, one_cpu_thread):
    model = _t5()
    ids = torch.randint(3, 100, (2, 24), generator=torch.Generator().manual_seed(1))
    dec = torch.randint(3, 100, (2, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(input_ids=ids, decoder_input_ids=dec).logits
        with qp.patch_model(model, mode, policy="always"):
            out = model(input_ids=ids, decoder_input_ids=dec).logits
    if mode == "off":
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        assert cos(out, ref) >= 0.999


def test_attention_sinks_fall_back_naming_the_input(no_leaks):
    from quantpatch.patches.transformers.attention import REFUSED_INPUTS

    model = tiny_model("llama")
    module = model.model.layers[0].self_attn
    q, k, v = attention_inputs("randn", heads=2, kv_heads=1, seq_q=5, head_dim=32)
    with qp.patch_model(model, "sage2-8b", strict=True, policy="always"):
        from transformers import AttentionInterface

        fn = AttentionInterface._global_mapping[model.config._attn_implementation]
        with pytest.raises(qp.UnsupportedError, match="attention sinks"):
            fn(module, q, k, v, None, s_aux=torch.zeros(2))
    assert "s_aux" in REFUSED_INPUTS


@pytest.fixture
def no_leaks():
    from tests.patches.conftest import _global_state

    before = _global_state()
    yield
    assert _global_state() == before


@pytest.mark.parametrize("policy", ["always", "speed"])  # speed: the route to the model's own SDPA, traced
def test_patched_model_compiles_fullgraph_on_cpu(one_cpu_thread, policy):
    model = tiny_model("llama")
    ids = torch.randint(3, 100, (1, 24), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    with qp.patch_model(model, "sage2-8b", policy=policy) as handle, torch.no_grad():
        eager = model(ids).logits
        counted = {site.name: dict(site.routes) for site in handle.sites}
        compiled_model = torch.compile(model, fullgraph=True)
        # past dynamo's recompile limit (8): the route counts must not make each call recompile
        outputs = [compiled_model(ids).logits for _ in range(torch._dynamo.config.recompile_limit + 2)]
        assert {site.name: dict(site.routes) for site in handle.sites} == counted  # graph calls are not counted
    for compiled in outputs:
        torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)


def test_patching_twice_raises(no_leaks):
    model = tiny_model("llama")
    with qp.patch_model(model, "sage2-8b", policy="always"):
        with pytest.raises(ValueError, match="already patched"):
            qp.patch_model(model, "int8-flash", policy="always")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("seq", [256, 4096])
def test_patched_model_compiles_fullgraph_on_gpu(seq):
    """The patched model's kernels (the Triton kernel at 256 tokens, the sm_90 kernel at 4096 on Hopper) trace
    into one graph and give the eager patched logits."""
    import transformers as T

    torch.manual_seed(0)
    config = T.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=seq)
    model = T.AutoModelForCausalLM.from_config(config).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(3, 256, (1, seq), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    torch._dynamo.reset()
    with qp.patch_model(model, "sage2-8b", policy="always") as handle, torch.no_grad():
        eager = model(ids).logits
        compiled = torch.compile(model, fullgraph=True)(ids).logits
        assert handle.sites[0].implementations == {"triton"}, handle.report()
    assert cos(compiled, eager) > 0.9999
