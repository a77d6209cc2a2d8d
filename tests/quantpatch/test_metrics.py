"""PSNR and SSIM (``quantpatch.metrics``) against closed forms and a direct per-window computation."""

import math

import pytest
import torch

from quantpatch.metrics import _gaussian_window, psnr, ssim

C1, C2 = 0.01**2, 0.03**2


def _rand(*shape, seed):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_psnr_closed_form():
    ref = _rand(2, 3, 8, 8, seed=0)
    assert psnr(ref, ref) == math.inf
    assert psnr(ref + 0.1, ref) == pytest.approx(20.0)  # MSE 0.01, peak 1
    assert psnr(ref + 0.1 * 255, ref, peak=255.0) == pytest.approx(20.0)


def test_ssim_of_constant_images_is_the_luminance_term():
    a, b = 0.3, 0.7  # no variance: SSIM = (2ab + C1) / (a² + b² + C1)
    x, y = torch.full((1, 16, 16), a, dtype=torch.float64), torch.full((1, 16, 16), b, dtype=torch.float64)
    assert ssim(x, y) == pytest.approx((2 * a * b + C1) / (a * a + b * b + C1), rel=1e-12)


def test_ssim_matches_a_direct_gaussian_weighted_window():
    x, y = _rand(3, 11, 11, seed=1), _rand(3, 11, 11, seed=2)  # one window position per channel
    w = torch.outer(*(2 * [_gaussian_window(11, 1.5)]))
    expected = []
    for a, b in zip(x, y):
        mu_a, mu_b = (w * a).sum(), (w * b).sum()
        var_a, var_b = (w * (a - mu_a) ** 2).sum(), (w * (b - mu_b) ** 2).sum()
        cov = (w * (a - mu_a) * (b - mu_b)).sum()
        expected.append((2 * mu_a * mu_b + C1) * (2 * cov + C2) / ((mu_a**2 + mu_b**2 + C1) * (var_a + var_b + C2)))
    assert ssim(x, y) == pytest.approx(float(torch.stack(expected).mean()), rel=1e-10)


def test_ssim_identity_symmetry_and_noise_order():
    ref = _rand(4, 3, 32, 32, seed=3)
    noise = _rand(4, 3, 32, 32, seed=4) - 0.5
    assert ssim(ref, ref) == pytest.approx(1.0, abs=1e-12)
    small, large = (ref + 0.02 * noise).clamp(0, 1), (ref + 0.2 * noise).clamp(0, 1)
    assert ssim(small, ref) == pytest.approx(ssim(ref, small), rel=1e-12)
    assert 1.0 > ssim(small, ref) > ssim(large, ref)


def test_ssim_rejects_small_or_mismatched_images():
    with pytest.raises(ValueError, match="at least 11x11"):
        ssim(torch.zeros(1, 8, 8), torch.zeros(1, 8, 8))
    with pytest.raises(ValueError, match="shape mismatch"):
        ssim(torch.zeros(1, 16, 16), torch.zeros(1, 16, 17))
