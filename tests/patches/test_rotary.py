"""Processors' rotary embeddings in one launch (``patches/diffusers/rotary.py``): bit for bit the processors' own.

Wan's rotation moves from its processor into the patched attention call; CogVideoX, Flux and HunyuanVideo find the
one-launch form of Diffusers' ``apply_rotary_emb`` (LTX-Video of its own) under that name while their processors run
(the tiny CogVideoX passes no rotary embedding; Flux, HunyuanVideo and LTX-Video do). CPU, tiny transformers
(``quantpatch.testing.diffusers_tiny``): the rotations run the reference or the models' own functions; the Triton
kernel's bit-exactness against them is ``tests/kernels``' (and LTX-Video's here), and the ``gpu`` tests run the
patch's replacements on CUDA.
"""

import types

import pytest
import torch

import quantpatch as qp
from quantpatch.patches.diffusers import processors
from quantpatch.patches.diffusers.rotary import paired_rotary, rotary_parameter
from quantpatch.testing.diffusers_tiny import tiny_transformer
from tests.gpu import needs_cuda

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


@pytest.mark.parametrize("family, calls, factory, module", [
    ("FluxTransformer2DModel", 4, "paired_rotary", "diffusers.models.embeddings"),
    ("HunyuanVideoTransformer3DModel", 4, "paired_rotary", "diffusers.models.embeddings"),
    ("LTXVideoTransformer3DModel", 4, "channel_rotary", "diffusers.models.transformers.transformer_ltx"),
])
def test_diffusers_rotation_is_replaced_only_while_a_processor_runs(family, calls, factory, module, monkeypatch,
                                                                     no_leaks):
    import importlib

    from quantpatch.patches.diffusers import rotary

    holder = importlib.import_module(module)
    original = holder.apply_rotary_emb
    seen = []
    make = getattr(rotary, factory)

    def counting(function):
        fused = make(function)

        def apply_rotary_emb(x, *args, **kwargs):
            seen.append(holder.apply_rotary_emb is wrapper)
            return fused(x, *args, **kwargs)

        wrapper = apply_rotary_emb
        return wrapper

    monkeypatch.setattr(rotary, factory, counting)
    model, call = tiny_transformer(family)
    base = call()
    with qp.patch_model(model, "sage2-8b"):
        assert holder.apply_rotary_emb is original  # swapped only inside a processor's call
        out = call()
    assert len(seen) == calls and all(seen)  # query and key of each rotating processor, through the replacement
    assert torch.equal(out, base)  # on the CPU the replacement hands every call to the model's own function
    assert holder.apply_rotary_emb is original and torch.equal(call(), base)


class _SpacedRotation:
    """A processor that calls Diffusers' rotation with whitespace before its arguments."""

    def __call__(self, attn, hidden_states, image_rotary_emb=None):
        from diffusers.models.embeddings import apply_rotary_emb

        return apply_rotary_emb (hidden_states, image_rotary_emb)  # noqa: E211


class _NoSource:
    __call__ = staticmethod(len)  # a builtin: no Python source to read


def test_fused_rotation_reads_the_processors_source_whitespace_aside():
    """The name swap is offered to processors whose call's source calls ``apply_rotary_emb`` (whitespace aside),
    and to no other: one that never calls it, one without a Python source."""
    from diffusers.models import embeddings
    from diffusers.models.attention_processor import AttnProcessor2_0

    from quantpatch.patches.diffusers.rotary import fused_rotation

    own = types.ModuleType("processor_module")  # the processor's module, without a rotation of its own
    modules, replacement = fused_rotation(_SpacedRotation(), own)
    assert modules == (embeddings,) and replacement.__name__ == "apply_rotary_emb"
    assert fused_rotation(AttnProcessor2_0(), own) == ((), None)
    assert fused_rotation(_NoSource(), own) == ((), None)


@pytest.fixture
def kernel_route(monkeypatch):
    """The replacements' kernel route on the CPU (the Triton interpreter: ``conftest.py``), from an empty plan cache;
    yields the launches, each as (heads, head_dim) of the kernel's ``(B, S, H, D)`` view."""
    from quantpatch.kernels.rotary import rotary_triton
    from quantpatch.patches.diffusers import rotary

    monkeypatch.setattr(rotary, "plain_cuda_eager", lambda *tensors: True)
    monkeypatch.setattr(rotary, "_PLANS", {})
    launch, launches = rotary_triton._LAUNCH, []

    def recording(grid, args, constexprs, **options):
        launches.append((grid[1] * constexprs["BLOCK_H"], constexprs["D"]))
        return launch(grid, args, constexprs, **options)

    monkeypatch.setattr(rotary_triton, "_LAUNCH", recording)
    return launches


