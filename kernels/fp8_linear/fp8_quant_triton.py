"""Per-token FP8 quantization of a linear layer's activations in one Triton launch.

Each program takes a few tokens (rows of ``x (M, K)``) and computes for each, in float32 after the load::

    s = absmax(row) / 448   (IEEE division; 1 for an all-zero row)       q = e4m3(row / s)

and writes ``q float8_e4m3fn (M, K)`` and ``s float32 (M, 1)``: the operands ``torch._scaled_mm`` takes
with row-wise scales. Bit for bit :func:`~quantpatch.kernels.fp8_linear.fp8_linear_ref.quantize_rows_fp8_ref`:
the quotient ``row / s`` is the IEEE one (``_div_by``: one reciprocal per row and Markstein's FMA
correction), the cast is the shared saturating round-to-nearest-even e4m3 cast of
:mod:`~quantpatch.kernels.rounding_triton` (``cvt.rn.satfinite`` on the GPU, an exact emulation under
``TRITON_INTERPRET=1``). A row of up to ``ROW_BLOCK`` channels is read once; a longer one twice
(absmax pass, then quantize pass from L2), in chunks of ``ROW_BLOCK``, or of half of it where that pads the row less
and an activation is computed on every lane (Wan's 8,960 channels: 5 × 2,048, not 3 × 4,096). Rows shorter than
``TILE_ELEMENTS`` share a program, so that every load keeps as many bytes in flight as a long row's.

With ``activation`` (``"gelu"``, ``"gelu_tanh"``: :data:`~quantpatch.kernels.fp8_linear.fp8_linear_ref.ACTIVATIONS`)
each loaded value first becomes its GELU, computed in float32 and rounded to ``x``'s dtype as ``F.gelu`` does, then
quantized: the feed-forward's GELU and the next layer's quantization in one read of the pre-activation, where the
two kernels read it, wrote the GELU and read that again. A long row's absmax pass takes only the largest input past
its first load, whose GELU is the largest past it (the GELU increases from x = -0.75 on, and no GELU of a smaller
input reaches ``GELU_NEGATIVE_BOUND`` in magnitude), so each GELU is computed once; a row whose GELUs all stay below
that bound computes them again for its absmax. This equals the absmax of every GELU as long as the computed GELU
does not decrease between two inputs, which holds on the bf16 and fp16 grids (neighbouring inputs are further apart
than the GELU's float32 error); on float32 inputs two neighbours may decrease by an ulp, and the scale then is that
ulp smaller, the larger value saturating at 448. The quantization is then bit for bit that of the GELU
the kernel computed; that GELU is ``F.gelu``'s to the last bit of ``x``'s dtype except where the float32 values
straddle a rounding boundary (the tanh form is computed as ``x·σ(2u)``, which equals
``x(1 + tanh u)/2``; ``erf`` is the device library's): a bf16 element then differs by one ulp
(``tests/kernels/test_fp8_quant_triton.py`` bounds how often).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..compiled_launch import LaunchPlans, cdiv, current_stream, interpreting, next_pow2
from ..rounding_triton import ROUND_TO, _div_by, _round_to, _to_fp8e4m3

E4M3_MAX = tl.constexpr(448.0)  # a constexpr: @triton.jit code reads only constexpr globals
# channels per load. H100, 32,760 x 8,960 bf16 (memory speed: 263 us), one row a program, 4 warps: 312 us in loads of
# 4,096, 297 in 2,048 (two rows a program: 304; 1,024: 378-460); with the tanh GELU 502-526 / 406 / 419-546;
# 8,192 x 14,336: 127 / 149 us. A row's running maximum is reduced across the program once, not once a load.
ROW_BLOCK = 4096
# A load of a program covers TILE_ELEMENTS (several tokens of a short row), a warp per ELEMENTS_PER_WARP of it. H200,
# the kernel alone against the one-token programs before (a warp per 256 channels): 32,760 x 1536 (Wan2.1-1.3B)
# 61 -> 45 us (3.4 TB/s); 4096 x 1536 13 -> 10 us; Llama-3-8B's 8192 x 4096 / 14336 32 -> 30 / 103 -> 102 us.
TILE_ELEMENTS = 4096
ELEMENTS_PER_WARP = 1024
ACTIVATION_CODES = {None: 0, "gelu": 1, "gelu_tanh": 2}  # the kernel's ACTIVATION constexpr
SQRT_HALF = tl.constexpr(0.7071067811865476)
NEG_TWO_SQRT_TWO_OVER_PI = tl.constexpr(-1.5957691216057308)  # -2·√(2/π): x·σ(2u) = x / (1 + exp(-2u))
GELU_CUBIC = tl.constexpr(0.044715)
# above max |GELU(x)| over x < 0 (0.16997 erf form, 0.17004 tanh form, at x ≈ -0.752) and its rounding to bf16 / fp16
GELU_NEGATIVE_BOUND = tl.constexpr(0.1875)


@triton.jit
def _activate(x, ACTIVATION: tl.constexpr, ROUND: tl.constexpr, EMULATE: tl.constexpr):
    """``x`` (float32) for ``ACTIVATION`` 0; else its GELU (1: erf form, 2: tanh form) rounded onto the grid of the
    input dtype (``_round_to``'s ``ROUND``) and back to float32."""
    if ACTIVATION == 1:
        x = _round_to(x * 0.5 * (1.0 + tl.erf(x * SQRT_HALF)), ROUND, EMULATE)
    elif ACTIVATION == 2:
        e = tl.exp((x + GELU_CUBIC * x * x * x) * NEG_TWO_SQRT_TWO_OVER_PI)
        x = _round_to(tl.fdiv(x, 1.0 + e, ieee_rounding=False), ROUND, EMULATE)  # div.full: 2 ulp, no slow path
    return x


@triton.jit
def _fp8_quantize_rows_kernel(
    X_ptr, Q_ptr, S_ptr,
    M, K, stride_xm, stride_qm,
    ROWS: tl.constexpr, BLOCK_K: tl.constexpr, EMULATE: tl.constexpr, ACTIVATION: tl.constexpr,
    ROUND: tl.constexpr,
):
    """Tokens ``ROWS · program_id`` to ``ROWS · (program_id + 1) - 1``: ``s = absmax / 448`` (1 if 0),
    ``q = e4m3(x / s)``, a row's channels in loads of ``BLOCK_K``; ``x`` first through :func:`_activate`."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # offsets of large activations exceed int32
    live = rows[:, None] < M
    x_rows = X_ptr + rows[:, None] * stride_xm
    q_rows = Q_ptr + rows[:, None] * stride_qm
    offs = tl.arange(0, BLOCK_K)[None, :]
    x = _activate(tl.load(x_rows + offs, mask=live & (offs < K), other=0.0).to(tl.float32), ACTIVATION, ROUND, EMULATE)
    # elementwise running maxima, reduced across the program's threads once: |value| (with an activation, of the
    # first load only) and, with an activation, the inputs past the first load
    big = tl.abs(x)
    top = tl.full((ROWS, BLOCK_K), -float("inf"), tl.float32)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        mask = live & (k0 + offs < K)
        chunk = tl.load(x_rows + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        if ACTIVATION == 0:
            big = tl.maximum(big, tl.abs(chunk))
        else:
            top = tl.maximum(top, tl.where(mask, chunk, -float("inf")))
    amax = tl.max(big, 1)
    if ACTIVATION != 0:
        if K > BLOCK_K:
            # The GELU increases from x = -0.75 on and stays above -0.1701 below it, so the largest |GELU| past the
            # first load is GELU(top) wherever that (or the first load's) reaches GELU_NEGATIVE_BOUND; rows where
            # neither does compute every GELU of the row once more.
            amax = tl.maximum(amax, _activate(tl.max(top, 1), ACTIVATION, ROUND, EMULATE))
            small = amax < GELU_NEGATIVE_BOUND
            if tl.max(small.to(tl.int32), 0) > 0:
                rest = tl.zeros((ROWS,), tl.float32)
                for k0 in range(BLOCK_K, K, BLOCK_K):
                    chunk = _activate(tl.load(x_rows + k0 + offs, mask=live & (k0 + offs < K), other=0.0)
                                      .to(tl.float32), ACTIVATION, ROUND, EMULATE)
                    rest = tl.maximum(rest, tl.max(tl.abs(chunk), 1))
                amax = tl.where(small, tl.maximum(amax, rest), amax)
    scale = tl.math.div_rn(amax, E4M3_MAX)
    scale = tl.where(scale == 0.0, 1.0, scale)[:, None]  # symmetric_scale: an all-zero token gets 1
    tl.store(q_rows + offs, _to_fp8e4m3(_div_by(x, scale), EMULATE), mask=live & (offs < K))
    for k0 in range(BLOCK_K, K, BLOCK_K):
        mask = live & (k0 + offs < K)
        chunk = _activate(tl.load(x_rows + k0 + offs, mask=mask, other=0.0).to(tl.float32), ACTIVATION, ROUND, EMULATE)
        tl.store(q_rows + k0 + offs, _to_fp8e4m3(_div_by(chunk, scale), EMULATE), mask=mask)
    tl.store(S_ptr + rows[:, None], scale, mask=live)


_LAUNCH = LaunchPlans(_fp8_quantize_rows_kernel)
# (K, activation, dtype) → (constexprs, num_warps): decided once per row length, activation and input dtype
_TILES: dict[tuple[int, str | None, torch.dtype], tuple[dict, int]] = {}


def _tile(k: int, activation: str | None, dtype: torch.dtype) -> tuple[dict, int]:
    """The constexprs and warps of a ``K``-channel row: a row up to ``ROW_BLOCK`` long is one load of ``BLOCK_K``
    channels, ``ROWS`` tokens a program so that a load covers ``TILE_ELEMENTS``, a warp per ``ELEMENTS_PER_WARP`` of it
    (1 to 8); a longer row takes a program of 4 warps and several loads (module docstring)."""
    tile = _TILES.get((k, activation, dtype))
    if tile is None:
        if activation not in ACTIVATION_CODES:
            raise ValueError(f"activation {activation!r} is not one of {list(ACTIVATION_CODES)}")
        if k <= ROW_BLOCK:
            block_k = next_pow2(max(k, 16))
            rows = max(1, TILE_ELEMENTS // block_k)
            warps = max(1, min(8, rows * block_k // ELEMENTS_PER_WARP))
        else:  # every padded lane computes the activation: then the load that pads least
            block_k = ROW_BLOCK if activation is None else min((ROW_BLOCK, ROW_BLOCK // 2),
                                                               key=lambda b: cdiv(k, b) * b)
            rows, warps = 1, 4
        tile = _TILES[k, activation, dtype] = (dict(ROWS=rows, BLOCK_K=block_k, EMULATE=interpreting(),
                                                    ACTIVATION=ACTIVATION_CODES[activation], ROUND=ROUND_TO[dtype]),
                                               warps)
    return tile


def quantize_rows_fp8(x: torch.Tensor, activation: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token e4m3 quantization of ``x (M, K)`` (fp16 / bf16 / fp32, last dim contiguous), on the current stream;
    with ``activation`` (``"gelu"`` or ``"gelu_tanh"``), of its GELU (module docstring).

    Returns:
        ``q float8_e4m3fn (M, K)`` and ``s float32 (M, 1)`` with ``x ≈ q · s``: the numerics of
        :func:`~quantpatch.kernels.fp8_linear.fp8_linear_ref.quantize_rows_fp8_ref` bit for bit (of
        ``activate_ref(x, activation)`` where the GELUs agree).
    """
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be 2-D (M, K) with a contiguous last dim, got shape {tuple(x.shape)} "
                         f"and strides {x.stride()}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"x has dtype {x.dtype}; the kernel takes float16, bfloat16 or float32")
    m, k = x.shape
    if m and k:
        return RowQuantizer(x, activation).launch(x)
    q = torch.empty((m, k), device=x.device, dtype=torch.float8_e4m3fn)
    return q, torch.ones((m, 1), device=x.device, dtype=torch.float32)  # no channels: absmax 0, scale 1


class RowQuantizer:
    """:func:`quantize_rows_fp8` of every input of one signature (the shape, row stride, dtype and 16-byte alignment
    of ``x (M, K)``, ``M, K > 0``, last dim contiguous; what the launch specializes on) with one ``activation``:
    the tile and the launch arguments made once, and from the second call on the compiled kernel launched by its
    bound plan (``LaunchPlans.bound``), no plan key made. Unchecked: a caller passes inputs of that signature."""

    __slots__ = ("shape", "ints", "grid", "constexprs", "options", "plan_key", "bound")

    def __init__(self, x: torch.Tensor, activation: str | None) -> None:
        m, k = x.shape
        self.constexprs, warps = _tile(k, activation, x.dtype)
        self.shape, self.ints = (m, k), (m, k, x.stride(0), k)  # q is contiguous (M, K)
        self.grid, self.options = (cdiv(m, self.constexprs["ROWS"]),), dict(num_warps=warps)
        self.plan_key = (x.shape, x.stride(0), x.dtype, x.data_ptr() % 16 == 0)
        self.bound = None

    def _outputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        device = x.device
        return (torch.empty(self.shape, device=device, dtype=torch.float8_e4m3fn),
                torch.empty((self.shape[0], 1), device=device, dtype=torch.float32))

    def launch(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q float8_e4m3fn (M, K)`` and ``s float32 (M, 1)`` of ``x``, launched on the current stream through the
        launch plans (the signature's first launch makes its plan)."""
        q, scale = self._outputs(x)
        _LAUNCH(self.grid, (x, q, scale) + self.ints, self.constexprs, plan_key=self.plan_key, **self.options)
        return q, scale

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`launch`, by the bound plan from the second call on (on CUDA)."""
        if self.bound is None:
            q, scale = self.launch(x)
            if x.is_cuda:
                self.bound = _LAUNCH.bound(self.grid, self.constexprs, plan_key=self.plan_key, device=x.device.index,
                                           **self.options)
            return q, scale
        q, scale = self._outputs(x)
        self.bound(current_stream(x.device.index), (x, q, scale) + self.ints)
        return q, scale


@torch.library.custom_op("quantpatch::fp8_quantize_rows", mutates_args=())
def fp8_quantize_rows_op(x: torch.Tensor, activation: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_rows_fp8` as one op: what ``torch.compile`` sees."""
    return quantize_rows_fp8(x, activation)


@fp8_quantize_rows_op.register_fake
def _(x, activation=None):
    return x.new_empty(x.shape, dtype=torch.float8_e4m3fn), x.new_empty((x.shape[0], 1), dtype=torch.float32)


def quantize_activations_fp8(x: torch.Tensor, activation: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_rows_fp8`: eager calls launch directly (the custom op's dispatch costs host time a
    decode-sized layer does not have), ``torch.compile`` traces go through :func:`fp8_quantize_rows_op`."""
    if torch.compiler.is_compiling():
        return fp8_quantize_rows_op(x, activation)
    return quantize_rows_fp8(x, activation)
