"""FP8 linear layer (``linear="fp8"``): the pure-PyTorch reference of its numerics.

Weights are quantized once per output channel, activations per token, by the same row quantizer
(:func:`quantize_rows_fp8_ref`, :func:`~quantpatch.kernels.quant_ref.quantize_fp8` in float32)::

    s = absmax(row) / 448          (1 for an all-zero row: it quantizes to zeros, not 0/0)
    q = e4m3(row / s)              saturating to ±448, round to nearest even

    y = (q_x · q_wᵀ) ⊙ s_x ⊙ s_wᵀ (+ bias)   in float32, then cast to the input's dtype

A layer may take its input before an activation (``activation``, one of :data:`ACTIVATIONS`): ``x`` is then first
replaced by ``F.gelu(x, approximate=...)`` in ``x``'s dtype, exactly the feed-forward's own GELU, whose output
the unfused layer would have quantized (:mod:`quantpatch.patches.linears` fuses the GELU of Diffusers'
feed-forwards into their second linear this way).

Each product of two e4m3 values has at most 8 significant bits, so it is exact in float32; the
sums are float32 (a GPU GEMM sums in another order). ``torch._scaled_mm`` with row-wise scales
(:mod:`quantpatch.fp8_linear`) computes the same expression on sm_89+ GPUs, and
:mod:`quantpatch.kernels.fp8_linear.fp8_quant_triton` quantizes the activations bit for bit as here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..quant_ref import quantize_fp8

E4M3 = "fp8_e4m3"
# an activation a layer applies to its input before quantizing it → F.gelu's ``approximate``
ACTIVATIONS = {"gelu": "none", "gelu_tanh": "tanh"}


def activate_ref(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    """``x`` (``activation`` None) or ``F.gelu(x, approximate=ACTIVATIONS[activation])`` in ``x``'s dtype."""
    return x if activation is None else F.gelu(x, approximate=ACTIVATIONS[activation])


def quantize_rows_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 quantization of ``x (M, K)`` (activations per token, weights per output channel).

    Returns:
        ``q float8_e4m3fn (M, K)`` and ``s float32 (M, 1)`` with ``x ≈ q · s``, computed in float32.
    """
    xf = x.float()
    q, scale = quantize_fp8(xf, E4M3, xf.abs().amax(dim=-1, keepdim=True))
    return q.to(torch.float8_e4m3fn), scale


def fp8_linear_ref(x: torch.Tensor, weight_fp8: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None = None, activation: str | None = None) -> torch.Tensor:
    """``x (..., K)`` → ``y (..., N)`` in ``x``'s dtype, for ``weight_fp8 float8_e4m3fn (N, K)``, ``weight_scale
    float32 (N,)`` (from :func:`quantize_rows_fp8_ref` of the weight), an optional ``bias (N,)`` and an optional
    ``activation`` of the input (:func:`activate_ref`)."""
    n, k = weight_fp8.shape
    x_fp8, x_scale = quantize_rows_fp8_ref(activate_ref(x, activation).reshape(-1, k))
    y = torch.matmul(x_fp8.float(), weight_fp8.float().t()) * x_scale * weight_scale
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], n)
