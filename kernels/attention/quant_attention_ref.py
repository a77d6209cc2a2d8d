"""Reference of every quantized attention mode: one engine parameterized by ``AttentionConfig``.

Each knob is a step of one of the seed papers' algorithms:

* **Q·Kᵀ** (SageAttention2 Alg. 1; INT-FlashAttention Alg. 1; TurboAttention Alg. 1; FireQ §3.2.2)::

      γ(K) = K − mean_tokens(K)              (smooth_k)
      q̄_i  = mean(Q_i) over query block i,  γ(Q_i) = Q_i − q̄_i      (smooth_q)
      (δQ, Q̂) = ψ_Q(γ(Q)),  (δK, K̂) = ψ_K(γ(K))    (qk_format / qk_granularity / qk_qmax)
      S_ij = (δQ δKᵀ ⊙ Q̂_i K̂_jᵀ + ΔS_ij) · scale,   ΔS_ij = q̄_i γ(K_j)ᵀ

* **softmax**: FlashAttention-2 online softmax with ``exp`` or TurboAttention's SAS.
* **P̃·V**: ``V ← V − mean(V)`` (smooth_v, added back to O); ``(δV, V̂) = ψ_V(V)``
  (pv_format / v_granularity); ``P̂ = ψ_P(P̃)`` with the static scale ``1/pmax`` (448 for E4M3,
  127 for INT8) or TurboAttention's per-tile ``max(P̃)/119``; ``R_j = P̂_j V̂_j`` in a per-block
  register added to the FP32 output accumulator (two_level_accum), optionally through the
  FP22 accumulator the FP8 MMA really has (emulate_fp22); the denominator ``ℓ`` sums P̃, or
  the quantized P (l_from_quantized_p, INT-FlashAttention).

Integer and FP8 values are carried in the compute dtype (float32 by default, float64 on
request); every rounding decision is the kernels' one, so their integer parts match exactly.
"""

from __future__ import annotations

import torch

from quantpatch.config import AttentionConfig

from ..quant_ref import (
    FP8_MAX,
    cast_fp8,
    quantize_fp8,
    quantize_symmetric,
    quantize_tokens,
    symmetric_scale,
    token_absmax,
    truncate_fp22,
)
from .attention_ref import BlockedAttention, expand_kv, pad_tokens, softmax_scale, tile_reduce_max
from .sas_ref import sas_exp

FP22_K_CHUNK = 32  # k extent of one FP8 mma (m16n8k32): the accumulator is rounded after each


def block_mean(x: torch.Tensor, block: int) -> torch.Tensor:
    """Mean of ``x (..., N, D)`` over consecutive token blocks, broadcast back to ``(..., N, D)``."""
    n = x.shape[-2]
    counts = torch.full((n,), float(block), dtype=x.dtype, device=x.device)
    tail = n % block
    if tail:
        counts[n - tail :] = tail
    tiles = pad_tokens(x, block).unflatten(-2, (-1, block))
    means = tiles.sum(dim=-2, keepdim=True).expand_as(tiles).flatten(-3, -2)[..., :n, :]
    return means / counts.unsqueeze(-1)


