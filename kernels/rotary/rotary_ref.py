"""Rotary position embedding: the pure-PyTorch references of the forms quantpatch computes in one launch.

For ``x (..., D)`` split into channel pairs ``(x₁, x₂)`` and per-position tables ``cos``, ``sin`` of ``D`` values::

    out[first of each pair] = x₁ · c₁ − x₂ · s₁        out[second of each pair] = x₁ · s₂ + x₂ · c₂

Three forms are in use (``FORMS``):

* ``"wan"`` (Wan2.1's ``WanAttnProcessor``): interleaved pairs ``x₁, x₂ = x[..., 0::2], x[..., 1::2]``;
  c₁ = c₂ = cos[..., 0::2] and s₁ = s₂ = sin[..., 1::2] (Wan's tables repeat each frequency over a pair);
* ``"paired"`` (Diffusers' ``embeddings.apply_rotary_emb`` with ``use_real=True``, ``use_real_unbind_dim=-1``:
  CogVideoX, Flux, HunyuanVideo): interleaved pairs, each output channel reading its own entry, c₁, s₁ =
  cos, sin[..., 0::2] and c₂, s₂ = cos, sin[..., 1::2];
* ``"halves"`` (Transformers' ``apply_rotary_pos_emb`` with ``rotate_half``: Llama, Mistral, Qwen2 and others):
  ``x₁, x₂ = x[..., :D/2], x[..., D/2:]``, c₁, s₁ = cos, sin[..., :D/2] and c₂, s₂ = cos, sin[..., D/2:].

Each product is rounded to the dtype of ``x · cos`` (float32 tables: float32; tables in ``x``'s dtype, as
Transformers passes them: that dtype), each sum is taken in float32 and rounded to ``x``'s dtype, and no
multiply-add is fused: ``x · cos + rotate(x) · sin`` adds ``−x₂ · s₁``, the same value. Bit for bit what the
models compute.
"""

from __future__ import annotations

import torch

FORMS = ("wan", "paired", "halves")


def rotary_embedding_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, form: str = "wan") -> torch.Tensor:
    """``x (B, S, H, D)`` (``D`` even) rotated by ``cos``, ``sin`` (float32 or ``x``'s dtype) broadcastable to
    ``(B, S, 1, D)``, in the ``form`` of :data:`FORMS`; returns a tensor like ``x`` (``torch.empty_like``)."""
    if form not in FORMS:
        raise ValueError(f"form={form!r}: one of {FORMS}")
    half = x.shape[-1] // 2
    out = torch.empty_like(x)
    if form == "halves":
        first, second = slice(0, half), slice(half, None)
        x1, x2 = x[..., first], x[..., second]
        c1, c2, s1, s2 = cos[..., first], cos[..., second], sin[..., first], sin[..., second]
    else:
        first, second = slice(0, None, 2), slice(1, None, 2)
        x1, x2 = x[..., first], x[..., second]
        if form == "wan":
            c1 = c2 = cos[..., first]
            s1 = s2 = sin[..., second]
        else:
            c1, c2, s1, s2 = cos[..., first], cos[..., second], sin[..., first], sin[..., second]
    out[..., first] = x1 * c1 - x2 * s1
    out[..., second] = x1 * s2 + x2 * c2
    return out
