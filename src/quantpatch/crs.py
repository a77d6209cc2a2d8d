"""FireQ's channel-wise RoPE scaling (CRS, §3.2.1 Stage 2) on an attention module.

``convert`` stores the factors as buffers on each attention module it calibrates (:data:`CRS_FACTORS`
``(Hkv, D)`` float32, :data:`CRS_PAIRS` ``(Hkv, P)`` int64); the patched attention applies them after RoPE
(:func:`apply_online_crs`: ``q · t``, ``k / t``). Kept apart from :mod:`quantpatch.methods.fireq` so that patching
a model does not import the conversion stack.
"""

from __future__ import annotations

import torch
from torch import nn

from quantpatch.kernels.fireq_kv.fireq_ref import apply_crs

CRS_FACTORS = "quantpatch_crs_factors"
CRS_PAIRS = "quantpatch_crs_pairs"


def add_crs_buffers(module: nn.Module, num_kv_heads: int, head_dim: int, n_pairs: int, device=None) -> None:
    """Register empty CRS buffers on an attention module (``load`` fills them)."""
    module.register_buffer(CRS_FACTORS, torch.ones(num_kv_heads, head_dim, dtype=torch.float32, device=device))
    module.register_buffer(CRS_PAIRS, torch.zeros(num_kv_heads, n_pairs, dtype=torch.long, device=device))


def crs_buffers(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(factors (Hkv, D), pairs (Hkv, P))`` stored on an attention module by ``convert``, or None."""
    t = getattr(module, CRS_FACTORS, None)
    return None if t is None else (t, getattr(module, CRS_PAIRS))


def apply_online_crs(q: torch.Tensor, k: torch.Tensor, factors: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Post-RoPE CRS: ``(q · t, k / t)`` with ``t (Hkv, D)`` (GQA: query head ``h`` uses KV head ``h // G``)."""
    if factors is None:
        return q, k
    if factors.shape[0] != k.shape[1]:
        raise ValueError(f"CRS factors of {factors.shape[0]} KV heads for a call over {k.shape[1]} KV heads: the "
                         "model's heads are split in a way the fireq conversion does not know")
    dtype = torch.promote_types(q.dtype, torch.float32)  # at least float32 for the scaling
    q2, k2 = apply_crs(q.to(dtype), k.to(dtype), factors.to(device=q.device, dtype=dtype))
    return q2.to(q.dtype), k2.to(k.dtype)
