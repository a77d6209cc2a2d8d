"""Reference attention: the exact float64 product and the blocked online-softmax driver.

Every quantized mode is a subclass of :class:`BlockedAttention` that says how a key block's
scores are formed, which exponential is used, and how P̃·V is quantized and accumulated; the
loop over key blocks (FlashAttention-2 online softmax, all query rows at once) is shared.

Layout: ``q (B, H, Nq, D)``, ``k``/``v`` ``(B, Hkv, Nk, D)`` with ``H % Hkv == 0`` (GQA).
Causal masks are bottom-right aligned: query ``i`` sees keys ``j <= i + Nk - Nq``.
"""

from __future__ import annotations

import math

import torch


def expand_kv(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Repeat KV heads ``(B, Hkv, N, D)`` to ``(B, n_heads, N, D)`` for grouped-query attention."""
    rep = n_heads // x.shape[1]
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def causal_allowed(nq: int, nk: int, k_start: int, k_end: int, device) -> torch.Tensor:
    """Boolean ``(Nq, k_end - k_start)``: True where a query may attend (bottom-right causal)."""
    rows = torch.arange(nq, device=device).unsqueeze(1) + (nk - nq)
    cols = torch.arange(k_start, k_end, device=device).unsqueeze(0)
    return cols <= rows


def additive_mask(attn_mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """Turn an SDPA-style mask (bool: True = keep, or additive float) into an additive float mask."""
    if attn_mask is None:
        return None
    if attn_mask.dtype == torch.bool:
        zero = torch.zeros((), dtype=dtype, device=attn_mask.device)
        return torch.where(attn_mask, zero, torch.tensor(float("-inf"), dtype=dtype, device=attn_mask.device))
    return attn_mask.to(dtype)


def attention_exact(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    attn_mask: torch.Tensor | None = None,
    return_lse: bool = False,
    dtype: torch.dtype = torch.float64,
):
    """Full-precision attention in ``dtype`` (float64 by default): the ground truth.

    Returns ``o (B, H, Nq, Dv)`` in ``dtype`` (and ``lse (B, H, Nq)`` if asked). Rows with
    no visible key give zeros and ``lse = -inf``.
    """
    h, nq, nk = q.shape[1], q.shape[-2], k.shape[-2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qf, kf, vf = q.to(dtype), expand_kv(k, h).to(dtype), expand_kv(v, h).to(dtype)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if is_causal:
        s = s.masked_fill(~causal_allowed(nq, nk, 0, nk, s.device), float("-inf"))
    mask = additive_mask(attn_mask, dtype)
    if mask is not None:
        s = s + mask
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).unsqueeze(-1))
    o = torch.matmul(p, vf)
    return (o, lse) if return_lse else o


def pad_tokens(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero-pad dim -2 of ``x`` up to a multiple of ``multiple``."""
    extra = (-x.shape[-2]) % multiple
    return x if extra == 0 else torch.nn.functional.pad(x, (0, 0, 0, extra))


def tile_reduce_max(p: torch.Tensor, block_q: int) -> torch.Tensor:
    """Max of ``p (B, H, Nq, bk)`` over each ``block_q × bk`` tile, broadcast back to ``(B, H, Nq, 1)``."""
    nq = p.shape[-2]
    tiles = pad_tokens(p, block_q).unflatten(-2, (-1, block_q))
    return tiles.amax(dim=(-2, -1), keepdim=True).expand(*tiles.shape[:-1], 1).flatten(-3, -2)[..., :nq, :]


class BlockedAttention:
    """FlashAttention-2 forward over key blocks of ``block_k`` tokens; subclasses set the numerics.

    Per key block ``j`` (all query rows at once)::

        S_j   = scores(j)                         (masked entries −∞)
        m_j   = max(m_{j−1}, rowmax(S_j))
        P̃_j   = exp_fn(S_j − m_j)                 α_j = exp_fn(m_{j−1} − m_j)  (1 where row sees none of S_j)
        R_j, ℓ_add = pv(P̃_j, j)                  (quantized P·V and the denominator increment)
        acc_j = accumulate(acc_{j−1}, α_j, R_j)   ℓ_j = α_j ℓ_{j−1} + ℓ_add
    and finally ``O = finalize(acc) / ℓ``, ``lse = m + log ℓ``.
    """

    block_k: int = 64

    def scores(self, k0: int, k1: int) -> torch.Tensor:
        raise NotImplementedError

    def exp_fn(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x)

    def pv(self, p: torch.Tensor, k0: int, k1: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def accumulate(self, acc: torch.Tensor, alpha: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return acc * alpha + r

    def finalize(self, acc: torch.Tensor) -> torch.Tensor:
        return acc

    def run(
        self,
        nq: int,
        nk: int,
        dv: int,
        like: torch.Tensor,
        *,
        is_causal: bool,
        attn_mask: torch.Tensor | None,
        return_lse: bool,
    ):
        """Run the key-block loop. ``like`` supplies batch/head shape, dtype and device."""
        b, h, dtype, device = like.shape[0], like.shape[1], like.dtype, like.device
        mask = additive_mask(attn_mask, dtype)
        m = torch.full((b, h, nq, 1), float("-inf"), dtype=dtype, device=device)
        ell = torch.zeros((b, h, nq, 1), dtype=dtype, device=device)
        acc = torch.zeros((b, h, nq, dv), dtype=dtype, device=device)
        for k0 in range(0, nk, self.block_k):
            k1 = min(k0 + self.block_k, nk)
            if is_causal and k0 > nk - 1:
                break
            s = self.scores(k0, k1)
            if is_causal:
                s = s.masked_fill(~causal_allowed(nq, nk, k0, k1, device), float("-inf"))
            if mask is not None:
                s = s + mask[..., k0:k1]
            block_max = s.amax(dim=-1, keepdim=True)
            m_new = torch.maximum(m, block_max)
            # Rows that have seen no key yet keep m = −∞; shift by 0 there so exp gives 0, not NaN.
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            # A block a row cannot see leaves its state alone (α = 1), as kernels that skip masked
            # blocks do; it matters for approximate exps only (SAS(0) = 0.9996 would scale ℓ).
            alpha = torch.where(block_max == float("-inf"), torch.ones_like(m), self.exp_fn(m - m_safe))
            p = self.exp_fn(s - m_safe)
            r, l_add = self.pv(p, k0, k1)
            acc = self.accumulate(acc, alpha, r)
            ell = ell * alpha + l_add
            m = m_new
        empty = ell == 0
        out = torch.where(empty, torch.zeros_like(acc), self.finalize(acc) / torch.where(empty, 1, ell))
        if not return_lse:
            return out
        lse = (m + torch.log(ell)).squeeze(-1)
        return out, torch.where(empty.squeeze(-1), torch.full_like(lse, float("-inf")), lse)


def softmax_scale(q: torch.Tensor, scale: float | None) -> float:
    """The softmax scale: ``scale`` if given, else ``1/sqrt(D)``."""
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
