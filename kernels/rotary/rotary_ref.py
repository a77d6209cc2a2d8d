"""Rotary position embedding over interleaved channel pairs: the pure-PyTorch reference.

For ``x (..., D)`` with channel pairs ``(x₁, x₂) = (x[..., 0::2], x[..., 1::2])`` and per-position tables
``cos``, ``sin`` of ``D`` float32 values each (Wan2.1's ``freqs_cos`` / ``freqs_sin``, whose pairs repeat one
frequency; the even entries of ``cos`` and the odd ones of ``sin`` are read)::

    out[..., 0::2] = x₁ · cos[..., 0::2] − x₂ · sin[..., 1::2]
    out[..., 1::2] = x₁ · sin[..., 1::2] + x₂ · cos[..., 0::2]

each product and each sum rounded to float32 (no fused multiply-add), the result rounded to ``x``'s dtype: the
arithmetic of Diffusers' ``WanAttnProcessor``, so its output is bit for bit the processor's own.
"""

from __future__ import annotations

import torch


def rotary_interleaved_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x (B, S, H, D)`` (any float dtype, ``D`` even) rotated by ``cos``, ``sin`` float32 broadcastable to
    ``(B, S, 1, D)``; returns a tensor like ``x``."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * c - x2 * s
    out[..., 1::2] = x1 * s + x2 * c
    return out
