"""Rotary position embedding in one Triton launch, in each form of :mod:`~quantpatch.kernels.rotary.rotary_ref`.

:func:`rotary_embedding` computes :func:`~quantpatch.kernels.rotary.rotary_ref.rotary_embedding_ref` bit for bit
(the form a constexpr): products rounded to the tables' dtype where it is below float32, float32 sums, compiled
without fused multiply-adds (``enable_fp_fusion=False``), the result rounded to ``x``'s dtype once (to nearest even;
bfloat16 emulated exactly in the interpreter, whose own cast truncates). A program takes ``TOKENS`` positions and
up to ``MAX_HEADS`` heads, each head's channels loaded and stored contiguously and the pairs split in registers: it
reads ``x`` and writes the output once, where a model's own rotation runs six to eight elementwise kernels over
intermediates (at Wan2.1-1.3B's 32,760 tokens, 12 heads of 128, about 1.8 GB of traffic for each of the query and
the key of a layer, against 0.2 GB here).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..compiled_launch import LaunchPlans, cdiv, interpreting
from ..rounding_triton import ROUND_TO, _round_to
from .rotary_ref import FORMS

TOKENS = 4  # positions a program
MAX_HEADS = 8  # heads a program, at most


@triton.jit
def _pairs(v, ROWS: tl.constexpr, D: tl.constexpr, HALVES: tl.constexpr):
    """``v (ROWS, D)`` as its two members of each pair, ``(ROWS, D / 2)`` each."""
    if HALVES:
        return tl.split(tl.permute(tl.reshape(v, [ROWS, 2, D // 2]), (0, 2, 1)))
    return tl.split(tl.reshape(v, [ROWS, D // 2, 2]))


@triton.jit
def _unpairs(first, second, ROWS: tl.constexpr, D: tl.constexpr, HALVES: tl.constexpr):
    """The inverse of :func:`_pairs`."""
    both = tl.join(first, second)
    if HALVES:
        both = tl.permute(both, (0, 2, 1))
    return tl.reshape(both, [ROWS, D])


@triton.jit
def _rotary_kernel(
    X_ptr, C_ptr, S_ptr, O_ptr,
    N_TOK, SEQ,
    stride_xb, stride_xs, stride_xh,
    stride_cb, stride_cs, stride_ch,
    stride_ob, stride_os, stride_oh,
    D: tl.constexpr, BLOCK_H: tl.constexpr, TOKENS: tl.constexpr, FORM: tl.constexpr, PRODUCTS: tl.constexpr,
    OUT: tl.constexpr, HEAD_TABLES: tl.constexpr, EMULATE: tl.constexpr,
):
    """Positions ``TOKENS · program_id(0)`` on (flattened batch × sequence), heads ``BLOCK_H · program_id(1)`` on;
    each head's ``D`` channels read and written contiguously. ``FORM``: 0 ``"wan"``, 1 ``"paired"``, 2
    ``"halves"``; ``PRODUCTS`` / ``OUT``: the rounding of the products and of the result (ids of
    :func:`~quantpatch.kernels.rounding_triton._round_to`); ``HEAD_TABLES``: the tables hold a row per head
    (``stride_ch``), else one row every head shares."""
    HALVES: tl.constexpr = FORM == 2
    chans = tl.arange(0, D)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    for t in tl.static_range(TOKENS):
        tok = tl.program_id(0) * TOKENS + t
        if tok < N_TOK:
            b = (tok // SEQ).to(tl.int64)
            pos = (tok % SEQ).to(tl.int64)
            if HEAD_TABLES:
                rows = b * stride_cb + pos * stride_cs + heads[:, None] * stride_ch + chans[None, :]
                c1, c2 = _pairs(tl.load(C_ptr + rows).to(tl.float32), BLOCK_H, D, HALVES)
                s1, s2 = _pairs(tl.load(S_ptr + rows).to(tl.float32), BLOCK_H, D, HALVES)
            else:
                c = tl.load(C_ptr + b * stride_cb + pos * stride_cs + chans).to(tl.float32)
                s = tl.load(S_ptr + b * stride_cb + pos * stride_cs + chans).to(tl.float32)
                c1, c2 = _pairs(tl.reshape(c, [1, D]), 1, D, HALVES)
                s1, s2 = _pairs(tl.reshape(s, [1, D]), 1, D, HALVES)
            if FORM == 0:
                c2 = c1
                s1 = s2
            x = tl.load(X_ptr + b * stride_xb + pos * stride_xs + heads[:, None] * stride_xh + chans[None, :])
            x1, x2 = _pairs(x.to(tl.float32), BLOCK_H, D, HALVES)
            first = (_round_to(x1 * c1, PRODUCTS, EMULATE) - _round_to(x2 * s1, PRODUCTS, EMULATE))
            second = (_round_to(x1 * s2, PRODUCTS, EMULATE) + _round_to(x2 * c2, PRODUCTS, EMULATE))
            out = _round_to(_unpairs(first, second, BLOCK_H, D, HALVES), OUT, EMULATE)
            tl.store(O_ptr + b * stride_ob + pos * stride_os + heads[:, None] * stride_oh + chans[None, :],
                     out.to(O_ptr.dtype.element_ty))


_LAUNCH = LaunchPlans(_rotary_kernel)


_FORM = {form: i for i, form in enumerate(FORMS)}


def rotary_unsupported(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> str | None:
    """Why :func:`rotary_embedding` cannot take these tensors (None if it can)."""
    if x.dim() != 4 or x.shape[-1] < 2 or x.shape[-1] & (x.shape[-1] - 1):
        return f"x must be (B, S, H, D) with D a power of two >= 2, got shape {tuple(x.shape)}"
    if x.dtype not in ROUND_TO or x.stride(-1) != 1:
        return f"x must be float16 / bfloat16 / float32 with contiguous channels (dtype {x.dtype})"
    b, seq, _, d = x.shape
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype not in (torch.float32, x.dtype):
            return f"{name} must be float32 or x's dtype {x.dtype}, got {t.dtype}"
        if t.dim() != 4 or t.shape[1] != seq or t.shape[2] not in (1, x.shape[2]) or t.shape[3] != d \
                or t.shape[0] not in (1, b):
            return f"{name} must have shape (1 or B, S, 1 or H, D) = (.., {seq}, .., {d}), got {tuple(t.shape)}"
        if t.stride(-1) != 1 or t.device != x.device:
            return f"{name} must have contiguous channels on x's device"
    if cos.stride()[:3] != sin.stride()[:3] or cos.shape != sin.shape or cos.dtype != sin.dtype:
        return "cos and sin must share shape, strides and dtype"
    return None


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, form: str = "wan") -> torch.Tensor:
    """:func:`~quantpatch.kernels.rotary.rotary_ref.rotary_embedding_ref` in one launch on the current stream.

    Args:
        x: ``(B, S, H, D)``, any strides with contiguous channels; ``D`` a power of two.
        cos, sin: ``(1 or B, S, 1 or H, D)`` (a table every head shares, or one a head), float32 or ``x``'s dtype,
            contiguous channels (:func:`rotary_unsupported`).
        form: one of ``rotary_ref.FORMS``.

    Returns:
        ``out`` like ``x`` (``torch.empty_like``), bit for bit the reference's.
    """
    reason = rotary_unsupported(x, cos, sin) if form in FORMS else f"form={form!r}: one of {FORMS}"
    if reason:
        raise ValueError(reason)
    return rotary_embedding_checked(x, cos, sin, form)


def rotary_embedding_checked(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, form: str) -> torch.Tensor:
    """:func:`rotary_embedding` without its checks, for callers that already had :func:`rotary_unsupported` return
    None for these tensors (and pass a ``form`` of ``rotary_ref.FORMS``)."""
    return RotaryPlan(x, cos, sin, form)(x, cos, sin)


class RotaryPlan:
    """:func:`rotary_embedding` of every call whose tensors have one layout (shapes, strides, dtypes, device and
    16-byte alignment of their data), the launch's arguments worked out once.

    Made from ``x (B, S, H, D)``, ``cos`` and ``sin`` as the kernel reads them, once :func:`rotary_unsupported`
    returned None for them and ``form`` is one of ``rotary_ref.FORMS``. Called with those tensors or with the
    tensors they are views of (the same data at the same addresses): a caller on a hot path keeps plans by the
    layout of its own tensors and makes the views once a layout. ``out_of`` turns a tensor like ``x`` into the
    caller's layout (the inverse of the view it made of its ``x``); a call returns the output so, strided as
    ``out_of(torch.empty_like(x))`` is.
    """

    __slots__ = ("grid", "ints", "constexprs", "plan_key", "like", "size", "stride", "dtype", "device")

    def __init__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, form: str, out_of=None):
        out = torch.empty_like(x)
        b, seq, h, d = x.shape
        n_tok = b * seq
        head_tables = cos.shape[2] > 1
        block_h = min(MAX_HEADS, h & -h)  # the largest power of two dividing H: no masked heads
        self.grid = (cdiv(n_tok, TOKENS), h // block_h) if n_tok and h else None
        self.ints = (n_tok, seq, x.stride(0), x.stride(1), x.stride(2), cos.stride(0) if cos.shape[0] > 1 else 0,
                     cos.stride(1), cos.stride(2) if head_tables else 0, out.stride(0), out.stride(1), out.stride(2))
        self.constexprs = dict(D=d, BLOCK_H=block_h, TOKENS=TOKENS, FORM=_FORM[form], PRODUCTS=ROUND_TO[cos.dtype],
                               OUT=ROUND_TO[x.dtype], HEAD_TABLES=head_tables, EMULATE=interpreting())
        # what the launch specializes on besides the ints: dtypes and alignment (the output is a fresh allocation)
        self.plan_key = (self.ints, x.dtype, cos.dtype, x.data_ptr() % 16 == 0,
                         cos.data_ptr() % 16 == 0, sin.data_ptr() % 16 == 0)
        if out_of is not None:
            out, x = out_of(out), out_of(x)
        # torch.empty_like of the caller's x strides the output so where that x is dense with these strides
        self.like = out.stride() == x.stride()
        self.size, self.stride, self.dtype, self.device = out.shape, out.stride(), out.dtype, out.device

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The rotated ``x``: ``x``, ``cos``, ``sin`` of the plan's layout (or the tensors its views were made of)."""
        out = torch.empty_like(x) if self.like else torch.empty_strided(self.size, self.stride, dtype=self.dtype,
                                                                           device=self.device)
        if self.grid is not None:
            _LAUNCH(self.grid, (x, cos, sin, out) + self.ints, self.constexprs, plan_key=self.plan_key, num_warps=4,
                    enable_fp_fusion=False)
        return out
