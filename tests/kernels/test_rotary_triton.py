"""Interleaved-pair rotary embedding (Triton) against ``rotary_ref.rotary_embedding_ref``, bit for bit, under both
readings of the tables; the ``"paired"`` one against Diffusers' own ``apply_rotary_emb`` too.

Without CUDA the kernel runs in the Triton interpreter (``conftest.py``); the ``gpu``-marked test runs it compiled,
where ``enable_fp_fusion=False`` must keep each product and sum rounded to float32 as PyTorch's elementwise kernels
round them (a fused multiply-add would change low bits).
"""

import pytest
import torch

from quantpatch.kernels.rotary.rotary_ref import FORMS, rotary_embedding_ref
from quantpatch.kernels.rotary.rotary_triton import TOKENS, RotaryPlan, rotary_embedding, rotary_unsupported
from tests.gpu import DEVICE, needs_cuda

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _inputs(b: int, s: int, h: int, d: int, dtype: torch.dtype, table_batch: int = 1, device: str = "cpu"):
    """``x (b, s, h, d)`` of large values (products round in float32's low bits) and Wan-style tables: one angle a
    channel pair, repeated over the pair, as ``freqs_cos`` / ``freqs_sin`` (table_batch, s, 1, d)."""
    gen = torch.Generator().manual_seed(b * 1000 + s * 10 + h)
    x = (torch.randn(b, s, h, d, generator=gen) * 37).to(dtype)
    angle = (torch.randn(table_batch, s, 1, d // 2, generator=gen) * 3).repeat_interleave(2, -1)
    return x.to(device), angle.cos().to(device), angle.sin().to(device)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * TOKENS + 1, 3, 16), (2, 5, 4, 8), (1, 3, 1, 64)])
def test_kernel_equals_reference_bit_for_bit(shape, dtype, form):
    x, cos, sin = _inputs(*shape, dtype)
    # tables whose two entries of a pair differ, so that the two readings differ
    cos, sin = cos * torch.linspace(0.5, 1.0, cos.shape[-1]), sin * torch.linspace(1.0, 0.7, sin.shape[-1])
    out = rotary_embedding(x, cos, sin, form)
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.equal(out, rotary_embedding_ref(x, cos, sin, form))
    assert not torch.equal(out, rotary_embedding_ref(x, cos, sin, "paired" if form == "wan" else "wan"))


@pytest.mark.parametrize("sequence_dim", [1, 2])
def test_paired_tables_are_diffusers_apply_rotary_emb(sequence_dim):
    embeddings = pytest.importorskip("diffusers.models.embeddings")
    x, cos, sin = _inputs(2, 7, 3, 16, torch.bfloat16)
    tables = (cos[0, :, 0], sin[0, :, 0])  # (S, D), as Diffusers passes them
    layout = x if sequence_dim == 1 else x.transpose(1, 2).contiguous()  # (B, S, H, D) or (B, H, S, D)
    expected = embeddings.apply_rotary_emb(layout, tables, use_real=True, use_real_unbind_dim=-1,
                                           sequence_dim=sequence_dim)
    got = rotary_embedding(x, cos, sin, "paired")
    assert torch.equal(got if sequence_dim == 1 else got.transpose(1, 2), expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_halves_with_tables_in_the_input_dtype_are_transformers_apply_rotary_pos_emb(dtype):
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    x, cos, sin = _inputs(2, 9, 4, 32, dtype)
    q, k = x.transpose(1, 2), (x[:, :, :2] * 0.5).transpose(1, 2)  # (B, H, S, D) views, as Llama makes them
    cos, sin = (torch.cat([t[:, :, 0, :16]] * 2, -1).expand(2, -1, -1).to(dtype) for t in (cos, sin))  # (B, S, D)
    q_ref, k_ref = llama.apply_rotary_pos_emb(q, k, cos, sin)
    for got, ref, t in ((q, q_ref, q), (k, k_ref, k)):
        out = rotary_embedding(t.transpose(1, 2), cos[:, :, None], sin[:, :, None], "halves").transpose(1, 2)
        assert torch.equal(out, ref)
    if dtype != torch.float32:  # the products round to the tables' dtype: float32 tables give other bits
        wide = rotary_embedding(q.transpose(1, 2), cos[:, :, None].float(), sin[:, :, None].float(), "halves")
        assert not torch.equal(wide.transpose(1, 2), q_ref)


def test_strided_inputs_and_per_batch_tables():
    x, cos, sin = _inputs(2, 6, 3, 16, torch.bfloat16, table_batch=2)
    bhsd = x.transpose(1, 2).contiguous()  # a (B, S, H, D) view of a (B, H, S, D) tensor, as an SDPA call holds it
    view = bhsd.transpose(1, 2)
    out = rotary_embedding(view, cos, sin)
    assert out.stride() == view.stride()  # like the reference's torch.empty_like
    assert torch.equal(out, rotary_embedding_ref(view, cos, sin))
    assert torch.equal(out, rotary_embedding_ref(x, cos, sin))
    assert not torch.equal(rotary_embedding(x, cos[:1], sin[:1]), out)  # the second batch entry has its own table


def test_bfloat16_rounds_to_nearest_even():
    # x₁ = 1 and cos = 1 + 2⁻⁸ (a tie between bfloat16's 1 and 1 + 2⁻⁷: even is 1), then 1 + 3·2⁻⁸ (even: 1 + 2⁻⁶)
    x = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.bfloat16).reshape(1, 1, 1, 4)
    cos = torch.tensor([1.0 + 2.0**-8] * 2 + [1.0 + 3 * 2.0**-8] * 2).reshape(1, 1, 1, 4)
    sin = torch.zeros(1, 1, 1, 4)
    out = rotary_embedding(x, cos, sin)
    assert out.float().flatten().tolist()[0::2] == [1.0, 1.0 + 2.0**-6]
    assert torch.equal(out, rotary_embedding_ref(x, cos, sin))


