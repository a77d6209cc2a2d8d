"""Pure-PyTorch reference of FireQ's W4A8-FP linear layer (INT4 weights × FP8 activations).

FireQ (Baek et al. 2025) §3.1 and Appendix B/C.1, numerics the Triton GEMM reproduces:

* **Weights** (§2 eq. 1, b = 4; §3.1 "groups of 128 elements sharing a single FP8 (E4M3)
  scaling factor"): ``W (O, K)`` is split along the input dim into groups of ``group_size``;
  each group of each output row gets ``σ = e4m3(absmax / 7)`` and ``ŵ = clamp(round(w / σ), −8, 7)``
  (the rounding of σ moves ``absmax/σ`` by ≤ 1/16, so ``|ŵ| ≤ 7`` except for a subnormal σ,
  see :func:`quantpatch.kernels.fireq_kv.fireq_ref.quantize_kv_int4`, which this reuses). A group whose
  σ underflows to 0 (App. B Lemma B.1, ``absmax ≲ 7·2⁻⁹``) stores σ = 0 and ŵ = 0.
* **PTS** (Definition 3.2, App. C.1): the whole matrix is multiplied by ``δ = 2ⁿ`` *before*
  the group scales are formed, and the GEMM output is multiplied by ``δ⁻¹`` (exact, a power
  of two). ``n`` is the smallest non-negative integer for which either (1) the cumulative
  underflow score ``𝕊(W·2ⁿ) = Σ max(0, 7·2⁻⁹ − |ω|·2ⁿ)`` stops changing (every non-zero
  element has reached ``7·2⁻⁹``), or (2) some element lands in ``[7·2⁵⁻ⁿ, 7·2⁶⁻ⁿ)``, i.e.
  ``|ω|·2ⁿ ∈ [1.75·2⁷, 1.75·2⁸) = [224, 448)``: doubling again would overflow e4m3.
  In practice (2) decides: the largest weight is scaled into ``[224, 448)``, which puts every
  group scale ``σ ≤ 64`` in e4m3's normal range instead of its subnormals.
* **Activations** (§2 eq. 2): per token ``β = bf16(absmax / 448)``, ``x̂ = e4m3(x / β)``.
* **Product** (§3.1.1): the INT4 weight becomes an FP8 MMA operand in registers. Two operand
  models are offered:

  - ``"group"`` (default, the kernels' design): ŵ itself (exact in e4m3) is the operand;
    each group's dot ``Σ_k x̂ ŵ`` is accumulated in FP32 and multiplied by that group's σ:
    ``y = β · δ⁻¹ · Σ_g σ_g · (x̂_g · ŵ_gᵀ) + bias``.
  - ``"lut"`` (FireQ's look-up table, §3.1.1 Step 1): a 16-entry FP8 table per group holds
    ``e4m3(i·σ)``, so the operand is ``e4m3(ŵ σ)`` — one more rounding (``7 × 1.125 → 8``) —
    and the dot runs over all of K at once: ``y = β · δ⁻¹ · x̂ · e4m3(ŵ σ)ᵀ + bias``.

Storage (:func:`quantize_weight`): ``qweight uint8 (O, Kp/2)`` with two INT4 per byte (input
channel ``2c`` in the low nibble, ``2c + 1`` in the high nibble, two's complement; the layout
of :func:`~quantpatch.kernels.fireq_kv.fireq_ref.pack_int4_signed`), ``scales float8_e4m3fn (O, G)``,
``Kp = G · group_size ≥ K`` (a ragged last group is zero-padded; zeros do not move absmax).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..fireq_kv.fireq_ref import pack_int4_signed, quantize_kv_int4, quantize_query_fp8, unpack_int4_signed
from ..quant_ref import cast_fp8

GROUP_SIZE = 128  # §3.1: "groups of 128 elements"
WEIGHT_OPERANDS = ("group", "lut")
PTS_UNDERFLOW = 7 * 2.0**-9  # App. B Lemma B.1: a group below this has σ_FP8 = 0
PTS_OVERFLOW_BAND = (1.75 * 2.0**7, 1.75 * 2.0**8)  # App. C.1: [224, 448); 448 = e4m3 max
PTS_MAX_EXP = 64
_PARTIAL_ELEMENTS = 1 << 25  # cap on the per-group partial sums held at once


class PackedWeight(NamedTuple):
    """An INT4 weight with e4m3 group scales (see the module docstring for the layout).

    Attributes:
        qweight: ``uint8 (O, Kp/2)``.
        scales: ``float8_e4m3fn (O, G)``; ``G = Kp / group_size``.
        pts_exp: ``n`` of the per-tensor factor ``δ = 2ⁿ`` folded into the weights (0: no PTS).
        in_features: ``K`` (``≤ Kp``).
        group_size: input channels per scale.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    pts_exp: int
    in_features: int
    group_size: int


# --------------------------------------------------------------------------- PTS


def pts_underflow_score(w: torch.Tensor) -> float:
    """FireQ eq. 8: ``𝕊(W) = Σ_ω max(0, 7·2⁻⁹ − |ω|)`` (computed in float64)."""
    return float(torch.clamp(PTS_UNDERFLOW - w.detach().double().abs(), min=0).sum())


