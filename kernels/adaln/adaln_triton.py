"""Adaptive layer norm of a diffusion transformer block in one Triton launch per step: :func:`modulated_norm` and
:func:`gated_residual` compute :mod:`~quantpatch.kernels.adaln.adaln_ref`'s two functions.

A program takes one row of ``C`` channels (a token), reads it once and writes it once, where the block's own lines
run four or five elementwise kernels over float32 intermediates each (at Wan2.1-1.3B's 32,760 tokens of 1,536
channels, about 1.9 GB of memory traffic for a modulated norm and 1.7 GB for a gated residual, against 0.2 and 0.3 GB
here). Compiled without fused multiply-adds (``enable_fp_fusion=False``): the modulation's product and sum and the
residual's product and sum round as PyTorch's separate kernels do, and the result is rounded once to the output dtype
(to nearest even; bfloat16 emulated exactly in the interpreter). The gated residual is thus bit for bit the
reference's. The norm's mean and variance are sums in another order than PyTorch's layer-norm kernel (its Welford
updates), so its float32 result may differ from the reference's in the last bits, which then changes a rounded
element by one unit of its last place where the float32 value lies that close to a rounding boundary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..compiled_launch import LaunchPlans, interpreting, next_pow2
from ..rounding_triton import ROUND_TO, _round_to

MAX_CHANNELS = 16384  # a row in one program's registers


@triton.jit
def _modulated_norm_kernel(
    H_ptr, W_ptr, B_ptr, SC_ptr, SH_ptr, O_ptr,
    SEQ, C, stride_mb, stride_ms, eps,
    BLOCK: tl.constexpr, AFFINE: tl.constexpr, MODULATE: tl.constexpr, OUT: tl.constexpr, EMULATE: tl.constexpr,
):
    """Row ``program_id(0)`` of ``h (B·S, C)``: ``LN(h) (· weight + bias) (· (1 + scale) + shift)`` into ``o``; the
    modulation rows at ``batch · stride_mb + token · stride_ms``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < C
    x = tl.load(H_ptr + row * C + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / C
    centred = tl.where(mask, x - mean, 0.0)
    var = tl.sum(centred * centred, axis=0) / C
    y = centred * tl.math.rsqrt(var + eps)
    if AFFINE:
        y = y * tl.load(W_ptr + cols, mask=mask, other=0.0) + tl.load(B_ptr + cols, mask=mask, other=0.0)
    if MODULATE:
        mod = (row // SEQ) * stride_mb + (row % SEQ) * stride_ms + cols
        scale = tl.load(SC_ptr + mod, mask=mask, other=0.0)
        y = y * (1.0 + scale) + tl.load(SH_ptr + mod, mask=mask, other=0.0)
    tl.store(O_ptr + row * C + cols, _round_to(y, OUT, EMULATE).to(O_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_residual_kernel(
    H_ptr, A_ptr, G_ptr, O_ptr,
    SEQ, C, stride_gb, stride_gs,
    BLOCK: tl.constexpr, OUT: tl.constexpr, EMULATE: tl.constexpr,
):
    """Row ``program_id(0)``: ``h + a · gate`` into ``o``, the gate row at ``batch · stride_gb + token · stride_gs``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < C
    h = tl.load(H_ptr + row * C + cols, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(A_ptr + row * C + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(G_ptr + (row // SEQ) * stride_gb + (row % SEQ) * stride_gs + cols, mask=mask, other=0.0)
    tl.store(O_ptr + row * C + cols, _round_to(h + a * gate, OUT, EMULATE).to(O_ptr.dtype.element_ty), mask=mask)


_NORM = LaunchPlans(_modulated_norm_kernel)
_GATE = LaunchPlans(_gated_residual_kernel)


def _rows_unsupported(name: str, t: torch.Tensor, like: torch.Tensor) -> str | None:
    if t.shape != like.shape or not t.is_contiguous() or t.dtype not in ROUND_TO or t.device != like.device:
        return (f"{name} must be a contiguous float16 / bfloat16 / float32 tensor of shape {tuple(like.shape)} on "
                f"{like.device}, got {tuple(t.shape)} {t.dtype} on {t.device}")
    return None


def _modulation_unsupported(name: str, t: torch.Tensor, h: torch.Tensor) -> str | None:
    b, seq, c = h.shape
    if (t.dtype != torch.float32 or t.dim() != 3 or t.shape[0] != b or t.shape[1] not in (1, seq)
            or t.shape[2] != c or t.stride(-1) != 1 or t.device != h.device):
        return (f"{name} must be float32 of shape ({b}, 1 or {seq}, {c}) with contiguous channels on {h.device}, got "
                f"{tuple(t.shape)} {t.dtype}")
    return None


def adaln_unsupported(h: torch.Tensor, *, branch: torch.Tensor | None = None, weight: torch.Tensor | None = None,
                      bias: torch.Tensor | None = None, modulation: tuple[torch.Tensor, ...] = ()) -> str | None:
    """Why :func:`modulated_norm` (``weight``, ``bias``, ``modulation = (scale, shift)``) or :func:`gated_residual`
    (``branch``, ``modulation = (gate,)``) cannot take these tensors; None if it can."""
    if h.dim() != 3 or not 0 < h.shape[-1] <= MAX_CHANNELS:
        return f"h must be (B, S, C) with 0 < C <= {MAX_CHANNELS}, got shape {tuple(h.shape)}"
    reason = _rows_unsupported("h", h, h) or (None if branch is None else _rows_unsupported("the branch", branch, h))
    if reason:
        return reason
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.shape != h.shape[-1:] or t.dtype != torch.float32 or not t.is_contiguous()
                              or t.device != h.device):
            return f"the norm's {name} must be float32 of shape ({h.shape[-1]},) on {h.device}"
    for i, t in enumerate(modulation):
        reason = _modulation_unsupported(f"modulation row {i}", t, h)
        if reason:
            return reason
    if len(modulation) == 2 and modulation[0].stride() != modulation[1].stride():
        return "scale and shift must have the same strides"
    return None


def _modulation_strides(t: torch.Tensor) -> tuple[int, int]:
    return t.stride(0), t.stride(1) if t.shape[1] > 1 else 0


def modulated_norm(h: torch.Tensor, eps: float, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                   scale: torch.Tensor | None = None, shift: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`~quantpatch.kernels.adaln.adaln_ref.modulated_norm_ref` in one launch on the current stream.

    Args:
        h: ``(B, S, C)`` contiguous, float16 / bfloat16 / float32.
        eps: the layer norm's epsilon.
        weight, bias: the norm's float32 affine ``(C,)``, both or neither.
        scale, shift: float32 ``(B, 1 or S, C)`` with contiguous channels (views of a larger table are fine), both or
            neither.

    Returns:
        ``(B, S, C)`` in ``h``'s dtype (the norm's float32 sums in another order than PyTorch's: module docstring).
    """
    if (weight is None) != (bias is None) or (scale is None) != (shift is None):
        raise ValueError("pass the norm's weight and bias both or neither, and scale and shift both or neither")
    modulation = () if scale is None else (scale, shift)
    reason = adaln_unsupported(h, weight=weight, bias=bias, modulation=modulation)
    tensors = (h, h if weight is None else weight, h if bias is None else bias, *(modulation or (h, h)))
    ints = (*(_modulation_strides(scale) if modulation else (0, 0)), float(eps))
    return _launch_rows(_NORM, reason, h, tensors, ints, dict(AFFINE=weight is not None, MODULATE=bool(modulation)))


def gated_residual(h: torch.Tensor, branch: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """:func:`~quantpatch.kernels.adaln.adaln_ref.gated_residual_ref` in one launch on the current stream, bit for bit.

    Args:
        h: ``(B, S, C)`` contiguous, float16 / bfloat16 / float32.
        branch: ``(B, S, C)`` contiguous, float16 / bfloat16 / float32 (the attention or feed-forward output).
        gate: float32 ``(B, 1 or S, C)`` with contiguous channels.

    Returns:
        ``(B, S, C)`` in ``h``'s dtype.
    """
    reason = adaln_unsupported(h, branch=branch, modulation=(gate,))
    return _launch_rows(_GATE, reason, h, (h, branch, gate), _modulation_strides(gate), {})


def _launch_rows(plans: LaunchPlans, reason: str | None, h: torch.Tensor, tensors: tuple, ints: tuple,
                 constexprs: dict) -> torch.Tensor:
    """Raise ``reason`` if there is one, else launch ``plans``' kernel a program a row of ``h`` into a new tensor like
    ``h``: its arguments ``tensors``, the output, the sequence length and channels, ``ints``, then the row block,
    ``constexprs``, the output rounding and the interpreter flag."""
    if reason:
        raise ValueError(reason)
    out = torch.empty_like(h)
    b, seq, c = h.shape
    if out.numel():
        block = next_pow2(c)
        constexprs = dict(BLOCK=block, **constexprs, OUT=ROUND_TO[h.dtype], EMULATE=interpreting())
        plans((b * seq,), (*tensors, out, seq, c, *ints), constexprs, num_warps=min(16, max(4, block // 512)),
              enable_fp_fusion=False)
    return out
