"""Wan's rotary embedding, moved from its processor into the patched attention call: bit for bit the processor's.

CPU, tiny Wan transformer (``quantpatch.testing.diffusers_tiny``): the rotation runs the reference
(``rotary_ref.rotary_interleaved_ref``); the Triton kernel's bit-exactness against it is ``tests/kernels``'.
"""

import pytest
import torch

import quantpatch as qp
from quantpatch.patches.diffusers import processors
from quantpatch.patches.diffusers.wan_rotary import rotary_parameter
from quantpatch.testing.diffusers_tiny import tiny_transformer

pytestmark = pytest.mark.usefixtures("one_cpu_thread")  # tests/conftest.py

pytest.importorskip("diffusers")


@pytest.fixture
def rotations(monkeypatch):
    """Shapes of the tensors each patched attention call rotated, in call order."""
    seen = []

    def counting(x, cos, sin):
        seen.append(tuple(x.shape))
        return rotate(x, cos, sin)

    rotate = processors.rotate
    monkeypatch.setattr(processors, "rotate", counting)
    return seen


def test_wan_processor_is_recognised_and_others_are_not():
    from diffusers.models.attention_processor import AttnProcessor2_0
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    assert rotary_parameter(WanAttnProcessor()) == 3  # (hidden_states, encoder_hidden_states, attention_mask, rotary)
    assert rotary_parameter(FluxAttnProcessor()) is None
    assert rotary_parameter(AttnProcessor2_0()) is None


@pytest.mark.parametrize("policy", ["speed", "always"])
def test_rotation_moves_into_the_attention_call_bit_for_bit(policy, rotations, monkeypatch, no_leaks):
    model, call = tiny_transformer("WanTransformer3DModel")
    base = call()
    with qp.patch_model(model, "sage2-8b", policy=policy):
        moved = call()
    # each block's self-attention rotated its query and key (cross-attention has no rotary embedding)
    blocks = len(model.blocks)
    assert len(rotations) == 2 * blocks
    monkeypatch.setattr(processors, "rotary_parameter", lambda processor: None)
    with qp.patch_model(model, "sage2-8b", policy=policy):
        kept = call()
    assert len(rotations) == 2 * blocks  # the processor rotated them itself
    assert torch.equal(moved, kept)
    if policy == "speed":  # the CPU runs SDPA under policy="speed": the unpatched model, bit for bit
        assert torch.equal(moved, base)
    assert torch.equal(call(), base)


def test_a_processor_that_makes_no_attention_call_raises(monkeypatch, no_leaks):
    model, call = tiny_transformer("WanTransformer3DModel")
    base = call()
    with qp.patch_model(model, "sage2-8b", policy="always"):
        wrapper = model.blocks[0].attn1.processor
        # a processor that returns its input without attending: the rotation taken out of it would be lost
        monkeypatch.setattr(type(wrapper), "original", property(lambda self: lambda attn, hidden, *a, **k: hidden),
                            raising=False)
        with pytest.raises(RuntimeError, match="never applied"):
            call()
    assert torch.equal(call(), base)
