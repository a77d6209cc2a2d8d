"""``FP8Linear``: an ``nn.Linear`` with e4m3 weights per output channel and e4m3 activations per token.

``patch_model(model, mode, linear="fp8")`` makes one from each linear of the transformer blocks
(:mod:`quantpatch.patches.linears`), with no calibration. Numerics (exact, pure PyTorch):
:mod:`quantpatch.kernels.fp8_linear.fp8_linear_ref`::

    s_w = absmax(W[n, :]) / 448    W_fp8 = e4m3(W / s_w)      at patch time (per output channel)
    s_x = absmax(x[m, :]) / 448    x_fp8 = e4m3(x / s_x)      per call (per token)
    y = (x_fp8 · W_fp8ᵀ) ⊙ s_x ⊙ s_wᵀ (+ bias), float32 accumulation, output in x's dtype

``forward`` is the ``fp8_linear`` op of :mod:`quantpatch.dispatch`, with two implementations registered here
(the GPU one's device, dtype and bias are checked once per key, :func:`scaled_mm_unsupported`):

* ``"scaled_mm"``, the GPU path (CUDA sm_89+, torch ≥ 2.5 with ``torch._scaled_mm``, an output dtype that its row-wise
  scaling takes on this GPU): the Triton kernel of :mod:`quantpatch.kernels.fp8_linear.fp8_quant_triton` quantizes
  the activations in one launch (bit for bit the reference's ``x_fp8``, ``s_x``), then
  ``torch._scaled_mm(x_fp8, W_fp8ᵀ, scale_a=s_x (M, 1), scale_b=s_w (1, N), bias, out_dtype=x.dtype)``
  with ``use_fast_accum=False`` (FP8 MMA partials promoted to float32), or ``True`` for a layer made with
  ``LinearConfig(kind="fp8", fast_accum=True)`` (the tensor cores' own accumulation: faster, a small added error;
  :class:`~quantpatch.config.LinearConfig`).
* ``"reference"`` elsewhere: on the CPU that is the path (silent); a CUDA device the GPU path cannot
  serve warns once with the reason and records it in the handle's report.

``patch_model`` gives each layer the ``nn.Linear`` it replaced (``original``; the model's later ``.to()`` and casts
reach it, so ``remove()`` restores it where the model then is). Under the default ``policy="speed"`` the layer calls
it where FP8 cannot be faster (:func:`original_reason`): on the CPU, where the FP8 path is the reference, and below
``FP8_MIN_TOKENS`` tokens on a GPU (``FP8_MIN_TOKENS_WIDE`` for layers of at least ``FP8_WIDE_OUT`` outputs), where
the activation pass and the small FP8 GEMM cost more than the bf16 GEMM saves (decode, short prompts).
``policy="always"`` runs FP8 for every call.

The route taken is counted per call on the layer's report site (``handle.report()``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from quantpatch.dispatch import (
    REFERENCE,
    Implementation,
    LinearCall,
    PlannedLinear,
    Quiet,
    check_in_features,
    register,
    rows_view,
    run_op,
)
from quantpatch.fallback import ORIGINAL_LINEAR_ROUTE, SiteRecord
from quantpatch.kernels.device import cuda_unsupported
from quantpatch.kernels.fp8_linear.fp8_linear_ref import activate_ref, fp8_linear_ref, quantize_rows_fp8_ref

# torch._scaled_mm takes K and N multiples of 16 (cuBLASLt / CUTLASS FP8 alignment).
SCALED_MM_MULTIPLE = 16
ROUTE_GPU, ROUTE_REFERENCE = "scaled_mm", REFERENCE  # the implementations' names, as the report counts them
OP, KEY = "fp8_linear", "fp8"  # the op of quantpatch.dispatch and its key (LinearConfig.kind)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Below this many tokens (rows of x) a GPU call runs the original bf16 weights under policy="speed": FP8_MIN_TOKENS,
# or FP8_MIN_TOKENS_WIDE for layers of at least FP8_WIDE_OUT output features. The activation pass costs M·K, the GEMM
# saves in proportion to M·K·N: a wide layer pays it back at fewer tokens. On an H200 (eval/bench_linear.py, eager,
# planned calls), an FP8 call ran 1.27-1.55x bf16 F.linear at 1024 tokens on the three Llama-3-8B shapes and 1.18x
# at 1536 -> 8960, but 0.86-0.95x on 1536 -> 1536 and 8960 -> 1536 (1.00-1.20x from 2048 / 4096 tokens on the
# latter), and 0.81-1.27x at 256 tokens. In a model every call's host time adds up (an FP8 call costs about 20 us
# above F.linear's): Llama-3-8B's 2048-token prefill ran 1.15x unpatched with its wide layers FP8, the call returning
# on the host about when its GPU work ended (eval/bench_models.py); fewer tokens were not measured in a model.
FP8_MIN_TOKENS = 4096
FP8_MIN_TOKENS_WIDE = 2048
FP8_WIDE_OUT = 4096
_REASONS: dict[tuple[torch.device, torch.dtype, bool], str | None] = {}
_QUANTIZER: list[Callable] = []  # the Triton activation quantizer once imported (Triton loads only for the GPU path)


def shape_unsupported(in_features: int, out_features: int) -> str | None:
    """Why ``torch._scaled_mm`` cannot take a ``K = in_features → N = out_features`` layer (None if it can)."""
    for name, size in (("in_features", in_features), ("out_features", out_features)):
        if size % SCALED_MM_MULTIPLE:
            return f"{name}={size} is not a multiple of {SCALED_MM_MULTIPLE} (torch._scaled_mm)"
    return None


def _scaled_mm_call_fails(device: torch.device, dtype: torch.dtype, bias: bool) -> str | None:
    """Whether a 16×16×16 row-wise ``torch._scaled_mm`` in ``dtype`` runs on ``device``: which output dtypes
    (and biases) its row-wise scaling takes depends on the GPU, cuBLAS and torch versions."""
    a = torch.zeros(16, 16, device=device).to(torch.float8_e4m3fn)
    ones = torch.ones(16, 1, device=device)
    try:
        torch._scaled_mm(a, a.t(), scale_a=ones, scale_b=ones.t().contiguous(), out_dtype=dtype,
                         bias=torch.zeros(16, device=device, dtype=dtype) if bias else None)
    except (RuntimeError, ValueError, TypeError) as err:
        return f"torch._scaled_mm row-wise with {dtype} output{' and a bias' if bias else ''}: " \
               f"{str(err).splitlines()[0]}"
    return None


def scaled_mm_unsupported(device: torch.device, dtype: torch.dtype, bias: bool) -> str | None:
    """Why the GPU path cannot run layers on ``device`` with ``dtype`` inputs (and a bias), or None.

    Decided once per key (the first CUDA call tries one small ``torch._scaled_mm``); :func:`patch_linears
    <quantpatch.patches.linears.patch_linears>` asks at patch time, so a later ``torch.compile`` trace only
    reads the cache.
    """
    key = (device, dtype, bias)
    if key not in _REASONS:
        if device.type != "cuda":
            reason = "inputs are not CUDA tensors"
        elif not hasattr(torch, "_scaled_mm"):
            reason = f"torch {torch.__version__} has no torch._scaled_mm (torch >= 2.5 has row-wise scales)"
        elif dtype not in OUT_DTYPES:
            reason = f"input dtype {dtype} (the GPU path takes {[str(d) for d in OUT_DTYPES]})"
        else:
            reason = cuda_unsupported(torch.empty(0, device=device), (8, 9), "FP8 GEMMs")
            if reason is None:
                reason = _scaled_mm_call_fails(device, dtype, bias)
            if reason is None:
                try:
                    _activation_quantizer()  # Triton imported now, not inside a later torch.compile trace
                except ImportError as err:
                    reason = f"the Triton activation quantizer is unavailable ({err})"
        _REASONS[key] = reason
    return _REASONS[key]


def _activation_quantizer() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """:func:`~quantpatch.kernels.fp8_linear.fp8_quant_triton.quantize_activations_fp8`, its module imported on first
    use."""
    if not _QUANTIZER:
        from quantpatch.kernels.fp8_linear.fp8_quant_triton import quantize_activations_fp8

        _QUANTIZER.append(quantize_activations_fp8)
    return _QUANTIZER[0]


def scaled_mm_rowwise(x: torch.Tensor, quantize: Callable[..., tuple[torch.Tensor, torch.Tensor]],
                      weight_fp8: torch.Tensor, weight_scale_row: torch.Tensor,
                      bias: torch.Tensor | None, fast_accum: bool = False,
                      activation: str | None = None) -> torch.Tensor:
    """``y = (x̂ · W_fp8ᵀ) ⊙ s_x ⊙ s_w + b`` with row-wise scales in one ``torch._scaled_mm``, FP8 MMA partials
    promoted to float32 (``use_fast_accum=False``; ``fast_accum=True``: accumulated in the tensor cores' own
    precision): the FP8 GEMM of the GPU paths of this module and of ``"lut"``
    :class:`~quantpatch.w4a8_linear.W4A8Linear` layers.

    Args:
        x: ``(..., K)``, taken as ``(M, K)`` rows (copied only where its last dim is strided).
        quantize: ``(M, K)`` rows → ``x̂ float8_e4m3fn (M, K)`` and ``s_x float32 (M, 1)`` with ``x ≈ s_x x̂``.
        weight_fp8: ``float8_e4m3fn (N, K)``.
        weight_scale_row: ``float32 (1, N)``, the per-output-channel scales ``s_w``.
        bias: ``(N,)`` in ``x``'s dtype, or None.
        activation: passed on as ``quantize(rows, activation)`` where not None (the quantizer applies it first).

    Returns:
        ``y (..., N)`` in ``x``'s dtype.
    """
    n, k = weight_fp8.shape
    x2 = x.reshape(-1, k)
    rows = x2 if x2.stride(-1) == 1 else x2.contiguous()
    x_fp8, x_scale = quantize(rows) if activation is None else quantize(rows, activation)
    y = torch._scaled_mm(x_fp8, weight_fp8.t(), scale_a=x_scale, scale_b=weight_scale_row, bias=bias,
                         out_dtype=x.dtype, use_fast_accum=fast_accum)
    return y.view(*x.shape[:-1], n)


def scaled_mm_inputs_unsupported(x: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """Why :func:`scaled_mm_rowwise` cannot take ``x`` with ``bias`` (:func:`scaled_mm_unsupported`, or a bias of
    another dtype: ``torch._scaled_mm`` adds it in the output dtype): a reason to warn about on a CUDA device,
    :class:`Quiet` off CUDA (the reference is that device's path); None if it can."""
    reason = scaled_mm_unsupported(x.device, x.dtype, bias is not None)
    if reason is None and bias is not None and bias.dtype != x.dtype:
        reason = f"bias dtype {bias.dtype} differs from the input dtype {x.dtype}"
    if reason is not None:
        return reason if x.is_cuda else Quiet(reason)
    return None


def _gpu_unsupported(call: LinearCall) -> str | None:
    """Why the GPU path cannot take ``call`` (:func:`scaled_mm_inputs_unsupported`; :class:`Quiet` for an empty
    input)."""
    x = call.x  # the buffer dict below: nn.Module.__getattr__ costs host time a call
    reason = scaled_mm_inputs_unsupported(x, call.layer._buffers["bias"])
    if reason is not None:
        return reason
    return None if x.numel() else Quiet("an empty input")


def _gpu_run(call: LinearCall) -> torch.Tensor:
    """The ``"scaled_mm"`` path: the Triton activation quantizer, then :func:`scaled_mm_rowwise`."""
    layer = call.layer
    buffers = layer._buffers
    return scaled_mm_rowwise(call.x, _activation_quantizer(), buffers["weight_fp8"],
                             buffers["weight_scale"].view(1, -1), buffers["bias"], layer.fast_accum, layer.activation)


def _gpu_plan(call: LinearCall) -> Callable[[FP8Linear, torch.Tensor], torch.Tensor] | None:
    """:func:`_gpu_run` for every input of ``call.x``'s signature (a planned call, ``dispatch.LinearPlans``): the
    quantization launch bound once (``RowQuantizer``), then ``torch._scaled_mm`` on the layer's buffers (the
    transposed weight and the scale row made again only where a buffer was replaced); None where ``x`` has no
    :func:`~quantpatch.dispatch.rows_view` (an empty input never gets here: :func:`_gpu_unsupported` declines it)."""
    from quantpatch.kernels.fp8_linear.fp8_quant_triton import RowQuantizer

    x, layer = call.x, call.layer
    k, n = layer.in_features, layer.out_features
    rows = rows_view(x, k)
    if rows is None:
        return None
    quantize = RowQuantizer(rows, layer.activation)
    out_shape, out_dtype, fast_accum = (*x.shape[:-1], n), x.dtype, layer.fast_accum
    operands: list = [None, None, None, None]  # weight_fp8, its transpose, weight_scale, its (1, N) row

    def planned(layer: FP8Linear, x: torch.Tensor) -> torch.Tensor:
        buffers = layer._buffers
        weight, scale = buffers["weight_fp8"], buffers["weight_scale"]
        if weight is not operands[0] or scale is not operands[2]:
            operands[:] = weight, weight.t(), scale, scale.view(1, -1)
        x_fp8, x_scale = quantize(x.view(-1, k))
        y = torch._scaled_mm(x_fp8, operands[1], scale_a=x_scale, scale_b=operands[3], bias=buffers["bias"],
                             out_dtype=out_dtype, use_fast_accum=fast_accum)
        return y.view(out_shape)

    return planned


def _reference(call: LinearCall) -> torch.Tensor:
    layer = call.layer
    return fp8_linear_ref(call.x, layer.weight_fp8, layer.weight_scale, layer.bias, layer.activation)


register(OP, KEY, Implementation(ROUTE_GPU, 10, _gpu_unsupported, _gpu_run, _gpu_plan))
register(OP, KEY, Implementation(ROUTE_REFERENCE, 0, lambda call: None, _reference))


def original_reason(tokens: int, out_features: int, is_cuda: bool) -> str | None:
    """Why a call of ``tokens`` rows of a layer with ``out_features`` outputs runs the original ``nn.Linear`` under
    ``policy="speed"``; None: FP8 runs."""
    if not is_cuda:
        return "the FP8 path off CUDA is the PyTorch reference"
    least = FP8_MIN_TOKENS_WIDE if out_features >= FP8_WIDE_OUT else FP8_MIN_TOKENS
    if tokens < least:
        return f"fewer than {least} tokens"
    return None


def _original_route(layer: FP8Linear, x: torch.Tensor) -> torch.Tensor:
    """The layer's original ``nn.Linear`` on ``x`` (after the layer's activation): its route by policy."""
    return layer.original[0](activate_ref(x, layer.activation))


class FP8Linear(PlannedLinear):
    """``y = x Wᵀ + b`` with e4m3 weights per output channel and e4m3 activations per token (inference only).

    Buffers (``state_dict`` carries them, ``.to()`` moves them; a dtype cast leaves the FP8 weight and
    its float32 scales alone and casts only the bias): ``weight_fp8 float8_e4m3fn (N, K)``,
    ``weight_scale float32 (N,)`` and ``bias (N,)`` or None. No parameters, so no gradients reach them.

    Shapes: ``x (..., K)`` → ``y (..., N)`` in ``x``'s dtype, ``K = in_features``, ``N = out_features``.

    ``fast_accum``: the GPU path's GEMM accumulates in the tensor cores' own precision
    (:class:`~quantpatch.config.LinearConfig`; the reference always accumulates in float32).

    ``activation`` (None, ``"gelu"`` or ``"gelu_tanh"``): the layer's input is the pre-activation of a GELU the layer
    applies first, in the activation quantization kernel on the GPU path (``fp8_linear_ref``; set by
    :func:`~quantpatch.patches.linears.patch_linears` for Diffusers' feed-forwards).

    Memory: ``N·K`` bytes of FP8 weight plus ``4·N`` of scales, half a bf16 weight. ``patch_model``
    keeps each original ``nn.Linear`` in its handle so that ``remove()`` restores it bitwise: while
    patched, the original weights stay in memory too (``2·N·K`` bytes in bf16; for Llama-3-8B's 32
    blocks 14.0 GB of bf16 beside 7.0 GB of FP8).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 device: torch.device | str | None = None, bias_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.what = f"FP8Linear({in_features}->{out_features})"  # how warnings and errors name the layer
        self.site: SiteRecord | None = None  # the report entry whose routes each call counts
        # the replaced layer (a tuple: not a submodule): the model's later .to() / casts reach it (_apply), so the
        # handle restores it where the model then is; under policy "speed" (speed_policy) short calls run it
        self.original: tuple[nn.Linear, ...] = ()
        self.speed_policy = False
        self.fast_accum = False
        self.activation: str | None = None
        self.register_buffer("weight_fp8", torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn,
                                                       device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=bias_dtype, device=device) if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> FP8Linear:
        """Quantize ``linear``'s weight per output channel (round to nearest even; an all-zero row gets scale 1).

        The new module's buffers are on the linear's device; the bias is copied in its own dtype.
        """
        has_bias = linear.bias is not None
        module = cls(linear.in_features, linear.out_features, has_bias, device=linear.weight.device,
                     bias_dtype=linear.bias.dtype if has_bias else torch.float32)
        with torch.no_grad():
            weight_fp8, weight_scale = quantize_rows_fp8_ref(linear.weight.detach())
            module.weight_fp8.copy_(weight_fp8)
            module.weight_scale.copy_(weight_scale.squeeze(1))
            if has_bias:
                module.bias.copy_(linear.bias.detach())
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x (..., K)`` → ``(..., N)``: FP8, or the original layer where :func:`original_reason` gives a reason.
        From the second call of an input signature on, the route and checks of its first call are reused
        (``dispatch.LinearPlans``)."""
        y = self.plans.run(self, x, self.site)
        if y is not None:
            return y
        check_in_features(x, self)
        if self.speed_policy and self.original[0].weight.device == x.device:
            why = original_reason(x.numel() // self.in_features, self.out_features, x.is_cuda)
            if why is not None:
                route = ORIGINAL_LINEAR_ROUTE + why
                if self.site is not None:
                    self.site.count(route)
                if self.plans.may_serve(x):
                    self.plans.keep(x, route, _original_route)
                return _original_route(self, x)
        return run_op(OP, KEY, LinearCall(x, self), what=self.what, record=self.site, plans=self.plans)

    def _apply(self, fn, recurse=True):
        # ``model.to(torch.bfloat16)`` casts every floating buffer, FP8 ones included; the e4m3 weight and
        # its float32 scales keep their dtype (only moved), so the layer's numerics do not change.
        kept = {name: getattr(self, name) for name in ("weight_fp8", "weight_scale")}
        super()._apply(fn, recurse)
        for name, old in kept.items():
            new = getattr(self, name)
            if new.dtype != old.dtype:
                setattr(self, name, old.to(new.device))
        for layer in self.original:
            layer._apply(fn, recurse)
        return self

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
                + (", fast_accum=True" if self.fast_accum else "")
                + (f", activation={self.activation!r}" if self.activation else ""))
