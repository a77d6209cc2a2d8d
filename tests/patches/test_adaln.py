"""Wan's blocks with fused adaptive layer norms (``patches/diffusers/adaln.py``).

CPU, the tiny Wan transformer (``quantpatch.testing.diffusers_tiny``): the blocks are recognized by their source and
given the fused forward, which runs the blocks' own code off CUDA (bit for bit the unpatched model) and the kernels'
route in the Triton interpreter (``conftest.py``) when made to; ``remove()`` gives the blocks their class forward
back. The ``gpu`` test runs the fused route compiled on a Wan-sized block.
"""

import pytest
import torch

import quantpatch as qp
from quantpatch.dispatch import records_grad
from quantpatch.patches.diffusers import adaln
from quantpatch.testing.diffusers_tiny import tiny_transformer
from tests.gpu import needs_cuda

pytestmark = pytest.mark.usefixtures("one_cpu_thread")  # tests/conftest.py

pytest.importorskip("diffusers")


def _record_kernels(monkeypatch) -> list:
    """The kernels' calls by name, in call order."""
    from quantpatch.kernels.adaln import adaln_triton

    calls = []
    for name in ("modulated_norm", "gated_residual"):
        kernel = getattr(adaln_triton, name)

        def recording(*args, _kernel=kernel, _name=name, **kwargs):
            calls.append(_name)
            return _kernel(*args, **kwargs)

        monkeypatch.setattr(adaln_triton, name, recording)
    return calls


@pytest.fixture
def kernel_route(monkeypatch):
    """The fused forward's kernel route on the CPU (the Triton interpreter): ``plain_cuda_eager`` as on CUDA (plain
    tensors, no subclass); yields the kernels' calls by name."""
    monkeypatch.setattr(adaln, "plain_cuda_eager",
                        lambda *tensors: all(type(t) is torch.Tensor for t in tensors) and not records_grad(*tensors))
    return _record_kernels(monkeypatch)


def test_wan_blocks_are_recognized_and_others_are_not():
    wan, _ = tiny_transformer("WanTransformer3DModel")
    flux, _ = tiny_transformer("FluxTransformer2DModel")
    assert all(adaln.fusable(block) for block in wan.blocks)
    assert not any(adaln.fusable(module) for module in flux.modules())
    block = wan.blocks[0]
    block.norm1 = torch.nn.LayerNorm(block.norm1.normalized_shape, elementwise_affine=False)  # not Diffusers' fp32
    assert not adaln.fusable(block)


def test_a_block_class_whose_forward_differs_by_one_statement_is_not_fused():
    """The whole forward is compared (its syntax tree): an added statement (another Diffusers version) keeps the
    block's own forward; comments and annotations do not matter."""
    import inspect
    import textwrap

    from diffusers.models.transformers.transformer_wan import WanTransformerBlock

    source = textwrap.dedent(inspect.getsource(WanTransformerBlock.forward))
    same = source.replace("# 1. Self-attention", "# self-attention, reworded").replace(": torch.Tensor,", ",")
    doubled = "    hidden_states = hidden_states * 2\n"
    extra = source.replace("    return hidden_states", doubled + "    return hidden_states")
    assert adaln._code(same) == adaln.code_of(WanTransformerBlock.forward)
    assert extra != source and adaln._code(extra) != adaln.code_of(WanTransformerBlock.forward)
    namespace = {"torch": torch}
    exec(compile(extra, "<a later block>", "exec"), namespace)  # noqa: S102  (a class of that source, for getsource)
    later = type("LaterWanBlock", (WanTransformerBlock,), {"forward": namespace["forward"]})
    assert adaln.code_of(later.forward) is None  # compiled from a string: no source file, never fused


@pytest.mark.parametrize("mode", ["off", "sage2-8b"])
def test_off_cuda_the_fused_forward_is_the_blocks_own_and_remove_restores_them(mode, no_leaks):
    model, call = tiny_transformer("WanTransformer3DModel")
    base = call()
    with qp.patch_model(model, mode, policy="always") as handle:
        assert all("forward" in vars(block) for block in model.blocks)
        assert "2 blocks run their adaptive layer norms and gated residuals fused" in handle.report()
        patched = call()
    assert not any("forward" in vars(block) for block in model.blocks)
    if mode == "off":
        assert torch.equal(patched, base)


