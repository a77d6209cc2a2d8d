"""Wan2.1's transformer blocks with their adaptive layer norms and gated residuals in one launch each.

``WanTransformerBlock.forward`` normalizes and modulates the hidden states in float32 before its self-attention and
its feed-forward, adds their gated outputs back in float32 and normalizes again before its cross-attention: about
twenty elementwise kernels a block over float32 intermediates, about 9 GB of memory traffic a block at Wan2.1-1.3B's
480p (32,760 tokens of 1,536 channels), a fifth of a step's GPU time. Where a block class's ``forward`` is exactly
that code (:func:`fusable`: the same syntax tree), :func:`fuse_blocks` gives each of its blocks a forward that runs the
same code with each modulated norm and gated residual as one launch of
:mod:`~quantpatch.kernels.adaln.adaln_triton` (1.5 GB a block) on plain CUDA tensors in eager mode, and the block's
own forward otherwise (CPU, ``torch.compile``, tensors the kernels do not take, a gradient to record: the kernels
have no backward). The gated residuals are bit for bit
the block's; the norms' mean and variance are summed in another order than PyTorch's layer norm, so an element of a
norm's bfloat16 output may differ from the block's by one unit in its last place (at most one element in a
thousand in the GPU test at Wan2.1-1.3B's width; :mod:`~quantpatch.kernels.adaln.adaln_triton`).

A block whose ``forward`` is already an attribute of its own (a Diffusers hook, another patch) keeps it.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from typing import Any

import torch

from quantpatch.dispatch import records_grad
from quantpatch.patches import plain_cuda_eager

# The block code fuse_blocks' forward computes: Diffusers 0.42's WanTransformerBlock.forward, its modulation table
# chunked as Wan2.1 (a row a sample) and Wan2.2 TI2V (a row a token) chunk it. A class forward whose parameters and
# statements (comments, annotations and layout aside: their syntax trees) are not exactly these keeps its own.
_WAN_BLOCK_FORWARD = """
def forward(self, hidden_states, encoder_hidden_states, temb, rotary_emb):
    if temb.ndim == 4:
        shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = (
            self.scale_shift_table.unsqueeze(0) + temb.float()
        ).chunk(6, dim=2)
        shift_msa = shift_msa.squeeze(2)
        scale_msa = scale_msa.squeeze(2)
        gate_msa = gate_msa.squeeze(2)
        c_shift_msa = c_shift_msa.squeeze(2)
        c_scale_msa = c_scale_msa.squeeze(2)
        c_gate_msa = c_gate_msa.squeeze(2)
    else:
        shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = (
            self.scale_shift_table + temb.float()
        ).chunk(6, dim=1)
    norm_hidden_states = (self.norm1(hidden_states.float()) * (1 + scale_msa) + shift_msa).type_as(hidden_states)
    attn_output = self.attn1(norm_hidden_states, None, None, rotary_emb)
    hidden_states = (hidden_states.float() + attn_output * gate_msa).type_as(hidden_states)
    norm_hidden_states = self.norm2(hidden_states.float()).type_as(hidden_states)
    attn_output = self.attn2(norm_hidden_states, encoder_hidden_states, None, None)
    hidden_states = hidden_states + attn_output
    norm_hidden_states = (self.norm3(hidden_states.float()) * (1 + c_scale_msa) + c_shift_msa).type_as(hidden_states)
    ff_output = self.ffn(norm_hidden_states)
    hidden_states = (hidden_states.float() + ff_output.float() * c_gate_msa).type_as(hidden_states)
    return hidden_states