def pts_exponent(w: torch.Tensor, max_exp: int = PTS_MAX_EXP) -> int:
    """FireQ Definition 3.2: the smallest ``n ≥ 0`` with ``δ = 2ⁿ`` meeting condition (1) or (2).

    (1) ``𝕊(W·2ⁿ) = 𝕊(W·2ⁿ⁺ⁱ)`` for all ``i ≥ 1``: true exactly when every non-zero ``|ω|·2ⁿ``
    is ``≥ 7·2⁻⁹`` (below that the score still falls with each doubling; zeros add a constant).
    (2) some ``|ω|·2ⁿ ∈ [224, 448)`` (eq. 9). A matrix whose absmax is already ``≥ 448`` gets
    ``n = 0`` (scaling up can only overflow); an all-zero matrix gets 0. Capped at ``max_exp``.

    Args:
        w: the weight matrix (any shape; after CAS if CAS is used).

    Returns:
        ``n`` as a Python int.
    """
    a = w.detach().double().abs().flatten()
    nonzero = a[a > 0]
    if nonzero.numel() == 0:
        return 0
    amax, amin = float(nonzero.max()), float(nonzero.min())
    lo, hi = PTS_OVERFLOW_BAND
    if amax >= hi:
        return 0
    for n in range(max_exp + 1):
        scale = 2.0**n  # exact in float64, so the tests below are exact
        top = amax * scale
        # Condition (2) holds for the largest element first: any element in the band has
        # |ω|·2ⁿ ≤ amax·2ⁿ < 448, and amax·2ⁿ ≥ 224 puts amax itself in the band.
        if top >= lo or amin * scale >= PTS_UNDERFLOW:
            return n
    return max_exp


# --------------------------------------------------------------------------- weights


def _pad_groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """Zero-pad the last dim of ``w (O, K)`` to a multiple of ``group_size``."""
    k = w.shape[-1]
    pad = (-k) % group_size
    return torch.nn.functional.pad(w, (0, pad)) if pad else w