def test_ltx_rotation_in_one_launch_equals_ltx_own_bit_for_bit(kernel_route):
    """The replacement's kernel route on LTX-Video's ``(B, S, C)`` query with its float32 ``(B, S, C)`` tables, in
    groups of 128 channels each with its own table rows: LTX's own ``apply_rotary_emb``, bit for bit, on the first
    call of a layout and on the next; channel counts the groups do not divide go to LTX's function."""
    from diffusers.models.transformers.transformer_ltx import apply_rotary_emb

    from quantpatch.patches.diffusers import rotary

    gen = torch.Generator().manual_seed(3)
    for channels, kernel in ((256, True), (96, False)):
        kernel_route.clear()
        for _ in range(2):
            x = (torch.randn(2, 9, channels, generator=gen) * 9).to(torch.bfloat16)
            angle = torch.randn(2, 9, channels // 2, generator=gen).repeat_interleave(2, -1) * 4
            tables = (angle.cos(), angle.sin())
            assert torch.equal(rotary.channel_rotary(apply_rotary_emb)(x, tables), apply_rotary_emb(x, tables))
        assert kernel_route == ([(channels // 128, 128)] * 2 if kernel else [])


def test_narrower_tables_go_to_diffusers_own_rotation(kernel_route):
    """Diffusers multiplies ``x.float()`` by bf16 tables in float32, where the kernel rounds the products to the
    tables' dtype: such calls are Diffusers' own even where the kernel could take them."""
    from diffusers.models.embeddings import apply_rotary_emb

    x = torch.randn(1, 2, 5, 8).to(torch.bfloat16)
    angle = torch.randn(5, 4).repeat_interleave(2, -1)
    tables = (angle.cos().to(torch.bfloat16), angle.sin().to(torch.bfloat16))
    assert torch.equal(paired_rotary(apply_rotary_emb)(x, tables), apply_rotary_emb(x, tables))
    assert kernel_route == []


def test_each_layout_is_checked_once_and_runs_bit_for_bit(kernel_route):
    """Diffusers' rotation through the replacement's kernel route, its checks and launch arguments kept by the
    layout of the call's tensors: every layout (query layout, strides, a data pointer off 16 bytes, the tables'
    length and dtype) decided on its first call, bit for bit Diffusers' own on every call, the output strided as the
    kernel's ``(B, S, H, D)`` output seen in the caller's layout."""
    from diffusers.models.embeddings import apply_rotary_emb

    from quantpatch.patches.diffusers import rotary

    gen = torch.Generator().manual_seed(5)
    fused = paired_rotary(apply_rotary_emb)

    def tables(s, dtype=torch.float32):
        angle = torch.randn(s, 4, generator=gen).repeat_interleave(2, -1) * 4
        return angle.cos().to(dtype), angle.sin().to(dtype)

    def values(*shape):
        return (torch.randn(*shape, generator=gen) * 9).to(torch.bfloat16)

    calls = [  # (x, tables, sequence_dim, a launch)
        (values(2, 5, 3, 8), tables(5), 1, True),
        (values(2, 5, 3, 8), tables(5), 1, True),  # the layout of the call before
        (values(2, 3, 5, 8), tables(5), 2, True),
        (values(2, 6, 5, 8)[:, 1:4], tables(5), 2, True),  # not dense: (B, H, S, D) heads of a larger tensor
        (values(2 * 5 * 3 * 8 + 1)[1:].view(2, 5, 3, 8), tables(5), 1, True),  # 2 bytes off 16-byte alignment
        (values(2, 7, 3, 8), tables(7), 1, True),
        (values(2, 7, 3, 8), tables(7, torch.bfloat16), 1, False),
        (values(2, 7, 3, 6), (torch.ones(7, 6), torch.zeros(7, 6)), 1, False),  # D not a power of two
    ]
    for i, (x, freqs, sequence_dim, launch) in enumerate(calls):
        kernel_route.clear()
        out = fused(x, freqs, sequence_dim=sequence_dim)
        assert torch.equal(out, apply_rotary_emb(x, freqs, sequence_dim=sequence_dim)), i
        assert kernel_route == ([(x.shape[3 - sequence_dim], 8)] if launch else []), i
        if launch:
            view = x if sequence_dim == 1 else x.transpose(1, 2)
            like = torch.empty_like(view)
            assert out.stride() == (like if sequence_dim == 1 else like.transpose(1, 2)).stride(), i
    assert len(rotary._PLANS) == len(calls) - 1


def test_wan_rotation_in_one_launch_is_the_reference(kernel_route):
    """The attention call's rotation of Wan's ``(B, S, H, D)`` query by its ``(1, S, 1, D)`` tables through the
    kernel route, on the first call of a layout and on the next: the reference of Wan's processor, bit for bit."""
    from quantpatch.patches.diffusers import rotary

    gen = torch.Generator().manual_seed(7)
    angle = torch.randn(1, 5, 1, 4, generator=gen).repeat_interleave(2, -1) * 4
    for _ in range(2):
        x = (torch.randn(2, 5, 3, 8, generator=gen) * 9).to(torch.bfloat16)
        assert torch.equal(rotary.rotate(x, angle.cos(), angle.sin()),
                           rotary.rotary_embedding_ref(x, angle.cos(), angle.sin()))
    assert kernel_route == [(3, 8)] * 2


def test_replacements_trace_into_one_graph(monkeypatch):
    """While ``torch.compile`` traces, each replacement hands its call to the model's own rotation without a graph
    break (``fullgraph=True`` raises at one): the gate that keeps the kernel to eager mode comes before any of
    the host work the kernel route does, which a trace could not follow. The gate takes CPU tensors here."""
    from diffusers.models.embeddings import apply_rotary_emb
    from diffusers.models.transformers import transformer_ltx

    from quantpatch.patches.diffusers import rotary

    monkeypatch.setattr(rotary, "plain_cuda_eager",
                        lambda *tensors: all(type(t) is torch.Tensor for t in tensors)
                        and not torch.compiler.is_compiling())
    monkeypatch.setattr(rotary, "_PLANS", {})
    x = torch.randn(1, 4, 2, 8)
    angle = torch.randn(4, 4).repeat_interleave(2, -1)
    tables = (angle.cos(), angle.sin())
    xl, ltx_tables = torch.randn(1, 4, 128), (torch.randn(1, 4, 128), torch.randn(1, 4, 128))
    cases = [
        (lambda x: paired_rotary(apply_rotary_emb)(x, tables, sequence_dim=1), x,
         lambda x: apply_rotary_emb(x, tables, sequence_dim=1)),
        (lambda x: rotary.channel_rotary(transformer_ltx.apply_rotary_emb)(x, ltx_tables), xl,
         lambda x: transformer_ltx.apply_rotary_emb(x, ltx_tables)),
        (lambda x: rotary.rotate(x, tables[0][None, :, None], tables[1][None, :, None]), x,
         lambda x: rotary.rotary_embedding_ref(x, tables[0][None, :, None], tables[1][None, :, None])),
    ]
    for replacement, arg, own in cases:
        torch._dynamo.reset()
        assert torch.equal(torch.compile(replacement, backend="eager", fullgraph=True)(arg), own(arg))
    assert rotary._PLANS == {}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("sequence_dim", [1, 2])
@pytest.mark.parametrize("tables_dtype", [torch.float32, torch.bfloat16])
def test_gpu_replacement_equals_diffusers_rotation_bit_for_bit(sequence_dim, tables_dtype):
    from diffusers.models.embeddings import apply_rotary_emb

    gen = torch.Generator(device="cuda").manual_seed(sequence_dim)
    shape = (2, 333, 24, 128) if sequence_dim == 1 else (2, 24, 333, 128)
    x = (torch.randn(shape, device="cuda", generator=gen) * 9).to(torch.bfloat16)
    angle = torch.randn(333, 64, device="cuda", generator=gen).repeat_interleave(2, -1) * 4
    tables = (angle.cos().to(tables_dtype), angle.sin().to(tables_dtype))
    replacement = paired_rotary(apply_rotary_emb)
    for y in (x, x * 3):  # the layout's first call, then its kept plan
        fused = replacement(y, tables, sequence_dim=sequence_dim)
        assert fused.stride() == y.stride()
        assert torch.equal(fused, apply_rotary_emb(y, tables, sequence_dim=sequence_dim))


@pytest.mark.gpu
@needs_cuda
def test_gpu_ltx_replacement_equals_ltx_rotation_bit_for_bit():
    from diffusers.models.transformers.transformer_ltx import apply_rotary_emb

    from quantpatch.patches.diffusers.rotary import channel_rotary

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(2, 333, 2048, device="cuda", generator=gen) * 9).to(torch.bfloat16)  # LTX-Video 2B's C
    angle = torch.randn(2, 333, 1024, device="cuda", generator=gen).repeat_interleave(2, -1) * 4
    tables = (angle.cos(), angle.sin())
    replacement = channel_rotary(apply_rotary_emb)
    for y in (x, x * 3):  # the layout's first call, then its kept plan
        assert torch.equal(replacement(y, tables), apply_rotary_emb(y, tables))
