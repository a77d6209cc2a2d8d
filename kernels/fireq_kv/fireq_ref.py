"""Pure-PyTorch reference of FireQ's attention-side numerics (KV4 / Q8-FP decode, RPN and CRS).

FireQ (Baek et al. 2025) quantizes post-RoPE keys and values to INT4 per token with an FP8
(e4m3) scale, queries to FP8 e4m3 with a BF16 scale, and runs both attention products on the
FP8 tensor cores:

* **INT4 K/V** (§2 eq. 1 with b = 4, §3.2.1 "post-RoPE, per-token")::

      σ = e4m3(absmax_token / 7),    x̂ = clamp(round_half_even(x / σ), −8, 7)

  ``σ`` is rounded to e4m3 *before* ``x̂`` is formed, so ``x ≈ σ x̂`` with the stored ``σ``.
* **INT4 → FP8 in registers** (§3.1.1 Step 1, used for S = QKᵀ and O = PV, Fig. 1): a 16-entry
  look-up table per group holds ``FP8(i·σ)`` for ``i ∈ [−8, 7]``, so the MMA operand is
  ``e4m3(x̂ σ)`` — a second rounding (``7 × 1.125 = 7.875 → 8``) and saturation at ±448.
  Per-token V scales cannot be factored out of P·V, and the LUT is exactly the per-token
  dequantization *before* the product, so both K and V enter the engine as FP8 values with
  unit scale (``kv_operand="exact"`` keeps ``x̂ σ`` unrounded, an ablation).
* **FP8 Q** (§2 eq. 2): ``β = bf16(absmax_token / 448)``, ``q̂ = e4m3(q / β)``.
* **P̃** in FP8 e4m3 with the static scale 1/448 and an FP32 output accumulator, from the
  ``fireq`` :class:`~quantpatch.config.AttentionConfig` (the paper states FP8 P̃ and FP32
  accumulation but no P̃ scale; 1/448 is the house convention shared with SageAttention2).
* **RPN / CRS** (§3.2.1): per-channel key scalings ``k ← k / t``, ``q ← q · t`` that leave
  ``q·k`` unchanged in exact arithmetic. RPN shares ``s = α · max_n ‖(k_i, k_j)‖`` across each
  RoPE pair (so it commutes with RoPE); CRS gives each channel of the ``crs_pairs`` outlier
  pairs its own ``t = β · max_n |k_c|`` after RoPE. FireQ uses α = β = 8 (App. E, Fig. 10).

Layout: ``q (B, H, Nq, D)``, K/V caches ``(B, Hkv, Nk, D)``, ``H % Hkv == 0``; RoPE pairs are
``(i, i + D/2)`` (Llama's ``rotate_half``). Everything computes in float32 unless told.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from quantpatch.config import AttentionConfig

from ..attention.attention_ref import expand_kv
from ..attention.quant_attention_ref import quant_attention_ref
from ..quant_ref import FP8_MAX, cast_fp8, symmetric_scale

INT4_MIN, INT4_MAX = -8, 7  # eq. 1: x̂ ∈ {−2^(b−1), …, 2^(b−1) − 1}; the LUT covers −8σ … 7σ
INT4_SCALE_DIV = 7  # eq. 1: σ = absmax / (2^(b−1) − 1)
SCALE_FORMAT = "fp8_e4m3"  # §2: "INT4 with FP8 scaling factors"; §3.1: E4M3
KV_OPERANDS = ("fp8", "exact")


class PackedInt4(NamedTuple):
    """An INT4 per-token tensor: two values per byte plus one e4m3 scale per token.

    Attributes:
        data: ``uint8 (..., N, D/2)``; byte ``c`` holds channel ``2c`` in its low nibble and
            channel ``2c + 1`` in its high nibble, both two's complement.
        scale: ``(..., N, 1)`` float tensor whose values are on the e4m3 grid (0 for a token
            whose scale underflowed, see :func:`quantize_kv_int4`).
    """

    data: torch.Tensor
    scale: torch.Tensor


# --------------------------------------------------------------------------- INT4 K/V


def quantize_kv_int4(
    x: torch.Tensor, *, compute_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """FireQ eq. 1 (b = 4) per token with an e4m3 scale.

    ``σ = e4m3(absmax / 7)`` over the channels of each token (an all-zero token gets σ = 1),
    ``x̂ = clamp(round_half_even(x / σ), −8, 7)``. With a normal e4m3 σ the rounding of σ moves
    ``absmax/σ`` by at most 1/16, so ``|x̂| ≤ 7`` (7·1.0625 < 7.5); only subnormal σ can reach the
    clamp, where ``−8`` (kept by eq. 1's range) is used. A σ that rounds to 0 (``absmax ≤ 7·2^-10``
    under round-to-nearest; FireQ App. B Lemma B.1 quotes the threshold ``7·2^-9``) stores σ = 0
    and ``x̂ = 0``: the token dequantizes to zeros, never NaN. Above ``absmax = 7·448`` σ saturates
    at 448 and the token clips.

    Args:
        x: ``(..., N, D)`` post-RoPE keys or values.

    Returns:
        ``(x̂, σ)``: ``x̂ (..., N, D)`` integer-valued in ``[−8, 7]`` and ``σ (..., N, 1)`` on the
        e4m3 grid, both in ``compute_dtype``.
    """
    x = x.to(compute_dtype)
    scale = cast_fp8(symmetric_scale(x.abs().amax(dim=-1, keepdim=True), INT4_SCALE_DIV), SCALE_FORMAT)
    underflow = scale == 0
    q = torch.clamp(torch.round(x / torch.where(underflow, torch.ones_like(scale), scale)), INT4_MIN, INT4_MAX)
    return torch.where(underflow, torch.zeros_like(q), q), scale


def dequantize_kv_int4(q: torch.Tensor, scale: torch.Tensor, operand: str = "fp8") -> torch.Tensor:
    """The MMA operand of an INT4 tensor: ``e4m3(x̂ σ)`` (FireQ's LUT, ``"fp8"``) or ``x̂ σ`` (``"exact"``).

    ``q (..., N, D)`` and ``scale (..., N, 1)`` as from :func:`quantize_kv_int4`; returns ``(..., N, D)``
    in the dtype of ``q``. ``"fp8"`` saturates at ±448 (App. B, Fig. 7 overflow).
    """
    if operand not in KV_OPERANDS:
        raise ValueError(f"operand={operand!r} is not valid; choose one of {list(KV_OPERANDS)}")
    x = q * scale.to(q.dtype)  # exact: ≤ 4-bit integer × 4-significant-bit scale
    return cast_fp8(x, SCALE_FORMAT) if operand == "fp8" else x


def pack_int4_signed(q: torch.Tensor) -> torch.Tensor:
    """Pack integer values in ``[−8, 7]`` two per byte along the last dim: ``(..., D)`` → ``uint8 (..., D/2)``.

    Channel ``2c`` goes to the low nibble of byte ``c``, channel ``2c + 1`` to the high nibble,
    each as a 4-bit two's complement (the byte layout of ``turbo_ref.pack_codes(q & 0xF, 4)``).
    ``q`` may be any integer-valued dtype.
    """
    if q.shape[-1] % 2:
        raise ValueError(f"pack_int4_signed needs an even last dim, got {q.shape[-1]}")
    n = q.to(torch.int16)
    if q.is_floating_point() and not torch.equal(n.to(q.dtype), q):
        raise ValueError("pack_int4_signed expects integer values")
    if n.numel() and (int(n.min()) < INT4_MIN or int(n.max()) > INT4_MAX):
        raise ValueError(f"pack_int4_signed values must lie in [{INT4_MIN}, {INT4_MAX}]")
    u = (n & 0xF).to(torch.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_int4_signed(packed: torch.Tensor, dtype: torch.dtype = torch.int8) -> torch.Tensor:
    """Inverse of :func:`pack_int4_signed`: ``uint8 (..., D/2)`` → ``(..., D)`` values in ``[−8, 7]`` as ``dtype``."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_int4_signed expects uint8, got {packed.dtype}")
    nibbles = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2).to(torch.int16)
    return ((nibbles ^ 8) - 8).to(dtype)  # sign-extend the 4-bit two's complement


