"""patch_model on Transformers models: sites swapped, outputs close, remove() exact, no leaks."""

import pytest
import torch

import quantpatch as qp
from quantpatch.fallback import reset_fallback_warnings
from tests.gpu import needs_cuda
from tests.patches.conftest import tiny_model

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "gpt2", "gpt_neox", "bert"]
# Logit CosSim floor vs the unpatched model (random tiny models, 24 tokens, reference path).
LOGIT_COS_FLOOR = {"sage2-8b": 0.999, "int8-flash": 0.999, "fireq": 0.998, "turbo": 0.998, "sage2-4b": 0.99}


def _inputs(family):
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _out(model, inputs):
    with torch.no_grad():
        out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("family", FAMILIES)
def test_family_is_patched_and_restored_bitwise(family, no_leaks):
    reset_fallback_warnings()
    model, inputs = tiny_model(family), _inputs(family)
    base = _out(model, inputs)
    handle = qp.patch_model(model, "sage2-8b", policy="always")
    sites = [s for s in handle.sites if s.kind == "attention"]
    assert len(sites) == 2 and all("quantpatch sage2-8b" in s.runs for s in sites)
    patched = _out(model, inputs)
    handle.remove()
    assert torch.equal(_out(model, inputs), base)
    if family == "gemma2":  # attention logit softcapping: falls back to the original attention
        assert all("softcapping" in r for s in sites for r in s.fallbacks)
        assert torch.equal(patched, base)
    else:
        assert not handle.fallbacks()
        assert not torch.equal(patched, base)
        assert qp.cos_sim(patched, base) > LOGIT_COS_FLOOR["sage2-8b"]


@pytest.mark.parametrize("mode", sorted(LOGIT_COS_FLOOR))
def test_every_mode_stays_close_on_llama(mode, no_leaks):
    model, inputs = tiny_model("llama"), _inputs("llama")
    base = _out(model, inputs)
    with qp.patch_model(model, mode, policy="always") as handle:
        assert qp.cos_sim(_out(model, inputs), base) > LOGIT_COS_FLOOR[mode]
    assert not handle.active and torch.equal(_out(model, inputs), base)