"""


@functools.cache
def _is_wan_block_class(cls: type) -> bool:
    return code_of(cls.forward) == _code(_WAN_BLOCK_FORWARD)


def code_of(function: Any) -> tuple | None:
    """``function``'s parameter names and the syntax tree of its body (no comments, annotations, docstring position
    or layout), or None where it has no source."""
    try:
        source = textwrap.dedent(inspect.getsource(function))
    except (OSError, TypeError):
        return None
    return _code(source)


def _code(source: str) -> tuple | None:
    tree = ast.parse(source).body
    if len(tree) != 1 or not isinstance(tree[0], ast.FunctionDef):
        return None
    fn = tree[0]
    return [a.arg for a in fn.args.args], ast.dump(ast.Module(body=fn.body, type_ignores=[]))


_NORM_CLASSES = ("FP32LayerNorm",)  # Diffusers' float32 layer norm: F.layer_norm(x.float(), ...).to(x.dtype)


def fusable(block: Any) -> bool:
    """Whether ``block``'s class forward is Wan2.1's block code (:data:`_WAN_BLOCK_FORWARD`, :func:`code_of`) and its
    norms are float32 layer norms over the channels (``norm2`` may be ``nn.Identity``)."""
    norms = [getattr(block, name, None) for name in ("norm1", "norm2", "norm3")]
    if any(n is None for n in norms) or not _is_wan_block_class(type(block)):
        return False
    if not all(_norm_taken(n) for n in norms):
        return False
    table = getattr(block, "scale_shift_table", None)
    if not isinstance(table, torch.Tensor) or table.dim() < 2 or table.shape[-2] != 6:
        return False
    return all(isinstance(n, torch.nn.Identity) or tuple(n.normalized_shape) == (table.shape[-1],) for n in norms)


def _norm_taken(norm: Any) -> bool:
    """Whether the fused forward computes ``norm``: ``nn.Identity``, or a float32 layer norm over one dim with both
    affine parameters or neither."""
    if isinstance(norm, torch.nn.Identity):
        return True
    return (type(norm).__name__ in _NORM_CLASSES and len(norm.normalized_shape) == 1
            and (norm.weight is None) == (norm.bias is None))


def fuse_blocks(transformer: torch.nn.Module, handle: Any) -> int:
    """Give every :func:`fusable` block of ``transformer`` the fused forward (recorded in ``handle``, undone by its
    ``remove()``); returns how many blocks were given it."""
    fused = 0
    for block in transformer.modules():
        if "forward" in vars(block) or not fusable(block):
            continue
        handle.setattr(block, "forward", _fused_forward(block))
        fused += 1
    return fused


def _fused_forward(block: torch.nn.Module):
    """``block``'s forward with its norms and gated residuals fused (module docstring); its own where the kernels do
    not take the call's tensors."""
    from quantpatch.kernels.adaln.adaln_ref import gated_residual_ref
    from quantpatch.kernels.adaln.adaln_triton import adaln_unsupported, gated_residual, modulated_norm

    own = type(block).forward.__get__(block)

    def norm(name: str, h: torch.Tensor, scale: torch.Tensor | None, shift: torch.Tensor | None) -> torch.Tensor:
        module = getattr(block, name)
        if isinstance(module, torch.nn.Identity):
            return h
        return modulated_norm(h, module.eps, _float(module.weight), _float(module.bias), scale, shift)

    def residual(h: torch.Tensor, branch: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        # (h.float() + branch.float() * gate).type_as(h), in one launch where the kernel takes the branch's layout
        if adaln_unsupported(h, branch=branch) is None:
            return gated_residual(h, branch, gate)
        return gated_residual_ref(h, branch, gate)

    def forward(hidden_states, encoder_hidden_states, temb, rotary_emb):
        if not plain_cuda_eager(hidden_states, temb) or (torch.is_grad_enabled()
                                                          and records_grad(*block.parameters())):
            return own(hidden_states, encoder_hidden_states, temb, rotary_emb)
        if temb.ndim == 4:  # a modulation row a token (Wan2.2 TI2V)
            rows = [r.squeeze(2) for r in (block.scale_shift_table.unsqueeze(0) + temb.float()).chunk(6, dim=2)]
        else:
            rows = list((block.scale_shift_table + temb.float()).chunk(6, dim=1))
        if adaln_unsupported(hidden_states, modulation=tuple(rows)) is not None:
            return own(hidden_states, encoder_hidden_states, temb, rotary_emb)
        shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = rows
        attn_output = block.attn1(norm("norm1", hidden_states, scale_msa, shift_msa), None, None, rotary_emb)
        hidden_states = residual(hidden_states, attn_output, gate_msa)
        attn_output = block.attn2(norm("norm2", hidden_states, None, None), encoder_hidden_states, None, None)
        hidden_states = hidden_states + attn_output
        ff_output = block.ffn(norm("norm3", hidden_states, c_scale_msa, c_shift_msa))
        return residual(hidden_states, ff_output, c_gate_msa)

    return forward


def _float(parameter: torch.Tensor | None) -> torch.Tensor | None:
    """A norm's affine parameter as the layer norm reads it (``FP32LayerNorm`` casts it to float32)."""
    return None if parameter is None else parameter.float()