def quantize_kv_cache(x: torch.Tensor, *, compute_dtype: torch.dtype = torch.float32) -> PackedInt4:
    """:func:`quantize_kv_int4` then :func:`pack_int4_signed`: ``(B, Hkv, N, D)`` → :class:`PackedInt4`."""
    q, scale = quantize_kv_int4(x, compute_dtype=compute_dtype)
    return PackedInt4(pack_int4_signed(q), scale)


def dequantize_kv_cache(
    cache: PackedInt4, operand: str = "fp8", *, compute_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Unpack a :class:`PackedInt4` and return its MMA operand ``(B, Hkv, N, D)`` (see :func:`dequantize_kv_int4`)."""
    return dequantize_kv_int4(unpack_int4_signed(cache.data, compute_dtype), cache.scale.to(compute_dtype), operand)


# --------------------------------------------------------------------------- FP8 Q


def quantize_query_fp8(
    q: torch.Tensor, *, compute_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """FireQ eq. 2 per token: ``β = bf16(absmax / 448)``, ``q̂ = e4m3(q / β)`` (saturating).

    An all-zero token gets β = 1. Because β is rounded to bf16 (relative error ≤ 2^-9), the
    token's absmax maps to 448·(1 ± 2^-9), which e4m3 rounds (or saturates) to exactly 448.

    Args:
        q: ``(..., N, D)`` post-RoPE queries.

    Returns:
        ``(q̂, β)``: ``q̂ (..., N, D)`` on the e4m3 grid and ``β (..., N, 1)`` on the bf16 grid,
        both in ``compute_dtype``; ``q ≈ β q̂``.
    """
    q = q.to(compute_dtype)
    beta = symmetric_scale(q.abs().amax(dim=-1, keepdim=True), FP8_MAX["fp8_e4m3"])
    beta = beta.to(torch.bfloat16).to(compute_dtype)
    beta = torch.where(beta == 0, torch.ones_like(beta), beta)  # bf16 underflow (absmax < ~1e-36)
    return cast_fp8(q / beta, "fp8_e4m3"), beta


# --------------------------------------------------------------------------- decode attention


def fireq_attention_config(cfg: AttentionConfig | None = None) -> AttentionConfig:
    """The ``fireq`` mode's attention numerics (or ``cfg``), checked for what the decode path relies on."""
    if cfg is None:
        from quantpatch.modes import get_mode

        cfg = get_mode("fireq").attention
    if cfg.qk_format != "fp8_e4m3" or cfg.qk_granularity != "token" or cfg.smooth_q:
        raise ValueError(
            "fireq decode needs per-token FP8 e4m3 Q without smooth_q (qk_format='fp8_e4m3', "
            f"qk_granularity='token', smooth_q=False); got {cfg.qk_format!r}, {cfg.qk_granularity!r}, {cfg.smooth_q}"
        )
    if not cfg.pv_format.startswith("fp8"):
        raise ValueError(f"fireq decode runs P·V on FP8 operands; got pv_format={cfg.pv_format!r}")
    return cfg


def fireq_decode_attention_ref(
    q: torch.Tensor,
    k_cache: PackedInt4 | torch.Tensor,
    v_cache: PackedInt4 | torch.Tensor,
    *,
    cfg: AttentionConfig | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    attn_mask: torch.Tensor | None = None,
    kv_operand: str = "fp8",
    return_lse: bool = False,
    compute_dtype: torch.dtype = torch.float32,
):
    """FireQ KV4/Q8-FP attention of a query chunk over an INT4 per-token K/V cache.

    Numerics (module docstring): ``S = β q̂ · e4m3(x̂_K σ_K)ᵀ · scale``; online softmax in the
    compute dtype; ``P̂ = e4m3(448 P̃)``; ``O = Σ_j P̂_j e4m3(x̂_V σ_V)_j / (448 ℓ)`` with ℓ summing
    the unquantized P̃. Runs :func:`quant_attention_ref` with K and V as unit-scale FP8 operands
    (per-token V scales are applied before the product, as FireQ's LUT does) and Q passed as
    ``β q̂``, which the engine's per-token FP8 quantizer maps back to exactly ``(q̂, β)``.

    Args:
        q: ``(B, H, Nq, D)`` post-RoPE queries (already multiplied by any RPN/CRS factors, see
            :func:`apply_crs`); ``Nq`` is typically 1 to a few (decode, speculative chunks).
        k_cache, v_cache: :class:`PackedInt4` caches ``(B, Hkv, Nk, D/2)`` + ``(B, Hkv, Nk, 1)``, or
            float ``(B, Hkv, Nk, D)`` tensors quantized here with :func:`quantize_kv_cache`.
        cfg: attention numerics, default ``get_mode("fireq").attention``; must be per-token FP8 Q.
        is_causal: bottom-right aligned (query ``i`` sees keys ``j ≤ i + Nk − Nq``).
        attn_mask: bool (True = attend) or additive mask broadcastable to ``(B, H, Nq, Nk)``.
        kv_operand: ``"fp8"`` (FireQ's LUT) or ``"exact"`` (unrounded ``x̂ σ``, an ablation).

    Returns:
        ``o (B, H, Nq, D)`` in ``compute_dtype`` (and ``lse (B, H, Nq)`` if asked).
    """
    cfg = fireq_attention_config(cfg)
    if kv_operand not in KV_OPERANDS:
        raise ValueError(f"kv_operand={kv_operand!r} is not valid; choose one of {list(KV_OPERANDS)}")
    caches = []
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if isinstance(cache, torch.Tensor):
            cache = quantize_kv_cache(cache, compute_dtype=compute_dtype)
        elif not isinstance(cache, PackedInt4):
            raise TypeError(f"{name} must be a PackedInt4 or a float tensor, got {type(cache).__name__}")
        caches.append(dequantize_kv_cache(cache, kv_operand, compute_dtype=compute_dtype))
    k_op, v_op = caches
    if q.dim() != 4 or k_op.dim() != 4 or q.shape[-1] != k_op.shape[-1] or q.shape[1] % k_op.shape[1]:
        raise ValueError(
            f"shape mismatch: q {tuple(q.shape)}, K cache {tuple(k_op.shape)} (want B,H,Nq,D and B,Hkv,Nk,D)"
        )
    q_hat, beta = quantize_query_fp8(q, compute_dtype=compute_dtype)
    # K: per-token scale folded into the FP8 operand, so its scale is 1 for every token (the
    # engine slices it per key block, hence full length). V: one unit scale → static P·V path.
    k_quantized = (k_op, torch.ones_like(k_op[..., :1]))
    v_quantized = (v_op, torch.ones((1, 1, 1, 1), dtype=v_op.dtype, device=v_op.device))
    return quant_attention_ref(
        q_hat * beta,
        k_op,
        v_op,
        cfg,
        is_causal=is_causal,
        scale=scale,
        attn_mask=attn_mask,
        return_lse=return_lse,
        compute_dtype=compute_dtype,
        k_quantized=k_quantized,
        v_quantized=v_quantized,
    )


# --------------------------------------------------------------------------- RPN / CRS


def rope_partner(d: int) -> torch.Tensor:
    """RoPE partner of each channel for ``rotate_half`` RoPE: ``c ↦ (c + d/2) mod d``, int64 ``(d,)``."""
    if d % 2:
        raise ValueError(f"RoPE needs an even head dim, got {d}")
    return (torch.arange(d) + d // 2) % d


def channel_absmax(k: torch.Tensor) -> torch.Tensor:
    """Calibration statistic ``max_n |k_c|`` over batch and tokens: ``(B, Hkv, N, D)`` → ``(Hkv, D)``."""
    return k.abs().amax(dim=(0, 2))


def select_crs_pairs(k_absmax: torch.Tensor, n_pairs: int = 8) -> torch.Tensor:
    """The ``n_pairs`` outlier RoPE pairs of each head (FireQ §3.2.1, App. E.1: 8 pairs).

    A pair ``(i, i + D/2)`` is ranked by the larger post-RoPE absmax of its two channels.

    Args:
        k_absmax: ``(Hkv, D)`` post-RoPE channel absmax (:func:`channel_absmax`).

    Returns:
        int64 ``(Hkv, n_pairs)`` pair indices ``i ∈ [0, D/2)``, largest first.
    """
    half = k_absmax.shape[-1] // 2
    rope_partner(k_absmax.shape[-1])  # validates D
    if not 0 <= n_pairs <= half:
        raise ValueError(f"n_pairs={n_pairs} must lie in [0, {half}]")
    pair_max = torch.maximum(k_absmax[..., :half], k_absmax[..., half:])
    return pair_max.topk(n_pairs, dim=-1).indices


def _pair_channels(pairs: torch.Tensor, d: int) -> torch.Tensor:
    """Channel indices ``[i…, i + d/2…]`` of pair indices ``(Hkv, P)`` → ``(Hkv, 2P)``."""
    return torch.cat((pairs, pairs + d // 2), dim=-1)


def crs_factors(k_absmax: torch.Tensor, pairs: torch.Tensor, beta: float = 8.0) -> torch.Tensor:
    """Channel-wise RoPE scaling factors (FireQ §3.2.1 Stage 2): ``t_c = β · max_n |k_c|``.

    Each channel of each outlier pair gets its own factor (post-RoPE, so the pair need not
    share it); every other channel, and a channel whose absmax is 0, gets 1.

    Args:
        k_absmax: ``(Hkv, D)`` post-RoPE channel absmax; pairs: ``(Hkv, P)`` from :func:`select_crs_pairs`.
        beta: β; FireQ uses 8 on RPN-normalized keys, mapping each outlier channel's max to 1/β.

    Returns:
        ``(Hkv, D)`` factors for :func:`apply_crs` (dtype of ``k_absmax``).
    """
    if beta <= 0:
        raise ValueError(f"beta must be positive, got {beta}")
    t = torch.ones_like(k_absmax)
    idx = _pair_channels(pairs, k_absmax.shape[-1]).to(k_absmax.device)
    picked = beta * k_absmax.gather(-1, idx)
    return t.scatter(-1, idx, torch.where(picked == 0, torch.ones_like(picked), picked))


def rpn_factors(k: torch.Tensor, alpha: float = 8.0) -> torch.Tensor:
    """RoPE-preserving normalization (FireQ §3.2.1 Stage 1, Thm. 3.1): ``s_i = s_j = α · max_n ‖(k_i, k_j)‖₂``.

    Both channels of a pair share ``s``, so ``k / s`` commutes with the pair's rotation: the
    factors are the same from pre- or post-RoPE keys, and FireQ merges them into W_k (and
    ``s`` into W_q) offline. After scaling every pair norm is ≤ 1/α. A pair that is all zeros gets 1.

    Args:
        k: ``(B, Hkv, N, D)`` calibration keys.

    Returns:
        ``(Hkv, D)`` factors for :func:`apply_crs`.
    """
    if alpha <= 0:
        raise ValueError(f"alpha must be positive, got {alpha}")
    half = k.shape[-1] // 2
    rope_partner(k.shape[-1])
    norm = torch.sqrt(k[..., :half] ** 2 + k[..., half:] ** 2).amax(dim=(0, 2))  # (Hkv, D/2)
    s = alpha * norm
    s = torch.where(s == 0, torch.ones_like(s), s)
    return torch.cat((s, s), dim=-1)


def fireq_key_factors(
    k: torch.Tensor, n_pairs: int = 8, *, alpha: float = 8.0, beta: float = 8.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """FireQ's two-stage smoothing factors: CRS on the ``n_pairs`` outlier pairs, RPN on the rest.

    The CRS statistic is taken after RPN has normalized the regular pairs (the two sets of
    channels are disjoint, so the order does not change the factors).

    Args:
        k: ``(B, Hkv, N, D)`` post-RoPE calibration keys.

    Returns:
        ``(factors (Hkv, D), pairs (Hkv, n_pairs))``; ``k / factors`` is what FireQ quantizes.
    """
    absmax = channel_absmax(k)
    pairs = select_crs_pairs(absmax, n_pairs)
    idx = _pair_channels(pairs, k.shape[-1]).to(k.device)
    crs = crs_factors(absmax, pairs, beta)
    return rpn_factors(k, alpha).scatter(-1, idx, crs.gather(-1, idx)), pairs


def crs_scale_key(k: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """``k / t`` per channel: ``k (B, Hkv, N, D)``, ``factors (Hkv, D)``."""
    return k / factors.to(k.dtype).unsqueeze(-2)


def crs_scale_query(q: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """``q · t`` per channel, KV head ``h`` serving query heads ``h·G … h·G + G − 1``: ``q (B, H, N, D)``."""
    t = expand_kv(factors.to(q.dtype).unsqueeze(0).unsqueeze(-2), q.shape[1])  # (1, H, 1, D)
    return q * t


def apply_crs(q: torch.Tensor, k: torch.Tensor, factors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply per-head channel factors (CRS, RPN or both) post-RoPE: ``(q · t, k / t)``.

    ``(q t)·(k / t)ᵀ = q·kᵀ`` in exact arithmetic, so float attention is unchanged while the
    outlier channels of K shrink before INT4 quantization.

    Args:
        q: ``(B, H, Nq, D)``; k: ``(B, Hkv, Nk, D)``; factors: ``(Hkv, D)``, positive.

    Returns:
        ``(q', k')`` with the shapes and dtypes of ``q`` and ``k``.
    """
    if factors.shape != (k.shape[1], k.shape[-1]):
        raise ValueError(f"factors must be (Hkv, D) = {(k.shape[1], k.shape[-1])}, got {tuple(factors.shape)}")
    return crs_scale_query(q, factors), crs_scale_key(k, factors)
