"""Pure-PyTorch reference quantizers shared by every mode.

Conventions (the Triton kernels reproduce them bit for bit):
  * symmetric integer quantization: ``scale = absmax(group) / qmax`` in the compute dtype,
    ``q = clamp(round_half_even(x / scale), -qmax, qmax)``; an all-zero group gets scale 1
    so that it quantizes to 0 instead of 0/0.
  * token-axis groupings return the integer tensor and a *per-token* scale vector (each
    token carries the scale of its group), so a kernel dequantizes any grouping the same way.
  * FP8 casts saturate to the format's finite range before rounding to nearest even.

Tensor layout is ``(..., N, D)``: tokens on dim -2, channels on dim -1.
"""

from __future__ import annotations

import torch

FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


# --------------------------------------------------------------------------- groupings


def token_group_index(n: int, granularity: str, *, role: str, block: int, warps: int = 4) -> torch.Tensor:
    """Group id of each of ``n`` tokens for a Q (``role="q"``) or K (``role="k"``) quantizer.

    Groupings (SageAttention2 §3.2 and Appendix A.6, ``block`` = b_q for Q, b_k for K):
      * ``tensor``: one group.
      * ``block``: tokens ``[i·block, (i+1)·block)``.
      * ``warp``: Q blocks split into ``warps`` segments of ``block / warps`` rows; for K
        the warps share the block, so this equals ``block``.
      * ``thread``: Q rows ``8k + i`` of a warp segment share group ``i`` (8 groups per
        warp, ``8·warps`` per block); K rows ``8k + 2i`` and ``8k + 2i + 1`` of a block share
        group ``i`` (4 groups per block), matching the mma.m16n8k64 accumulator layout.
      * ``token``: one group per token.

    Returns:
        int64 tensor ``(n,)`` of group ids, numbered consecutively from 0.
    """
    t = torch.arange(n)
    if granularity == "tensor":
        return torch.zeros(n, dtype=torch.long)
    if granularity == "token":
        return t
    if granularity == "block" or (granularity == "warp" and role == "k"):
        return t // block
    if granularity == "warp":
        return t // (block // warps)
    if granularity == "thread":
        if role == "q":
            return (t // (block // warps)) * 8 + t % 8
        return (t // block) * 4 + (t % 8) // 2
    raise ValueError(f"unknown granularity {granularity!r}; valid: tensor, block, warp, thread, token")


def _group_absmax(x: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """``absmax`` of ``x (..., N, D)`` over each token group, broadcast back to ``(..., N, 1)``."""
    n_groups = int(group.max()) + 1 if group.numel() else 0
    row_max = x.abs().amax(dim=-1)  # (..., N)
    idx = group.to(x.device).expand_as(row_max)
    out = torch.zeros(*row_max.shape[:-1], n_groups, dtype=x.dtype, device=x.device)
    out = out.scatter_reduce(-1, idx, row_max, reduce="amax", include_self=False)
    return out.gather(-1, idx).unsqueeze(-1)


def symmetric_scale(absmax: torch.Tensor, qmax: float) -> torch.Tensor:
    """``absmax / qmax``, with 1 where the group is all zeros.

    The divisor is a tensor: CUDA PyTorch turns division by a Python scalar into a multiply by
    its reciprocal, which is not the IEEE quotient the kernels compute.
    """
    scale = absmax / torch.tensor(qmax, dtype=absmax.dtype, device=absmax.device)
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def quantize_symmetric(x: torch.Tensor, scale: torch.Tensor, qmax: int) -> torch.Tensor:
    """``clamp(round_half_even(x / scale), -qmax, qmax)`` as an integer-valued tensor of ``x``'s dtype."""
    return torch.clamp(torch.round(x / scale), -qmax, qmax)


def token_absmax(x: torch.Tensor, granularity: str, *, role: str, block: int, warps: int = 4) -> torch.Tensor:
    """``absmax`` of ``x (..., N, D)`` over each token group of :func:`token_group_index`, as ``(..., N, 1)``."""
    if granularity == "tensor":
        return x.abs().amax().reshape([1] * x.dim()).expand(*x.shape[:-1], 1)
    group = token_group_index(x.shape[-2], granularity, role=role, block=block, warps=warps)
    return _group_absmax(x, group)


def quantize_tokens(
    x: torch.Tensor, granularity: str, *, role: str, qmax: int, block: int, warps: int = 4
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric integer quantization of ``x (..., N, D)`` with token-axis groups.

    Returns:
        ``(q, scale)``: ``q (..., N, D)`` integer-valued in ``[-qmax, qmax]`` (dtype of ``x``)
        and ``scale (..., N, 1)``, the scale of each token's group; ``x ≈ q * scale``.
    """
    scale = symmetric_scale(token_absmax(x, granularity, role=role, block=block, warps=warps), qmax)
    return quantize_symmetric(x, scale, qmax), scale


def quantize_channels(x: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel symmetric quantization over all tokens: ``scale (..., 1, D)``."""
    scale = symmetric_scale(x.abs().amax(dim=-2, keepdim=True), qmax)
    return quantize_symmetric(x, scale, qmax), scale


# --------------------------------------------------------------------------- floating formats


def cast_fp8(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Round ``x`` to FP8 (``fp8_e4m3`` or ``fp8_e5m2``) with saturation; returned in ``x``'s dtype."""
    limit = FP8_MAX[fmt]
    return torch.clamp(x, -limit, limit).to(FP8_DTYPES[fmt]).to(x.dtype)


def quantize_fp8(x: torch.Tensor, fmt: str, absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled FP8: ``scale = absmax / FP8_MAX``, ``x ≈ cast_fp8(x / scale) * scale``."""
    scale = symmetric_scale(absmax, FP8_MAX[fmt])
    return cast_fp8(x / scale, fmt), scale


def truncate_fp22(x: torch.Tensor) -> torch.Tensor:
    """Emulate the FP8-MMA accumulator of Ada/Hopper: FP32 with the 10 low mantissa bits zeroed.

    SageAttention2 §3.4 measured it as 1 sign, 8 exponent, 13 mantissa bits, truncating.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"truncate_fp22 expects float32, got {x.dtype}")
    return (x.view(torch.int32) & ~0x3FF).view(torch.float32)


# --------------------------------------------------------------------------- asymmetric


def quantize_asymmetric_int(
    x_int: torch.Tensor, bits: int, dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TurboAttention progressive step: INT8 values → ``bits``-bit asymmetric with integer scale/zero.

    Along ``dim`` (TurboAttention Algorithm 1, channel-wise per block)::

        s = max(1, round((max − min) / (2^bits − 1)))      z = round(min / s)
        q = clamp(round(x / s − z), 0, 2^bits − 1)          x ≈ (q + z) · s

    Returns:
        ``(q, s, z)`` integer-valued tensors (dtype of ``x_int``); ``s`` and ``z`` keep ``dim``
        with size 1.
    """
    hi = x_int.amax(dim=dim, keepdim=True)
    lo = x_int.amin(dim=dim, keepdim=True)
    levels = 2**bits - 1
    s = torch.clamp(torch.round((hi - lo) / levels), min=1)
    z = torch.round(lo / s)
    q = torch.clamp(torch.round(x_int / s - z), 0, levels)
    return q, s, z


def dequantize_asymmetric_int(q: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_asymmetric_int` back to the INT8 grid: ``(q + z) · s``."""
    return (q + z) * s
