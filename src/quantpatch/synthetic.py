"""Synthetic attention inputs shared by tests, the accuracy harness and the benchmarks.

Distributions:
  * ``randn``: Q, K, V ~ N(0, 1) (FlashAttention / SageAttention2 App. A.8 benchmarks).
  * ``uniform``: U(−0.5, 0.5) (INT-FlashAttention Table 2).
  * ``outliers``: the channel structure real LLM and DiT activations show (SageAttention2
    Fig. 2, TurboAttention Fig. 4): every channel of Q and K carries a bias shared by all
    tokens (std ``QK_BIAS_STD``), ``N_LARGE`` channels of K are ``LARGE_GAIN``× larger than the
    rest (and half as much for Q), and V carries a per-channel bias (std ``V_BIAS_STD``).
"""

from __future__ import annotations

import torch

QK_BIAS_STD = 2.0
N_LARGE = 4
LARGE_GAIN = 8.0
V_BIAS_STD = 4.0
KINDS = ("randn", "uniform", "outliers")


def attention_inputs(
    kind: str,
    *,
    batch: int = 1,
    heads: int = 4,
    kv_heads: int | None = None,
    seq_q: int = 1024,
    seq_k: int | None = None,
    head_dim: int = 128,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q (B, H, Nq, D)``, ``k``/``v`` ``(B, Hkv, Nk, D)`` drawn from distribution ``kind``."""
    if kind not in KINDS:
        raise ValueError(f"unknown input kind {kind!r}; valid: {list(KINDS)}")
    kv_heads = heads if kv_heads is None else kv_heads
    seq_k = seq_q if seq_k is None else seq_k
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape):
        if kind == "uniform":
            return torch.rand(*shape, generator=gen) - 0.5
        return torch.randn(*shape, generator=gen)

    q = draw(batch, heads, seq_q, head_dim)
    k = draw(batch, kv_heads, seq_k, head_dim)
    v = draw(batch, kv_heads, seq_k, head_dim)
    if kind == "outliers":
        q = q + QK_BIAS_STD * torch.randn(batch, heads, 1, head_dim, generator=gen)
        k = k + QK_BIAS_STD * torch.randn(batch, kv_heads, 1, head_dim, generator=gen)
        large = torch.randperm(head_dim, generator=gen)[:N_LARGE]
        k[..., large] *= LARGE_GAIN
        q[..., large] *= LARGE_GAIN / 2
        v = v + V_BIAS_STD * torch.randn(batch, kv_heads, 1, head_dim, generator=gen)
    return tuple(t.to(device=device, dtype=dtype) for t in (q, k, v))