def test_padding_mask_is_honoured():
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (2, 20), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :7] = 0  # left padding
    base = _out(model, {"input_ids": ids, "attention_mask": mask})
    unquantized = qp.get_mode("sage2-8b", qk_format="none", pv_format="none", smooth_q=False)
    with qp.patch_model(model, unquantized, policy="always"):
        patched = _out(model, {"input_ids": ids, "attention_mask": mask})
    # unquantized numerics through our path: equal to the model's own attention up to float rounding
    torch.testing.assert_close(patched[0, 7:], base[0, 7:], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(patched[1], base[1], rtol=1e-4, atol=1e-4)


def test_include_exclude_and_report(no_leaks):
    model = tiny_model("llama")
    with qp.patch_model(model, "sage2-4b", exclude=["layers.1."], policy="always") as handle:
        runs = {s.name: s.runs for s in handle.sites}
        report = handle.report()
    assert "quantpatch sage2-4b" in runs["model.layers.0.self_attn"]
    assert "excluded" in runs["model.layers.1.self_attn"]
    assert "model.layers.1.self_attn: original sdpa attention (excluded)" in report


def test_patching_twice_or_compiled_raises(no_leaks):
    model = tiny_model("llama")
    with qp.patch_model(model, "sage2-8b", policy="always"):
        with pytest.raises(ValueError, match="already patched"):
            qp.patch_model(model, "sage2-8b", policy="always")
    with pytest.raises(ValueError, match="torch.compile"):
        qp.patch_model(torch.compile(model), "sage2-8b", policy="always")


def test_unknown_mode_and_model_kinds_raise():
    with pytest.raises(ValueError, match="valid modes"):
        qp.patch_model(tiny_model("llama"), "int3", policy="always")
    with pytest.raises(ValueError, match="supports transformers PreTrainedModel"):
        qp.patch_model(torch.nn.Linear(2, 2), "sage2-8b", policy="always")


def test_softcap_fallback_warns_once_and_strict_raises():
    reset_fallback_warnings()
    model, inputs = tiny_model("gemma2"), _inputs("gemma2")
    with qp.patch_model(model, "sage2-8b", policy="always"):
        with pytest.warns(qp.QuantpatchFallbackWarning, match="softcapping"):
            _out(model, inputs)
    with qp.patch_model(model, "sage2-8b", strict=True, policy="always"):
        with pytest.raises(qp.UnsupportedError, match="softcapping"):
            _out(model, inputs)


def test_filters_that_select_no_attention_site_say_so(no_leaks, caplog):
    """A filter that names no site (a typo) leaves every attention site unpatched: the report and the log say so,
    rather than the model silently running its own attention."""
    model = tiny_model("llama")
    with caplog.at_level("WARNING", logger="quantpatch"):
        with qp.patch_model(model, "sage2-8b", include=["self_atn"]) as handle:
            assert "select none of LlamaForCausalLM's 2 attention sites" in handle.report()
    assert any("select none" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="quantpatch"):
        with qp.patch_model(model, "sage2-8b", include=["layers.1"]) as handle:
            assert "select none" not in handle.report()
    assert not any("select none" in r.getMessage() for r in caplog.records)


def test_per_site_overrides_apply_and_unknown_ones_raise(no_leaks):
    model = tiny_model("llama")
    overrides = {"model.layers.1.self_attn": {"qk_format": "int8", "qk_qmax": 127}}
    with qp.patch_model(model, "sage2-4b", overrides=overrides, policy="always"):
        sites = {n: m._quantpatch_site.config for n, m in model.named_modules() if hasattr(m, "_quantpatch_site")}
    assert sites["model.layers.0.self_attn"].qk_format == "int4"
    assert sites["model.layers.1.self_attn"].qk_format == "int8"
    with pytest.raises(ValueError, match="overrides name unknown sites"):
        qp.patch_model(model, "sage2-4b", overrides={"model.layers.9.self_attn": {"smooth_q": False}}, policy="always")
    with pytest.raises(ValueError, match="overrides name unknown sites"):  # turbo's generate site is no attention
        qp.patch_model(model, "turbo", overrides={"generate": {"smooth_q": False}}, policy="always")
    with pytest.raises(ValueError, match="unknown AttentionConfig option"):
        qp.patch_model(model, "sage2-4b", overrides={"model.layers.0.self_attn": {"smoothing": False}}, policy="always")
    with pytest.raises(TypeError, match="a dict of attention options.*got 'int8' for 'model.layers.0.self_attn'"):
        qp.patch_model(model, "sage2-4b", overrides={"model.layers.0.self_attn": "int8"})
    with pytest.raises(TypeError, match="overrides takes a dict"):
        qp.patch_model(model, "sage2-4b", overrides=[("model.layers.0.self_attn", {"qk_qmax": 7})])
    assert not hasattr(model, "_quantpatch_handle")


def _tiny_cuda_llama():
    import transformers as T

    torch.manual_seed(0)
    config = T.LlamaConfig(vocab_size=128, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=256)
    return T.LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval(), torch.randint(3, 128, (2, 200), device="cuda")


def _compiled_logits(model, ids):
    """``model(ids).logits`` through ``torch.compile`` (Inductor), the number of graph breaks, and how many calls of
    the sm_90 attention kernel op the graphs hold (calls inside a graph are not counted in the patch report)."""
    from torch._dynamo.utils import counters
    from torch._inductor.compile_fx import compile_fx

    targets = []

    def inductor(gm, example_inputs):
        targets.extend(str(node.target) for node in gm.graph.nodes)
        return compile_fx(gm, example_inputs)

    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        out = torch.compile(model, backend=inductor)(ids).logits
    return out, sum(counters["graph_break"].values()), sum("attn_qk_int8_pv_fp8" in t for t in targets)


@pytest.mark.gpu
@needs_cuda
def test_gpu_patched_llama_runs_under_torch_compile():
    model, ids = _tiny_cuda_llama()
    with qp.patch_model(model, "sage2-8b", policy="always") as handle:
        with torch.no_grad():
            eager = model(ids).logits
        assert all(site.implementations == {"triton"} for site in handle.sites)
        compiled, _, kernel_calls = _compiled_logits(model, ids)
    assert kernel_calls == len(handle.sites)
    assert qp.cos_sim(compiled, eager) > 0.999


def test_patch_model_imports_the_gpu_kernels_before_any_traced_call(monkeypatch):
    from quantpatch import dispatch

    loaded = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dispatch, "load_kernels", loaded.append)
    with qp.patch_model(tiny_model("llama"), "sage2-8b", policy="always"):
        assert loaded == [dispatch.FAST_PATHS_MODULE, dispatch.W4A8_KERNELS_MODULE, *dispatch.TURBO_KERNELS_MODULES]


COMPILE_FIRST = """
import torch, quantpatch as qp
from tests.patches.test_transformers_patch import _compiled_logits, _tiny_cuda_llama
model, ids = _tiny_cuda_llama()
with torch.no_grad():
    unpatched = model(ids).logits
with qp.patch_model(model, "sage2-8b", policy="always") as handle:
    compiled, breaks, kernel_calls = _compiled_logits(model, ids)
assert kernel_calls == len(handle.sites), kernel_calls
assert breaks == 0, breaks
assert qp.cos_sim(compiled, unpatched) > 0.999, qp.cos_sim(compiled, unpatched)
"""


