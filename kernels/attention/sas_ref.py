"""TurboAttention's Sparse Activated Softmax exponential (SAS), reference.

For ``x <= 0`` (scores minus the running row max), TurboAttention §4 and Algorithm 3::

    SAS(x) = 0                                   if x < n_r
           = LUT[⌊−x⌋] · POLY(−x − ⌊−x⌋)          otherwise

with ``LUT[i] = e^{−i}`` for the integer part and the least-squares cubic for
``e^{−f}, f ∈ [0, 1)`` (TurboAttention eq. 15)::

    POLY(f) = −0.1025 f³ + 0.4626 f² − 0.9922 f + 0.9996

The paper fixes ``n_r = −6`` in its experiments.
"""

from __future__ import annotations

import math

import torch

POLY_COEFFS = (-0.1025, 0.4626, -0.9922, 0.9996)  # f³, f², f, 1


def sas_lut(threshold: float) -> list[float]:
    """``[e^0, e^-1, …, e^-⌈-threshold⌉]``: the integer-part table for threshold ``n_r``."""
    return [math.exp(-i) for i in range(int(math.ceil(-threshold)) + 1)]


def sas_poly(f: torch.Tensor) -> torch.Tensor:
    """Horner evaluation of the cubic fit of ``e^{-f}`` on ``[0, 1)``."""
    c3, c2, c1, c0 = POLY_COEFFS
    return ((c3 * f + c2) * f + c1) * f + c0


def sas_exp(x: torch.Tensor, threshold: float = -6.0) -> torch.Tensor:
    """SAS approximation of ``exp(x)`` for ``x <= 0``; 0 below ``threshold`` (and for −∞)."""
    t = torch.clamp(-x, min=0.0)
    keep = x >= threshold
    t = torch.where(keep, t, torch.zeros_like(t))
    i = torch.floor(t)
    lut = torch.tensor(sas_lut(threshold), dtype=x.dtype, device=x.device)
    value = lut[i.long()] * sas_poly(t - i)
    return torch.where(keep, value, torch.zeros_like(value))