def test_the_kernel_route_follows_the_blocks_own_forward(kernel_route):
    """Through the kernels (interpreter), each block makes three norms and two gated residuals; the float32 output is
    the unpatched model's up to the norms' summation order."""
    model, call = tiny_transformer("WanTransformer3DModel")
    base = call()
    with qp.patch_model(model, "off", policy="always"):
        fused = call()
    per_block = ["modulated_norm", "gated_residual", "modulated_norm", "modulated_norm", "gated_residual"]
    assert kernel_route == per_block * len(model.blocks)
    assert (fused - base).abs().max() <= 1e-5 * base.abs().max()


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_block_through_the_kernels_follows_its_own_forward(dtype, per_token, kernel_route):
    """One block, its hidden states in ``dtype``; Wan2.2 TI2V's ``temb`` of shape (B, S, 6, C) (a modulation row a
    token) too: the kernels' route, within the norms' last-bit differences of the block's own output."""
    model, _ = tiny_transformer("WanTransformer3DModel")
    block = model.blocks[0].to(dtype)
    gen = torch.Generator().manual_seed(5)
    c = block.scale_shift_table.shape[-1]
    h, text = torch.randn(1, 9, c, generator=gen).to(dtype), torch.randn(1, 7, c, generator=gen).to(dtype)
    temb = torch.randn(*((1, 9, 6, c) if per_token else (1, 6, c)), generator=gen)
    with torch.no_grad():
        own = block(h, text, temb, None)
        fused = adaln._fused_forward(block)(h, text, temb, None)
    assert kernel_route.count("modulated_norm") == 3 and kernel_route.count("gated_residual") == 2
    assert fused.dtype == dtype
    if dtype == torch.float32:
        assert (fused - own).abs().max() <= 1e-5 * own.abs().max()
    else:
        assert qp.metrics.cos_sim(fused.float(), own.float()) >= 0.9999


def test_records_grad_needs_grad_mode_and_a_tensor_requiring_one():
    """The gate every one-launch kernel of the patches passes (``plain_cuda_eager``): none has a backward."""
    x, y = torch.zeros(2, requires_grad=True), torch.zeros(2)
    assert records_grad(x, y) and not records_grad(y)
    with torch.no_grad():
        assert not records_grad(x)


def test_a_gradient_to_record_takes_the_blocks_own_forward(kernel_route):
    """The kernels have no backward: with grad mode on and the block's parameters (or its input) requiring a
    gradient, the block's own forward runs and gradients reach its parameters; frozen, the kernels run."""
    model, _ = tiny_transformer("WanTransformer3DModel")
    block = model.blocks[0]
    c = block.scale_shift_table.shape[-1]
    gen = torch.Generator().manual_seed(5)
    h, text, temb = (torch.randn(*shape, generator=gen) for shape in ((1, 9, c), (1, 7, c), (1, 6, c)))
    fused = adaln._fused_forward(block)
    fused(h, text, temb, None).sum().backward()
    assert kernel_route == [] and block.scale_shift_table.grad is not None
    block.requires_grad_(False)
    assert fused(h, text, temb, None).grad_fn is None and len(kernel_route) == 5
    kernel_route.clear()
    assert fused(h.requires_grad_(), text, temb, None).grad_fn is not None and kernel_route == []


def test_a_block_with_a_forward_of_its_own_keeps_it(no_leaks):
    model, call = tiny_transformer("WanTransformer3DModel")
    hooked = model.blocks[0]
    hooked.forward = hooked.forward  # as a Diffusers hook registry leaves it: an instance attribute
    own = vars(hooked)["forward"]
    with qp.patch_model(model, "off", policy="always") as handle:
        assert vars(hooked)["forward"] is own and "forward" in vars(model.blocks[1])
        assert "1 blocks run their adaptive layer norms" in handle.report()
    assert vars(hooked)["forward"] is own


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("per_token", [False, True])
def test_gpu_a_wan_sized_block_runs_the_kernels_and_follows_its_own_forward(per_token, monkeypatch):
    """Compiled kernels on a Wan2.1-1.3B-wide block (1,536 channels, 12 heads) in bfloat16, 2,048 tokens, its norms'
    and modulation table in float32 as Wan keeps them: the fused forward takes the kernel route on its own (three
    norms, two residuals) and its output is the block's own within the norms' last-bit differences."""
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock

    torch.manual_seed(0)
    block = WanTransformerBlock(1536, 4096, 12, cross_attn_norm=True).to("cuda", torch.bfloat16).eval()
    block.norm2.float()
    block.scale_shift_table.data = block.scale_shift_table.data.float()
    gen = torch.Generator(device="cuda").manual_seed(1)
    h = torch.randn(1, 2048, 1536, device="cuda", generator=gen).to(torch.bfloat16)
    text = torch.randn(1, 512, 1536, device="cuda", generator=gen).to(torch.bfloat16)
    shape = (1, 2048, 6, 1536) if per_token else (1, 6, 1536)
    temb = torch.randn(*shape, device="cuda", generator=gen) * 0.1
    assert adaln.fusable(block)  # this machine's Diffusers has the block code the fused forward computes
    calls = _record_kernels(monkeypatch)
    with torch.no_grad():
        own = block(h, text, temb, None)
        assert not calls
        fused = adaln._fused_forward(block)(h, text, temb, None)
    assert sorted(calls) == ["gated_residual"] * 2 + ["modulated_norm"] * 3
    assert qp.metrics.cos_sim(fused.float(), own.float()) >= 0.99999
    assert (fused.float() - own.float()).abs().max() <= 0.02 * own.float().abs().max()
