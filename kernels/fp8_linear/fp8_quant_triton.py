"""Per-token FP8 quantization of a linear layer's activations in one Triton launch.

Each program takes a few tokens (rows of ``x (M, K)``) and computes for each, in float32 after the load::

    s = absmax(row) / 448   (IEEE division; 1 for an all-zero row)       q = e4m3(row / s)

and writes ``q float8_e4m3fn (M, K)`` and ``s float32 (M, 1)``: the operands ``torch._scaled_mm`` takes
with row-wise scales. Bit for bit :func:`~quantpatch.kernels.fp8_linear.fp8_linear_ref.quantize_rows_fp8_ref`:
the quotient ``row / s`` is the IEEE one (``_div_by``: one reciprocal per row and Markstein's FMA
correction), the cast is the shared saturating round-to-nearest-even e4m3 cast of
:mod:`~quantpatch.kernels.rounding_triton` (``cvt.rn.satfinite`` on the GPU, an exact emulation under
``TRITON_INTERPRET=1``). A row of up to ``ROW_BLOCK`` channels is read once; a longer one twice
(absmax pass, then quantize pass from L2), in chunks of ``ROW_BLOCK``. Rows shorter than ``TILE_ELEMENTS`` share a
program, so that every load keeps as many bytes in flight as a long row's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..compiled_launch import LaunchPlans, cdiv, interpreting, next_pow2
from ..rounding_triton import _div_by, _to_fp8e4m3

E4M3_MAX = tl.constexpr(448.0)  # a constexpr: @triton.jit code reads only constexpr globals
ROW_BLOCK = 4096  # channels per load; not tuned on a GPU yet (W4A8's activation kernel reads 16384 at once)
# A load of a program covers TILE_ELEMENTS (several tokens of a short row), a warp per ELEMENTS_PER_WARP of it. H200,
# the kernel alone against the one-token programs before (a warp per 256 channels): 32,760 x 1536 (Wan2.1-1.3B)
# 61 -> 45 us (3.4 TB/s); 4096 x 1536 13 -> 10 us; Llama-3-8B's 8192 x 4096 / 14336 32 -> 30 / 103 -> 102 us.
TILE_ELEMENTS = 4096
ELEMENTS_PER_WARP = 1024


@triton.jit
def _fp8_quantize_rows_kernel(
    X_ptr, Q_ptr, S_ptr,
    M, K, stride_xm, stride_qm,
    ROWS: tl.constexpr, BLOCK_K: tl.constexpr, EMULATE: tl.constexpr,
):
    """Tokens ``ROWS · program_id`` to ``ROWS · (program_id + 1) - 1``: ``s = absmax / 448`` (1 if 0),
    ``q = e4m3(x / s)``, a row's channels in loads of ``BLOCK_K``."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # offsets of large activations exceed int32
    live = rows[:, None] < M
    x_rows = X_ptr + rows[:, None] * stride_xm
    q_rows = Q_ptr + rows[:, None] * stride_qm
    offs = tl.arange(0, BLOCK_K)[None, :]
    x = tl.load(x_rows + offs, mask=live & (offs < K), other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), 1)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        chunk = tl.load(x_rows + k0 + offs, mask=live & (k0 + offs < K), other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(chunk), 1))
    scale = tl.math.div_rn(amax, E4M3_MAX)
    scale = tl.where(scale == 0.0, 1.0, scale)[:, None]  # symmetric_scale: an all-zero token gets 1
    tl.store(q_rows + offs, _to_fp8e4m3(_div_by(x, scale), EMULATE), mask=live & (offs < K))
    for k0 in range(BLOCK_K, K, BLOCK_K):
        mask = live & (k0 + offs < K)
        chunk = tl.load(x_rows + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(q_rows + k0 + offs, _to_fp8e4m3(_div_by(chunk, scale), EMULATE), mask=mask)
    tl.store(S_ptr + rows[:, None], scale, mask=live)


_LAUNCH = LaunchPlans(_fp8_quantize_rows_kernel)
_TILES: dict[int, tuple[dict, int]] = {}  # K → (constexprs, num_warps): decided once per row length


def _tile(k: int) -> tuple[dict, int]:
    """The constexprs and warps of a ``K``-channel row: ``BLOCK_K`` channels a load (up to ``ROW_BLOCK``), ``ROWS``
    tokens a program so that a load covers ``TILE_ELEMENTS``, a warp per ``ELEMENTS_PER_WARP`` of it (1 to 8)."""
    tile = _TILES.get(k)
    if tile is None:
        block_k = min(ROW_BLOCK, next_pow2(max(k, 16)))
        rows = max(1, TILE_ELEMENTS // block_k)
        warps = max(1, min(8, rows * block_k // ELEMENTS_PER_WARP))
        tile = _TILES[k] = (dict(ROWS=rows, BLOCK_K=block_k, EMULATE=interpreting()), warps)
    return tile


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token e4m3 quantization of ``x (M, K)`` (fp16 / bf16 / fp32, last dim contiguous), on the current stream.

    Returns:
        ``q float8_e4m3fn (M, K)`` and ``s float32 (M, 1)`` with ``x ≈ q · s``: the numerics of
        :func:`~quantpatch.kernels.fp8_linear.fp8_linear_ref.quantize_rows_fp8_ref` bit for bit.
    """
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be 2-D (M, K) with a contiguous last dim, got shape {tuple(x.shape)} "
                         f"and strides {x.stride()}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"x has dtype {x.dtype}; the kernel takes float16, bfloat16 or float32")
    m, k = x.shape
    q = torch.empty((m, k), device=x.device, dtype=torch.float8_e4m3fn)
    scale = torch.empty((m, 1), device=x.device, dtype=torch.float32)
    if m and k:
        constexprs, warps = _tile(k)
        _LAUNCH((cdiv(m, constexprs["ROWS"]),), (x, q, scale, m, k, x.stride(0), q.stride(0)), constexprs,
                num_warps=warps)
    elif m:
        scale.fill_(1.0)  # no channels: absmax 0
    return q, scale


@torch.library.custom_op("quantpatch::fp8_quantize_rows", mutates_args=())
def fp8_quantize_rows_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_rows_fp8` as one op: what ``torch.compile`` sees."""
    return quantize_rows_fp8(x)


@fp8_quantize_rows_op.register_fake
def _(x):
    return x.new_empty(x.shape, dtype=torch.float8_e4m3fn), x.new_empty((x.shape[0], 1), dtype=torch.float32)


def quantize_activations_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_rows_fp8`: eager calls launch directly (the custom op's dispatch costs host time a
    decode-sized layer does not have), ``torch.compile`` traces go through :func:`fp8_quantize_rows_op`."""
    if torch.compiler.is_compiling():
        return fp8_quantize_rows_op(x)
    return quantize_rows_fp8(x)