def quantize_qk(x: torch.Tensor, cfg: AttentionConfig, role: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize Q (``role="q"``) or K (``"k"``) ``(B, H, N, D)`` → values and per-token scales ``(B, H, N, 1)``."""
    block = cfg.block_q if role == "q" else cfg.block_k
    if cfg.qk_format in ("fp16", "none"):
        return cast_float(x, cfg.qk_format), torch.ones_like(x[..., :1])
    if cfg.qk_format.startswith("fp8"):
        absmax = token_absmax(x, cfg.qk_granularity, role=role, block=block, warps=cfg.warps)
        return quantize_fp8(x, cfg.qk_format, absmax)
    return quantize_tokens(x, cfg.qk_granularity, role=role, qmax=cfg.qk_qmax, block=block, warps=cfg.warps)


def pv_max(cfg: AttentionConfig) -> float:
    """Largest magnitude of the P̃/V format (the static P̃ scale is its inverse)."""
    if cfg.pv_format == "int8":
        return float(cfg.pv_qmax)
    return FP8_MAX.get(cfg.pv_format, 1.0)


def cast_float(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Round ``x`` to a floating operand format (``fp16``, ``fp8_*``; ``none`` keeps it as is)."""
    if fmt == "none":
        return x
    if fmt == "fp16":
        return x.to(torch.float16).to(x.dtype)
    return cast_fp8(x, fmt)


def cast_pv(x: torch.Tensor, cfg: AttentionConfig) -> torch.Tensor:
    """Round already-scaled P̃ or V values to the P·V operand format."""
    if cfg.pv_format == "int8":
        return quantize_symmetric(x, torch.ones((), dtype=x.dtype, device=x.device), cfg.pv_qmax)
    return cast_float(x, cfg.pv_format)


def quantize_v(v: torch.Tensor, cfg: AttentionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """V ``(B, H, N, D)`` → operand values and a scale broadcastable to it."""
    if cfg.pv_format in ("fp16", "none"):
        return cast_pv(v, cfg), torch.ones((1, 1, 1, 1), dtype=v.dtype, device=v.device)
    if cfg.v_granularity == "channel":
        absmax = v.abs().amax(dim=-2, keepdim=True)
    elif cfg.v_granularity == "tensor":
        absmax = v.abs().amax().reshape(1, 1, 1, 1)
    else:
        absmax = token_absmax(v, "block", role="k", block=cfg.block_k)
    scale = symmetric_scale(absmax, pv_max(cfg))
    return cast_pv(v / scale, cfg), scale


def smooth_k_lse_shift(q: torch.Tensor, k_mean: torch.Tensor) -> torch.Tensor:
    """``q_i·k̄`` per row, ``(B, H, Nq)``: what smoothing K removes from each score row (before ``scale``).

    ``q (B, H, Nq, D)``, ``k_mean (B, Hkv, D)``; softmax ignores it, the LSE does not.
    """
    k_mean = k_mean.repeat_interleave(q.shape[1] // k_mean.shape[1], dim=1)
    return torch.einsum("bhnd,bhd->bhn", q, k_mean.to(q.dtype))


def _block_heads(scale: torch.Tensor, block: int) -> torch.Tensor:
    """Each token's scale replaced by the first scale of its ``block``-token key block."""
    return scale[..., ::block, :].repeat_interleave(block, dim=-2)[..., : scale.shape[-2], :]


def matmul_fp22(p: torch.Tensor, v: torch.Tensor, acc: torch.Tensor | None = None) -> torch.Tensor:
    """``acc + p @ v`` through an FP22 accumulator, rounded after every ``FP22_K_CHUNK`` keys."""
    out = torch.zeros(*p.shape[:-1], v.shape[-1], dtype=p.dtype, device=p.device) if acc is None else acc
    for c0 in range(0, p.shape[-1], FP22_K_CHUNK):
        c1 = c0 + FP22_K_CHUNK
        out = truncate_fp22(out + torch.matmul(p[..., c0:c1], v[..., c0:c1, :]))
    return out


class QuantAttention(BlockedAttention):
    """The configured numerics over pre-quantized Q/K/V; see the module docstring."""

    def __init__(
        self,
        cfg: AttentionConfig,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float | None,
        k_quantized: tuple[torch.Tensor, torch.Tensor] | None = None,
        v_quantized: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        self.cfg = cfg
        self.block_k = cfg.block_k
        self.sm_scale = softmax_scale(q, scale)
        h = q.shape[1]
        self.delta_s_q = None
        self.lse_shift = None
        if k_quantized is None:
            k_s = k
            if cfg.smooth_k:
                k_mean = k.mean(dim=-2, keepdim=True)
                k_s = k - k_mean
                self.lse_shift = smooth_k_lse_shift(q, k_mean.squeeze(-2))
            k_hat, k_scale = quantize_qk(k_s, cfg, "k")
        else:
            k_s, (k_hat, k_scale) = k, k_quantized
        if cfg.smooth_q:
            q_mean = block_mean(q, cfg.block_q)
            q = q - q_mean
            self.delta_s_q, self.k_smooth = q_mean, expand_kv(k_s, h)
        q_hat, q_scale = quantize_qk(q, cfg, "q")
        self.q_hat, self.q_scale = q_hat, q_scale
        self.k_hat, self.k_scale = expand_kv(k_hat, h), expand_kv(k_scale, h)

        self.v_mean = None
        if v_quantized is None:
            if cfg.smooth_v:
                self.v_mean = expand_kv(v.mean(dim=-2, keepdim=True), h)
                v = v - v.mean(dim=-2, keepdim=True)
            v_hat, v_scale = quantize_v(v, cfg)
        else:
            v_hat, v_scale = v_quantized
            if v_scale.shape[-2] > 1 and not torch.equal(v_scale, _block_heads(v_scale, cfg.block_k)):
                raise ValueError(
                    "v_quantized scale varies within a key block; a per-token V scale cannot be factored out "
                    "of P·V: dequantize V to its operand format first (see kernels/fireq_kv/fireq_ref.py)"
                )
        self.v_hat = expand_kv(v_hat, h)
        self.v_scale = v_scale if v_scale.shape[1] == 1 else expand_kv(v_scale, h)
        # Static P̃ and V scales let the accumulator stay in raw operand units (as the MMA's
        # does) and be dequantized once at the end; per-block scales dequantize every block.
        self.static_scales = not cfg.p_from_block_max and v_scale.shape[-2] == 1
        self.p_max = pv_max(cfg)
        if cfg.exp == "sas":
            self.exp_fn = lambda x: sas_exp(x, cfg.sas_threshold)

    def scores(self, k0: int, k1: int) -> torch.Tensor:
        k_hat, k_scale = self.k_hat[..., k0:k1, :], self.k_scale[..., k0:k1, :]
        s = torch.matmul(self.q_hat, k_hat.transpose(-1, -2)) * (self.q_scale * k_scale.transpose(-1, -2))
        if self.delta_s_q is not None:
            # ΔS = q̄_i γ(K_j)ᵀ: added after the product so that smoothing Q does not change S.
            s = s + torch.matmul(self.delta_s_q, self.k_smooth[..., k0:k1, :].transpose(-1, -2))
        return s * self.sm_scale

    def pv(self, p: torch.Tensor, k0: int, k1: int) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        if cfg.pv_format in ("fp16", "none"):
            p_scale = torch.ones((), dtype=p.dtype, device=p.device)
        elif cfg.p_from_block_max:
            p_scale = symmetric_scale(tile_reduce_max(p, cfg.block_q), self.p_max)
        else:
            p_scale = torch.full((), 1.0 / self.p_max, dtype=p.dtype, device=p.device)
        p_hat = cast_pv(p / p_scale, cfg)
        v_hat = self.v_hat[..., k0:k1, :]
        l_add = (p_hat * p_scale if cfg.l_from_quantized_p else p).sum(dim=-1, keepdim=True)
        if cfg.emulate_fp22 and cfg.two_level_accum:
            r = matmul_fp22(p_hat, v_hat)
        elif cfg.emulate_fp22:
            return (p_hat, v_hat), l_add  # accumulated straight into the FP22 register below
        else:
            r = torch.matmul(p_hat, v_hat)
        if not self.static_scales:
            r = r * p_scale * self._v_scale_block(k0)
        return r, l_add

    def _v_scale_block(self, k0: int) -> torch.Tensor:
        return self.v_scale if self.v_scale.shape[-2] == 1 else self.v_scale[..., k0 : k0 + 1, :]

    def accumulate(self, acc, alpha, r):
        if isinstance(r, tuple):  # single-level FP22: rescale and accumulate in the FP22 register
            return matmul_fp22(*r, acc=truncate_fp22(acc * alpha))
        return acc * alpha + r

    def finalize(self, acc: torch.Tensor) -> torch.Tensor:
        if self.static_scales:
            acc = acc * (self.v_scale if self.cfg.pv_format in ("fp16", "none") else self.v_scale / self.p_max)
        return acc

    def output(self, out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """Add the V mean back (smooth V) to every row that attended to at least one key."""
        if self.v_mean is None:
            return out
        return torch.where(torch.isinf(lse).unsqueeze(-1), out, out + self.v_mean)

    def true_lse(self, lse: torch.Tensor) -> torch.Tensor:
        """The LSE of the unsmoothed scores ``Q Kᵀ · scale``."""
        return lse if self.lse_shift is None else lse + self.lse_shift * self.sm_scale


def quant_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cfg: AttentionConfig,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    attn_mask: torch.Tensor | None = None,
    return_lse: bool = False,
    compute_dtype: torch.dtype = torch.float32,
    k_quantized: tuple[torch.Tensor, torch.Tensor] | None = None,
    v_quantized: tuple[torch.Tensor, torch.Tensor] | None = None,
):
    """Quantized attention reference.

    Args:
        q: ``(B, H, Nq, D)``; k: ``(B, Hkv, Nk, D)``; v: ``(B, Hkv, Nk, Dv)``; ``H % Hkv == 0``.
        cfg: the numerics (``AttentionConfig``).
        is_causal: bottom-right aligned causal mask.
        attn_mask: bool (True = attend) or additive float mask broadcastable to ``(B, H, Nq, Nk)``.
        compute_dtype: float32 (matches the kernels) or float64.
        k_quantized / v_quantized: ``(values, scale)`` already on the operand grid (a compressed
            KV cache), bypassing K/V smoothing and quantization; scales broadcast to ``(B, Hkv, Nk, ·)``.

    Returns:
        ``o (B, H, Nq, Dv)`` in ``compute_dtype`` (and ``lse (B, H, Nq)``, natural log, if asked).
    """
    if cfg.numerics == "none":
        raise ValueError("quant_attention_ref needs a quantized AttentionConfig (numerics != 'none')")
    q, k, v = (t.to(compute_dtype) for t in (q, k, v))
    kq = None if k_quantized is None else tuple(t.to(compute_dtype) for t in k_quantized)
    vq = None if v_quantized is None else tuple(t.to(compute_dtype) for t in v_quantized)
    engine = QuantAttention(cfg, q, k, v, scale=scale, k_quantized=kq, v_quantized=vq)
    out, lse = engine.run(
        q.shape[-2], k.shape[-2], v.shape[-1], q, is_causal=is_causal, attn_mask=attn_mask, return_lse=True
    )
    out = engine.output(out, lse)
    return (out, engine.true_lse(lse)) if return_lse else out
