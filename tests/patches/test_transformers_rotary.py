"""Transformers' ``rotate_half`` rotary embedding in one launch while a model is patched (``patches/transformers/
rotary.py``): taken over only where a modeling module defines exactly that rotation, bit for bit, and handed back
when the last patched model holding it is removed, in any order.

CPU, tiny models (``conftest.tiny_model``): the replacement hands CPU calls to the original, so outputs are the
unpatched ones under ``policy="speed"``; the ``gpu`` test runs the kernel path against Transformers' function.
"""

import importlib

import pytest
import torch

import quantpatch as qp
from quantpatch.patches.transformers import rotary
from tests.gpu import needs_cuda
from tests.patches.conftest import tiny_model

pytestmark = pytest.mark.usefixtures("one_cpu_thread")  # tests/conftest.py


def _attention(model):
    from quantpatch.patches.transformers import _dispatches_attention

    return next(m for m in model.modules() if _dispatches_attention(m))


@pytest.mark.parametrize("family, takes", [("llama", True), ("qwen2", True), ("mistral", True), ("gpt_neox", False),
                                           ("gpt2", False)])
def test_only_the_rotate_half_rotation_is_taken(family, takes):
    module = rotary.rotary_module(_attention(tiny_model(family)))
    assert (module is not None) == takes
    if takes:
        assert module.__name__.endswith(f"modeling_{family}")


def test_swapped_while_patched_restored_after_the_last_removal(monkeypatch, no_leaks):
    llama = importlib.import_module("transformers.models.llama.modeling_llama")
    held = rotary._HELD.get(llama.__name__)
    original = held[0] if held else llama.apply_rotary_pos_emb
    # a model another test left patched holds the replacement: start from the original, nothing held
    monkeypatch.setattr(rotary, "_HELD", {})
    monkeypatch.setattr(llama, "apply_rotary_pos_emb", original)
    calls, make = [], rotary.halves_rotary

    def counting(function):
        fused = make(function)

        def apply_rotary_pos_emb(*args, **kwargs):
            calls.append(1)
            return fused(*args, **kwargs)

        return apply_rotary_pos_emb

    monkeypatch.setattr(rotary, "halves_rotary", counting)
    first, second = tiny_model("llama"), tiny_model("llama")
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(0))
    base = first(ids).logits
    a = qp.patch_model(first, "sage2-8b")
    b = qp.patch_model(second, "sage2-8b", policy="always")
    try:
        assert llama.apply_rotary_pos_emb is not original
        assert torch.equal(first(ids).logits, base)  # CPU: SDPA, and the replacement handed its calls to the original
        assert len(calls) == 2  # one call a layer (query and key together)
        patched_always = second(ids).logits
    finally:
        a.remove()  # not the last one: the replacement stays for the second model
    try:
        assert llama.apply_rotary_pos_emb is not original
    finally:
        b.remove()
    assert llama.apply_rotary_pos_emb is original
    assert torch.equal(first(ids).logits, base)
    with qp.patch_model(second, "sage2-8b", policy="always"):  # a second patch finds the original again
        assert torch.equal(second(ids).logits, patched_always)
    assert llama.apply_rotary_pos_emb is original


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_replacement_equals_transformers_rotation_bit_for_bit(dtype):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = torch.Generator(device="cuda").manual_seed(0)
    seq = rotary.MIN_TOKENS // 2 + 3  # two sequences: past the threshold, with a tail
    q = (torch.randn(2, seq, 32, 128, device="cuda", generator=gen) * 9).to(dtype).transpose(1, 2)  # as Llama
    k = (torch.randn(2, seq, 8, 128, device="cuda", generator=gen) * 9).to(dtype).transpose(1, 2)
    angle = torch.randn(2, seq, 64, device="cuda", generator=gen) * 4
    cos, sin = (torch.cat([f(angle)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))
    launches = []
    fused = rotary.halves_rotary(lambda *args: launches.append(args) or apply_rotary_pos_emb(*args))
    for got, want in zip(fused(q, k, cos, sin), apply_rotary_pos_emb(q, k, cos, sin)):
        assert torch.equal(got, want)
    assert not launches  # the kernel took the call
    fused(q[:, :, :1], k[:, :, :1], cos[:, :1], sin[:, :1])  # a decode step: the original
    assert len(launches) == 1
