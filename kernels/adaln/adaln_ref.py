"""Adaptive layer norm of a diffusion transformer block, as Wan2.1's ``WanTransformerBlock`` computes it: the
pure-PyTorch references of what :mod:`~quantpatch.kernels.adaln.adaln_triton` computes in one launch.

For hidden states ``h (B, S, C)``, float32 modulation rows ``scale``, ``shift``, ``gate`` of shape ``(B, 1, C)`` (one
a sample) or ``(B, S, C)`` (one a token) and a branch output ``a (B, S, C)``::

    modulated_norm(h) = dtype_h( LN(float32(h)) · (1 + scale) + shift )
    gated_residual(h, a, gate) = dtype_h( float32(h) + float32(a) · gate )

``LN`` is the layer norm over ``C`` (``eps``, an optional float32 affine ``weight``, ``bias``); without ``scale``
and ``shift`` the norm alone is taken. Each product and sum is rounded to float32 in that order (no fused
multiply-add) and the result once to ``h``'s dtype: the block's lines
``(self.norm1(hidden_states.float()) * (1 + scale_msa) + shift_msa).type_as(hidden_states)`` and
``(hidden_states.float() + attn_output * gate_msa).type_as(hidden_states)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def modulated_norm_ref(h: torch.Tensor, eps: float, weight: torch.Tensor | None = None,
                       bias: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                       shift: torch.Tensor | None = None) -> torch.Tensor:
    """``dtype_h(LN(float32(h)) · (1 + scale) + shift)`` (module docstring); ``h (B, S, C)`` → like ``h``."""
    y = F.layer_norm(h.float(), (h.shape[-1],), None if weight is None else weight.float(),
                     None if bias is None else bias.float(), eps)
    if scale is not None:
        y = y * (1 + scale) + shift
    return y.to(h.dtype)


def gated_residual_ref(h: torch.Tensor, a: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``dtype_h(float32(h) + float32(a) · gate)``; ``h``, ``a`` ``(B, S, C)``, ``gate`` ``(B, 1 or S, C)`` float32."""
    return (h.float() + a.float() * gate).to(h.dtype)
