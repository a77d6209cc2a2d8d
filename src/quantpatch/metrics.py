"""Accuracy metrics of a quantized output ``o`` against a reference ``ref`` (SageAttention2 App. A.7),
and image metrics (PSNR, SSIM) of generated frames against a reference generation.

All compute in float64.
"""

from __future__ import annotations

import math

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


def psnr(x: torch.Tensor, ref: torch.Tensor, peak: float = 1.0) -> float:
    """Peak signal-to-noise ratio in dB, ``10 log10(peak² / MSE)`` over all elements; ``inf`` when equal."""
    a, b = _pair(x, ref)
    mse = float(((a - b) ** 2).mean())
    return float("inf") if mse == 0 else 10.0 * math.log10(peak**2 / mse)


def _gaussian_window(size: int, sigma: float) -> torch.Tensor:
    x = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    g = torch.exp(-(x**2) / (2 * sigma**2))
    return g / g.sum()


def ssim(x: torch.Tensor, ref: torch.Tensor, peak: float = 1.0, window: int = 11, sigma: float = 1.5) -> float:
    """Mean structural similarity (Wang et al. 2004) of images ``x`` against ``ref``.

    Args:
        x, ref: ``(..., C, H, W)`` images with values in ``[0, peak]`` (e.g. video frames
            ``(F, C, H, W)``); each channel of each image is compared on its own.
        peak: the dynamic range L; ``C1 = (0.01 L)²``, ``C2 = (0.03 L)²`` as in the paper.
        window, sigma: the Gaussian weighting window (11 × 11, σ = 1.5 as in the paper).

    Returns:
        The SSIM map ``(2 μx μy + C1)(2 σxy + C2) / ((μx² + μy² + C1)(σx² + σy² + C2))`` over
        every full window position (no padding, as the paper's reference code), averaged over
        positions, channels and images.
    """
    if x.shape != ref.shape:
        raise ValueError(f"shape mismatch: {tuple(x.shape)} vs reference {tuple(ref.shape)}")
    if x.dim() < 3 or min(x.shape[-2:]) < window:
        raise ValueError(f"ssim needs (..., C, H, W) images of at least {window}x{window}, got {tuple(x.shape)}")
    h, w = x.shape[-2:]
    a = x.detach().to(torch.float64).reshape(-1, 1, h, w)
    b = ref.detach().to(torch.float64).reshape(-1, 1, h, w).to(a.device)
    g = _gaussian_window(window, sigma).to(a.device)
    kernel_h, kernel_w = g.view(1, 1, window, 1), g.view(1, 1, 1, window)

    def blur(t: torch.Tensor) -> torch.Tensor:  # separable Gaussian, valid positions only
        return torch.nn.functional.conv2d(torch.nn.functional.conv2d(t, kernel_h), kernel_w)

    mu_a, mu_b = blur(a), blur(b)
    var_a = blur(a * a) - mu_a**2
    var_b = blur(b * b) - mu_b**2
    cov = blur(a * b) - mu_a * mu_b
    c1, c2 = (0.01 * peak) ** 2, (0.03 * peak) ** 2
    ssim_map = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a**2 + mu_b**2 + c1) * (var_a + var_b + c2))
    return float(ssim_map.mean())