@pytest.mark.parametrize("form", FORMS)
def test_a_table_row_per_head(form):
    """Tables of shape (B, S, H, D): each head rotated by its own rows, as the reference broadcasts them."""
    x, cos, sin = _inputs(2, 5, 4, 16, torch.bfloat16)
    gen = torch.Generator().manual_seed(9)
    angle = torch.randn(2, 5, 4, 16, generator=gen) * 3
    cos, sin = angle.cos(), angle.sin()
    out = rotary_embedding(x, cos, sin, form)
    assert torch.equal(out, rotary_embedding_ref(x, cos, sin, form))
    assert not torch.equal(out, rotary_embedding_ref(x, cos[:, :, :1], sin[:, :, :1], form))


def test_a_plan_made_from_views_rotates_the_tensors_they_view():
    """A plan made once from ``(B, S, H, D)`` views of ``(B, H, S, D)`` tensors and ``(S, D)`` tables, then called
    with the tensors themselves (new values, the same layout): the reference of the views, bit for bit, the output
    back in the callers' layout and strided like the tensor (dense) or as the kernel's output (not dense)."""
    gen = torch.Generator().manual_seed(4)
    cos, sin = torch.randn(2, 6, 16, generator=gen).unbind()  # (S, D) tables as Diffusers passes them
    tables = cos[None, :, None], sin[None, :, None]
    for heads in (3, 5):  # the three heads of a dense tensor, the first three of a larger one
        def make():
            return torch.randn(2, heads, 6, 16, generator=gen)[:, :3].to(torch.bfloat16)

        plan = RotaryPlan(make().transpose(1, 2), *tables, "paired", lambda t: t.transpose(1, 2))
        for _ in range(2):
            x = make()
            out = plan(x, cos, sin)
            assert torch.equal(out, rotary_embedding_ref(x.transpose(1, 2), *tables, "paired").transpose(1, 2))
            expected = x if heads == 3 else torch.empty_like(x.transpose(1, 2)).transpose(1, 2)
            assert out.stride() == expected.stride()


@pytest.mark.parametrize("bad, needle", [
    (lambda x, c, s: (x[..., :12], c[..., :12], s[..., :12]), "power of two"),
    (lambda x, c, s: (x, c.double(), s), "float32"),
    (lambda x, c, s: (x, c[:, :2], s[:, :2]), "shape"),
    (lambda x, c, s: (x.transpose(-1, -2), c, s), "contiguous channels"),
])
def test_unsupported_inputs_are_named(bad, needle):
    x, cos, sin = _inputs(1, 4, 16, 16, torch.bfloat16)
    args = bad(x, cos, sin)
    reason = rotary_unsupported(*args)
    assert reason is not None and needle in reason
    with pytest.raises(ValueError, match=needle):
        rotary_embedding(*args)


def test_unknown_tables_are_named():
    with pytest.raises(ValueError, match="form=.rope."):
        rotary_embedding(*_inputs(1, 4, 2, 16, torch.bfloat16), "rope")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_kernel_equals_reference_bit_for_bit(dtype, form):
    # Wan2.1-1.3B's head layout (12 heads of 128) at a few hundred tokens, and a tail
    x, cos, sin = _inputs(2, 333, 12, 128, dtype, device=DEVICE)
    out = rotary_embedding(x, cos, sin, form)
    assert torch.equal(out, rotary_embedding_ref(x, cos, sin, form))
    assert torch.equal(out.cpu(), rotary_embedding_ref(x.cpu(), cos.cpu(), sin.cpu(), form))
    plan = RotaryPlan(x, cos, sin, form)  # its first call compiles or finds the kernel, the second relaunches it
    for scale in (1, 3):
        assert torch.equal(plan(x * scale, cos, sin), rotary_embedding_ref(x * scale, cos, sin, form))