@pytest.mark.gpu
@needs_cuda
def test_gpu_compile_as_the_first_call_in_a_process_runs_the_kernels():
    """A fresh process whose first quantized call is traced (the kernels are not imported yet)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-c", COMPILE_FIRST], cwd=root, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.gpu
@needs_cuda
def test_gpu_patched_llama_compiles_through_the_kernels_without_extra_graph_breaks():
    model, ids = _tiny_cuda_llama()
    _, base_breaks, _ = _compiled_logits(model, ids)
    with qp.patch_model(model, "sage2-8b", policy="always") as handle:
        _, breaks, kernel_calls = _compiled_logits(model, ids)
    assert kernel_calls == len(handle.sites)
    assert breaks == base_breaks


def test_accelerate_offload_hooks_stay_intact(no_leaks):
    from accelerate import cpu_offload

    model, inputs = tiny_model("llama"), _inputs("llama")
    base = _out(model, inputs)
    cpu_offload(model, execution_device=torch.device("cpu"))  # weights on meta, streamed by hooks
    hooks = {n: m._hf_hook for n, m in model.named_modules() if hasattr(m, "_hf_hook")}
    assert hooks and next(model.parameters()).device.type == "meta"
    with qp.patch_model(model, "sage2-8b", policy="always") as handle:
        patched = _out(model, inputs)
        assert {n: m._hf_hook for n, m in model.named_modules() if hasattr(m, "_hf_hook")} == hooks
    assert not handle.fallbacks() and qp.cos_sim(patched, base) > LOGIT_COS_FLOOR["sage2-8b"]
    assert torch.equal(_out(model, inputs), base)


def test_untested_family_is_patched_with_a_note_or_refused_under_strict(no_leaks):
    import transformers as T

    torch.manual_seed(0)
    model = T.OPTForCausalLM(T.OPTConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                         ffn_dim=128, word_embed_proj_dim=64)).eval()
    with pytest.raises(qp.UnsupportedError, match="model type 'opt' is not in quantpatch's tested families"):
        qp.patch_model(model, "sage2-8b", strict=True, policy="always")
    assert not hasattr(model, "_quantpatch_handle")
    with qp.patch_model(model, "sage2-8b", policy="always") as handle:
        assert any("'opt'" in note and "all the same" in note for note in handle.remarks)
        assert len(handle.sites) == 2


@torch.library.custom_op("quantpatch_test::stand_in_attention", mutates_args=())
def _stand_in_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)


@_stand_in_attention.register_fake
def _(q, k, v, is_causal):
    return torch.empty_like(q)


def test_patched_attention_adds_no_graph_breaks_around_a_kernel_op(monkeypatch, one_cpu_thread):
    # On the CPU a custom op stands in for the Triton kernels (same registry slot, same call path), so
    # this checks quantpatch's own Python around the op: site records, the mask skip, the cache lookup.
    from quantpatch import dispatch

    stand_in = dispatch.Implementation("stand-in", 100, lambda call: None,
                                       lambda call: _stand_in_attention(call.q, call.k, call.v, call.is_causal))
    monkeypatch.setitem(dispatch._REGISTRY["attention"], "sage2", [stand_in, *dispatch._REGISTRY["attention"]["sage2"]])
    model, ids = tiny_model("llama"), torch.randint(3, 100, (2, 40))
    torch._dynamo.reset()
    alive = qp.TurboCache(model)  # a TurboCache elsewhere in the process must not put its lookup in the graph
    with qp.patch_model(model, "sage2-8b", policy="always") as handle, torch.no_grad():
        explained = torch._dynamo.explain(model)(ids)
    del alive
    assert explained.graph_break_count == 0, [str(b.reason)[:200] for b in explained.break_reasons]
    # the graph runs the stand-in op at every site (calls inside a graph are not counted in the report)
    targets = [str(node.target) for graph in explained.graphs for node in graph.graph.nodes]
    assert sum("stand_in_attention" in t for t in targets) == len(handle.sites)


def test_turbo_cache_imports_its_gpu_kernels_when_built(monkeypatch):
    """A TurboCache built by hand (no patch_model) also imports the kernels before a first traced call."""
    from quantpatch import dispatch

    loaded = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dispatch, "load_kernels", loaded.append)
    qp.TurboCache(tiny_model("llama"))
    assert set(dispatch.TURBO_KERNELS_MODULES) <= set(loaded)