def quantize_weight_int4(
    w: torch.Tensor, group_size: int = GROUP_SIZE, *, pts_exp: int = 0, compute_dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor]:
    """INT4 symmetric per (output row, input group) with an e4m3 scale, after the PTS factor ``2^pts_exp``.

    Args:
        w: ``(O, K)`` float weight.
        group_size: input channels per group (128 in FireQ).
        pts_exp: ``n`` of the per-tensor factor ``δ = 2ⁿ`` (see :func:`pts_exponent`).

    Returns:
        ``(ŵ, σ)``: ``ŵ (O, Kp)`` integer-valued in ``[−8, 7]`` and ``σ (O, G)`` on the e4m3 grid,
        both in ``compute_dtype``; ``w · 2ⁿ ≈ ŵ · σ`` group-wise (padding columns are 0).
    """
    if w.dim() != 2:
        raise ValueError(f"quantize_weight_int4 expects a 2-D (O, K) weight, got shape {tuple(w.shape)}")
    if group_size <= 0 or group_size % 2:
        raise ValueError(f"group_size must be a positive even int, got {group_size}")
    wp = _pad_groups(w.detach().to(compute_dtype) * 2.0**pts_exp, group_size)
    o, kp = wp.shape
    q, scale = quantize_kv_int4(wp.reshape(o, kp // group_size, group_size), compute_dtype=compute_dtype)
    return q.reshape(o, kp), scale.squeeze(-1)


def quantize_weight(
    w: torch.Tensor, group_size: int = GROUP_SIZE, *, pts: bool = True, pts_exp: int | None = None
) -> PackedWeight:
    """Quantize and pack ``w (O, K)``: PTS exponent (if ``pts``), INT4 groups, two nibbles per byte.

    ``pts_exp`` overrides the exponent :func:`pts_exponent` would choose.
    """
    n = (pts_exponent(w) if pts else 0) if pts_exp is None else int(pts_exp)
    q, scale = quantize_weight_int4(w, group_size, pts_exp=n)
    return PackedWeight(pack_int4_signed(q), scale.to(torch.float8_e4m3fn), n, w.shape[1], group_size)


def unpack_weight(packed: PackedWeight, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ŵ (O, Kp), σ (O, G))`` of a :class:`PackedWeight` in ``dtype``."""
    return unpack_int4_signed(packed.qweight, dtype), packed.scales.to(dtype)


def dequantize_weight(
    packed: PackedWeight, operand: str = "group", dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """The float weight ``(O, K)`` the product effectively uses, PTS undone.

    ``"group"``: ``ŵ σ 2⁻ⁿ``; ``"lut"``: ``e4m3(ŵ σ) 2⁻ⁿ`` (FireQ's FP8 look-up table).
    """
    _check_operand(operand)
    q, scale = unpack_weight(packed, dtype)
    w = q.reshape(q.shape[0], -1, packed.group_size) * scale.unsqueeze(-1)
    if operand == "lut":
        w = cast_fp8(w, "fp8_e4m3")
    return (w.reshape(q.shape[0], -1) * 2.0**-packed.pts_exp)[:, : packed.in_features]


def _check_operand(operand: str) -> None:
    if operand not in WEIGHT_OPERANDS:
        raise ValueError(f"weight operand {operand!r} is not valid; choose one of {list(WEIGHT_OPERANDS)}")


# --------------------------------------------------------------------------- activations


def quantize_activation_fp8(
    x: torch.Tensor, *, compute_dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor]:
    """FireQ eq. 2 per token: ``β = bf16(absmax / 448)``, ``x̂ = e4m3(x / β)``.

    Args:
        x: ``(..., K)`` activations.

    Returns:
        ``(x̂ (..., K), β (..., 1))`` in ``compute_dtype``; ``x ≈ β x̂``. (The same quantizer as
        FireQ's FP8 queries, :func:`~quantpatch.kernels.fireq_kv.fireq_ref.quantize_query_fp8`.)
    """
    return quantize_query_fp8(x, compute_dtype=compute_dtype)


# --------------------------------------------------------------------------- product


def w4a8_linear_ref(
    x: torch.Tensor,
    packed: PackedWeight,
    bias: torch.Tensor | None = None,
    *,
    operand: str = "group",
    compute_dtype: torch.dtype = torch.float64,
    unpacked: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """W4A8-FP linear ``y = x Wᵀ + b`` with FireQ's numerics (module docstring).

    ``"group"``: ``y = β · 2⁻ⁿ · Σ_g σ_g (x̂_g ŵ_gᵀ) + b``, each group's dot accumulated on its
    own (FP32 in the kernel, ``compute_dtype`` here; the products ``x̂ ŵ`` are exact in both);
    ``"lut"``: ``y = β · 2⁻ⁿ · x̂ e4m3(ŵ σ)ᵀ + b``.

    Args:
        x: ``(..., K)`` activations (any float dtype).
        packed: the quantized weight, ``K == packed.in_features``.
        bias: ``(O,)`` or None.
        unpacked: ``unpack_weight(packed, compute_dtype)`` if the caller keeps it (saves the unpacking).

    Returns:
        ``y (..., O)`` in ``x``'s dtype.
    """
    _check_operand(operand)
    k = packed.in_features
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight {k}")
    lead = x.shape[:-1]
    x_hat, beta = quantize_activation_fp8(x.reshape(-1, k), compute_dtype=compute_dtype)
    x_hat = _pad_groups(x_hat, packed.group_size)
    q, scale = unpack_weight(packed, compute_dtype) if unpacked is None else unpacked
    if operand == "lut":
        w_op = cast_fp8(q.reshape(q.shape[0], -1, packed.group_size) * scale.unsqueeze(-1), "fp8_e4m3")
        acc = x_hat @ w_op.reshape(q.shape[0], -1).T
    else:
        o, g, gs = q.shape[0], scale.shape[1], packed.group_size
        w_g = q.reshape(o, g, gs).permute(1, 2, 0)  # (G, gs, O)
        sigma = scale.T.unsqueeze(1)  # (G, 1, O)
        rows = max(1, _PARTIAL_ELEMENTS // max(g * o, 1))
        chunks = []
        for x_c in x_hat.split(rows):  # bounded (G, rows, O) partials
            partial = torch.bmm(x_c.reshape(-1, g, gs).transpose(0, 1), w_g)  # one partial per group
            chunks.append((partial * sigma).sum(0))  # rescaled by its σ, then summed over groups
        acc = torch.cat(chunks) if chunks else x_hat.new_zeros(0, o)
    y = acc * beta * 2.0**-packed.pts_exp
    if bias is not None:
        y = y + bias.to(compute_dtype)
    return y.reshape(*lead, -1).to(x.dtype)


def weight_nbytes(out_features: int, in_features: int, group_size: int = GROUP_SIZE) -> int:
    """Bytes of a packed weight: ``O · Kp/2`` INT4 bytes plus ``O · G`` e4m3 scales."""
    kp = -(-in_features // group_size) * group_size
    return out_features * kp // 2 + out_features * (kp // group_size)


def check_gemm_operands(m: int, k: int, qweight: torch.Tensor, scales: torch.Tensor) -> None:
    """Raise unless ``x (M, K)``, ``qweight (N, K/2)`` (last dim contiguous) and ``scales (N, K/128)`` form a W4A8
    product (the kernels' shapes: K a multiple of ``GROUP_SIZE``)."""
    n = qweight.shape[0]
    if k % GROUP_SIZE or qweight.shape[1] * 2 != k or scales.shape != (n, k // GROUP_SIZE):
        raise ValueError(f"shapes x ({m}, {k}), qweight {tuple(qweight.shape)}, scales {tuple(scales.shape)} "
                         f"do not form a K={k} (multiple of {GROUP_SIZE}) W4A8 product")
    if qweight.stride(-1) != 1:
        raise ValueError("qweight needs a contiguous last dim")
