"""Rotary position embedding over interleaved channel pairs: the pure-PyTorch references.

For ``x (..., D)`` with channel pairs ``(x₁, x₂) = (x[..., 0::2], x[..., 1::2])`` and per-position tables ``cos``,
``sin`` of ``D`` float32 values each, two readings of the tables are in use::

    out[..., 0::2] = x₁ · c₁ − x₂ · s₁        out[..., 1::2] = x₁ · s₂ + x₂ · c₂

* ``"wan"`` (Wan2.1's ``WanAttnProcessor``): c₁ = c₂ = cos[..., 0::2], s₁ = s₂ = sin[..., 1::2];
* ``"paired"`` (Diffusers' ``embeddings.apply_rotary_emb`` with ``use_real=True``, ``use_real_unbind_dim=-1``:
  CogVideoX, Flux, HunyuanVideo): each output channel reads its own entry, c₁, s₁ = cos, sin[..., 0::2] and
  c₂, s₂ = cos, sin[..., 1::2].

Each product and each sum is rounded to float32 (no fused multiply-add), the result to ``x``'s dtype (Diffusers'
``x.float() · cos + rotate(x).float() · sin`` adds ``−x₂ · s₁``, the same float32 value): bit for bit what the
processors compute.
"""

from __future__ import annotations

import torch

TABLES = ("wan", "paired")


def rotary_interleaved_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, tables: str = "wan") -> torch.Tensor:
    """``x (B, S, H, D)`` (any float dtype, ``D`` even) rotated by ``cos``, ``sin`` float32 broadcastable to
    ``(B, S, 1, D)``, read as ``tables`` says; returns a tensor like ``x`` (``torch.empty_like``)."""
    if tables not in TABLES:
        raise ValueError(f"tables={tables!r}: one of {TABLES}")
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    if tables == "wan":
        c1 = c2 = cos[..., 0::2]
        s1 = s2 = sin[..., 1::2]
    else:
        c1, c2, s1, s2 = cos[..., 0::2], cos[..., 1::2], sin[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * c1 - x2 * s1
    out[..., 1::2] = x1 * s2 + x2 * c2
    return out
