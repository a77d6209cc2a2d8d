"""Rotary position embedding over interleaved channel pairs in one Triton launch.

:func:`rotary_interleaved` computes :func:`~quantpatch.kernels.rotary.rotary_ref.rotary_interleaved_ref` bit for
bit, under either reading of the tables (a constexpr): float32 products and sums compiled without fused
multiply-adds (``enable_fp_fusion=False``), the result rounded to ``x``'s dtype once (to nearest even, emulated
exactly in the interpreter). A program takes ``TOKENS`` positions and up to ``MAX_HEADS`` heads, each head's
channels loaded and stored contiguously and the pairs split in registers: it reads ``x`` and writes the output once,
where a processor's own rotation runs eight or more elementwise kernels over float32 intermediates (at Wan2.1-1.3B's
32,760 tokens, 12 heads of 128, about 1.8 GB of traffic for each of the query and the key of a layer, against
0.2 GB here).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..compiled_launch import LaunchPlans, cdiv, interpreting
from ..rounding_triton import _to_bf16
from .rotary_ref import TABLES

TOKENS = 4  # positions a program
MAX_HEADS = 8  # heads a program, at most


@triton.jit
def _rotary_kernel(
    X_ptr, C_ptr, S_ptr, O_ptr,
    N_TOK, SEQ,
    stride_xb, stride_xs, stride_xh,
    stride_cb, stride_cs,
    stride_ob, stride_os, stride_oh,
    D: tl.constexpr, BLOCK_H: tl.constexpr, TOKENS: tl.constexpr, PAIRED: tl.constexpr, EMULATE: tl.constexpr,
):
    """Positions ``TOKENS · program_id(0)`` on (flattened batch × sequence), heads ``BLOCK_H · program_id(1)`` on;
    each head's ``D`` channels read and written contiguously, the pairs split and joined in registers. ``PAIRED``:
    the ``"paired"`` reading of the tables, else ``"wan"``'s (``rotary_ref``)."""
    chans = tl.arange(0, D)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    for t in tl.static_range(TOKENS):
        tok = tl.program_id(0) * TOKENS + t
        if tok < N_TOK:
            b = (tok // SEQ).to(tl.int64)
            pos = (tok % SEQ).to(tl.int64)
            c1, c2 = tl.split(tl.reshape(tl.load(C_ptr + b * stride_cb + pos * stride_cs + chans), [D // 2, 2]))
            s1, s2 = tl.split(tl.reshape(tl.load(S_ptr + b * stride_cb + pos * stride_cs + chans), [D // 2, 2]))
            if not PAIRED:
                c2 = c1
                s1 = s2
            x = tl.load(X_ptr + b * stride_xb + pos * stride_xs + heads[:, None] * stride_xh + chans[None, :])
            x1, x2 = tl.split(tl.reshape(x.to(tl.float32), [BLOCK_H, D // 2, 2]))
            even = x1 * c1[None, :] - x2 * s1[None, :]
            odd = x1 * s2[None, :] + x2 * c2[None, :]
            out = tl.reshape(tl.join(even, odd), [BLOCK_H, D])
            if O_ptr.dtype.element_ty == tl.bfloat16:
                out = _to_bf16(out, EMULATE)
            tl.store(O_ptr + b * stride_ob + pos * stride_os + heads[:, None] * stride_oh + chans[None, :],
                     out.to(O_ptr.dtype.element_ty))


_LAUNCH = LaunchPlans(_rotary_kernel)


def rotary_unsupported(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> str | None:
    """Why :func:`rotary_interleaved` cannot take these tensors (None if it can)."""
    if x.dim() != 4 or x.shape[-1] < 2 or x.shape[-1] & (x.shape[-1] - 1):
        return f"x must be (B, S, H, D) with D a power of two >= 2, got shape {tuple(x.shape)}"
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32) or x.stride(-1) != 1:
        return f"x must be float16 / bfloat16 / float32 with contiguous channels (dtype {x.dtype})"
    b, seq, _, d = x.shape
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype != torch.float32 or t.dim() != 4 or t.shape[1:] != (seq, 1, d) or t.shape[0] not in (1, b):
            return f"{name} must be float32 of shape (1 or B, S, 1, D) = (.., {seq}, 1, {d}), got {tuple(t.shape)}"
        if t.stride(-1) != 1 or t.device != x.device:
            return f"{name} must have contiguous channels on x's device"
    if cos.stride()[:2] != sin.stride()[:2] or cos.shape != sin.shape:
        return "cos and sin must share shape and strides"
    return None


def rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, tables: str = "wan") -> torch.Tensor:
    """:func:`~quantpatch.kernels.rotary.rotary_ref.rotary_interleaved_ref` in one launch on the current stream.

    Args:
        x: ``(B, S, H, D)``, any strides with contiguous channels; ``D`` a power of two.
        cos, sin: float32 ``(1 or B, S, 1, D)`` with contiguous channels (checked by :func:`rotary_unsupported`).
        tables: ``"wan"`` or ``"paired"`` (``rotary_ref.TABLES``).

    Returns:
        ``out`` like ``x`` (``torch.empty_like``), bit for bit the reference's.
    """
    reason = rotary_unsupported(x, cos, sin)
    if tables not in TABLES:
        reason = f"tables={tables!r}: one of {TABLES}"
    if reason:
        raise ValueError(reason)
    out = torch.empty_like(x)
    b, seq, h, d = x.shape
    n_tok = b * seq
    if n_tok and h:
        cb = cos.stride(0) if cos.shape[0] > 1 else 0
        block_h = min(MAX_HEADS, h & -h)  # the largest power of two dividing H: no masked heads
        _LAUNCH((cdiv(n_tok, TOKENS), h // block_h),
                (x, cos, sin, out, n_tok, seq, x.stride(0), x.stride(1), x.stride(2), cb, cos.stride(1),
                 out.stride(0), out.stride(1), out.stride(2)),
                dict(D=d, BLOCK_H=block_h, TOKENS=TOKENS, PAIRED=tables == "paired", EMULATE=interpreting()),
                num_warps=4, enable_fp_fusion=False)
    return out
