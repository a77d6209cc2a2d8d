"""Adaptive layer norm (Triton) against ``adaln_ref``: the gated residual bit for bit, the modulated norm within a
unit in the last place of its output dtype plus float32 summation noise, on a small fraction of elements (its mean
and variance are summed in another order than PyTorch's layer norm); the references against float64.

Without CUDA the kernels run in the Triton interpreter (``conftest.py``); the ``gpu``-marked test runs them compiled,
where ``enable_fp_fusion=False`` must keep each product and sum rounded to float32 as PyTorch's kernels round them.
"""

import pytest
import torch
import torch.nn.functional as F

from quantpatch.kernels.adaln.adaln_ref import gated_residual_ref, modulated_norm_ref
from quantpatch.kernels.adaln.adaln_triton import MAX_CHANNELS, adaln_unsupported, gated_residual, modulated_norm
from tests.gpu import needs_cuda

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _block_inputs(b: int, s: int, c: int, dtype: torch.dtype, per_token: bool = False, device: str = "cpu"):
    """Hidden states with an offset and outlier channels (as a DiT's residual stream), a branch output, and the
    block's float32 modulation rows as views of one ``(B, 6, C)`` (or ``(B, S, 6, C)``) table, as Wan chunks it."""
    gen = torch.Generator().manual_seed(b * 100 + s * 10 + c)
    h = torch.randn(b, s, c, generator=gen) * 3 + 0.5
    h[..., :: max(1, c // 7)] *= 40
    branch = torch.randn(b, s, c, generator=gen)
    table = torch.randn(b, s, 6, c, generator=gen) * 0.3 if per_token else torch.randn(b, 6, c, generator=gen) * 0.3
    rows = [r.squeeze(2) for r in table.chunk(6, dim=2)] if per_token else list(table.chunk(6, dim=1))
    return h.to(device, dtype), branch.to(device, dtype), [r.to(device) for r in rows]


def _norm_terms(h: torch.Tensor) -> torch.Tensor:
    """The magnitudes a normalized element's float32 error scales with: ``(|h| + |mean|) / std`` of its row."""
    x = h.double()
    return (x.abs() + x.mean(-1, keepdim=True).abs()) / (x.var(-1, unbiased=False, keepdim=True) + 1e-6).sqrt()


def _assert_norm_close(out: torch.Tensor, ref: torch.Tensor, terms: torch.Tensor, rare: float = 0.01) -> None:
    """``out`` and the reference ``ref`` differ by at most a unit in the last place of their dtype plus the float32
    noise of summing in another order (``terms``: the magnitudes the float32 result was summed from), and in a
    narrower dtype than float32 on at most a ``rare`` fraction of elements."""
    spacing = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2.0**-23}[ref.dtype]
    bound = ref.double().abs() * spacing + 16 * 2.0**-23 * terms
    assert ((out.double() - ref.double()).abs() <= bound).all()
    if ref.dtype != torch.float32:
        assert (out != ref).float().mean() <= rare


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("shape", [(1, 5, 96), (2, 3, 1536), (1, 2, 5120)])
def test_gated_residual_equals_the_reference_bit_for_bit(shape, dtype, per_token):
    h, branch, rows = _block_inputs(*shape, dtype, per_token)
    out = gated_residual(h, branch, rows[2])
    assert out.dtype == dtype and torch.equal(out, gated_residual_ref(h, branch, rows[2]))
    branch32 = branch.float()  # a float32 branch (Wan's feed-forward output cast with .float()) reads the same
    assert torch.equal(gated_residual(h, branch32, rows[2]), out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("shape", [(1, 5, 96), (2, 3, 1536), (1, 2, 5120)])
def test_modulated_norm_is_the_reference_but_for_boundary_roundings(shape, dtype, per_token):
    h, _, rows = _block_inputs(*shape, dtype, per_token)
    shift, scale = rows[0], rows[1]
    out = modulated_norm(h, 1e-6, scale=scale, shift=shift)
    ref = modulated_norm_ref(h, 1e-6, scale=scale, shift=shift)
    normed = F.layer_norm(h.double(), h.shape[-1:], eps=1e-6)
    assert out.dtype == dtype and out.shape == h.shape
    _assert_norm_close(out, ref, _norm_terms(h) * (1 + scale.double()).abs() + shift.double().abs())
    # against float64: as close as the float32 reference
    exact = normed * (1 + scale.double()) + shift.double()
    assert (out.double() - exact).abs().max() <= 2 * (ref.double() - exact).abs().max() + 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_modulated_norm_with_an_affine_norm_and_without_modulation(dtype):
    """Wan's cross-attention norm: a layer norm with float32 weight and bias, then the cast, no modulation."""
    h, _, _ = _block_inputs(2, 7, 384, dtype)
    gen = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(384, generator=gen), torch.randn(384, generator=gen)
    out = modulated_norm(h, 1e-6, weight, bias)
    ref = modulated_norm_ref(h, 1e-6, weight, bias)
    _assert_norm_close(out, ref, _norm_terms(h) * weight.double().abs() + bias.double().abs())
    assert not torch.equal(out, modulated_norm(h, 1e-6))  # the affine is applied


def test_references_are_the_wan_block_lines():
    """The references compute Wan2.1's ``WanTransformerBlock`` expressions, ``FP32LayerNorm`` included."""
    pytest.importorskip("diffusers", reason="diffusers (an optional test asset) is not installed")
    from diffusers.models.normalization import FP32LayerNorm

    h, branch, (shift, scale, gate, *_) = _block_inputs(2, 4, 64, torch.bfloat16)
    norm = FP32LayerNorm(64, 1e-6, elementwise_affine=False)
    assert torch.equal(modulated_norm_ref(h, 1e-6, scale=scale, shift=shift),
                       (norm(h.float()) * (1 + scale) + shift).type_as(h))
    assert torch.equal(gated_residual_ref(h, branch, gate), (h.float() + branch * gate).type_as(h))


def test_unsupported_inputs_are_named():
    h, branch, rows = _block_inputs(1, 3, 64, torch.bfloat16)
    assert adaln_unsupported(h, branch=branch, modulation=(rows[2],)) is None
    assert "C <= 16384" in adaln_unsupported(torch.zeros(1, 2, MAX_CHANNELS + 1))
    assert "contiguous" in adaln_unsupported(torch.zeros(3, 2, 64).transpose(0, 1))
    assert "float32" in adaln_unsupported(h, modulation=(rows[2].to(torch.bfloat16),))
    h2, _, rows2 = _block_inputs(2, 3, 64, torch.bfloat16)
    assert "same strides" in adaln_unsupported(h2, modulation=(rows2[0], rows2[1].contiguous()))
    with pytest.raises(ValueError, match="the branch must be a contiguous"):
        gated_residual(h, branch[:, :2], rows[2])
    with pytest.raises(ValueError, match="both or neither"):
        modulated_norm(h, 1e-6, scale=rows[1])
    assert modulated_norm(h[:, :0], 1e-6).shape == (1, 0, 64)  # no rows: no launch


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("per_token", [False, True])
def test_compiled_kernels_on_a_wan_sized_block(per_token):
    """Compiled (FMA contraction off): the gated residual bit for bit, the norm within one bfloat16 unit on at most
    a few elements in ten thousand, at Wan2.1-1.3B's width."""
    h, branch, rows = _block_inputs(1, 4096, 1536, torch.bfloat16, per_token, device="cuda")
    assert torch.equal(gated_residual(h, branch, rows[2]), gated_residual_ref(h, branch, rows[2]))
    shift, scale = rows[0], rows[1]
    _assert_norm_close(modulated_norm(h, 1e-6, scale=scale, shift=shift),
                       modulated_norm_ref(h, 1e-6, scale=scale, shift=shift),
                       _norm_terms(h) * (1 + scale.double()).abs() + shift.double().abs(), rare=1e-3)
