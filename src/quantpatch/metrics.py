"""Accuracy metrics of a quantized output ``o`` against a reference ``ref`` (SageAttention2 App. A.7).

All flatten their inputs and compute in float64.
"""

from __future__ import annotations

import torch


def _pair(o: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if o.shape != ref.shape:
        raise ValueError(f"shape mismatch: {tuple(o.shape)} vs reference {tuple(ref.shape)}")
    return o.detach().to(torch.float64).flatten(), ref.detach().to(torch.float64).flatten()


def cos_sim(o: torch.Tensor, ref: torch.Tensor) -> float:
    """``Σ o·ref / (‖o‖ ‖ref‖)``."""
    a, b = _pair(o, ref)
    return float((a * b).sum() / (a.norm() * b.norm()))


def rel_l1(o: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L1 distance ``Σ|o − ref| / Σ|ref|``."""
    a, b = _pair(o, ref)
    return float((a - b).abs().sum() / b.abs().sum())


def rmse(o: torch.Tensor, ref: torch.Tensor) -> float:
    """Root mean squared error."""
    a, b = _pair(o, ref)
    return float(((a - b) ** 2).mean().sqrt())


def mre(o: torch.Tensor, ref: torch.Tensor) -> float:
    """Mean relative error (INT-FlashAttention §4.2): the mean over output rows (last dim = features)
    of each row's ``Σ|o − ref| / Σ|ref|``."""
    if o.shape != ref.shape:
        raise ValueError(f"shape mismatch: {tuple(o.shape)} vs reference {tuple(ref.shape)}")
    a, b = o.detach().to(torch.float64), ref.detach().to(torch.float64)
    per_row = (a - b).abs().sum(-1) / b.abs().sum(-1).clamp_min(torch.finfo(torch.float64).tiny)
    return float(per_row.mean())


def all_metrics(o: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """``{"cos_sim", "rel_l1", "rmse", "mre"}`` of ``o`` against ``ref``."""
    return {"cos_sim": cos_sim(o, ref), "rel_l1": rel_l1(o, ref), "rmse": rmse(o, ref), "mre": mre(o, ref)}
