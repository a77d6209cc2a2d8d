"""patch_model on a model accelerate dispatched (``device_map`` / offload hooks): the hooks stay in place and move
the weights in as before, and the patched attention runs on the weights' device. The two-GPU split is
``tests/multigpu/test_multigpu.py``."""

import pytest
import torch

import quantpatch as qp

pytestmark = pytest.mark.usefixtures("one_cpu_thread")  # tests/conftest.py

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

CONFIG = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              intermediate_size=128)


def _llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()


def test_offload_hooks_stay_and_patched_logits_match():
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(1))
    reference = _llama()
    with torch.no_grad(), qp.patch_model(reference, "sage2-8b", policy="always"):
        expected = reference(ids).logits
    model = accelerate.cpu_offload(_llama(), execution_device="cpu")  # weights on meta, moved in by hooks
    hooked = {name for name, m in model.named_modules() if hasattr(m, "_hf_hook")}
    assert "model.layers.0.self_attn.q_proj" in hooked
    assert model.model.layers[0].self_attn.q_proj.weight.device.type == "meta"
    with torch.no_grad(), qp.patch_model(model, "sage2-8b", policy="always") as handle:
        assert {name for name, m in model.named_modules() if hasattr(m, "_hf_hook")} == hooked
        logits = model(ids).logits
    assert torch.equal(logits, expected)
    assert {r for site in handle.sites for r in site.routes} == {"reference"}
    assert {name for name, m in model.named_modules() if hasattr(m, "_hf_hook")} == hooked
    assert model.model.layers[0].self_attn.q_proj.weight.device.type == "meta"  # offloaded again after the call


def test_fp8_linears_keep_offloaded_layers_with_a_warning():
    """FP8 weights are made at patch time: a linear whose weights accelerate offloads (meta until its hook loads them)
    keeps its nn.Linear and its hook, with a fallback warning naming it; ``strict`` raises."""
    from quantpatch.fallback import UnsupportedError, reset_fallback_warnings
    from quantpatch.fp8_linear import FP8Linear

    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = _llama()(ids).logits
    model = accelerate.cpu_offload(_llama(), execution_device="cpu")
    reset_fallback_warnings()
    with pytest.warns(qp.QuantpatchFallbackWarning, match="model.layers.0.self_attn.q_proj: weights offloaded"):
        handle = qp.patch_model(model, "off", linear="fp8", policy="always")
    with torch.no_grad(), handle:
        assert not any(isinstance(m, FP8Linear) for m in model.modules())
        assert hasattr(model.model.layers[0].mlp.up_proj, "_hf_hook")
        assert torch.equal(model(ids).logits, expected)
    with pytest.raises(UnsupportedError, match="offloaded"):
        qp.patch_model(model, "off", linear="fp8", strict=True)
