"""``W4A8Linear``: FireQ's INT4-weight × FP8-activation linear layer as a drop-in ``nn.Module``.

The packed weight lives in buffers (so ``state_dict`` / safetensors carry it and ``.to()``
moves it): ``qweight uint8 (O, Kp/2)``, ``scales float8_e4m3fn (O, G)``, ``pts_exp int32 ()``
and an optional ``bias (O,)``. Numerics and layout: :mod:`quantpatch.kernels.w4a8.w4a8_ref`.

``forward`` goes through :func:`w4a8_matmul`: the ``w4a8_linear`` op of :mod:`quantpatch.dispatch`, whose
implementations are the Triton kernels (:mod:`quantpatch.kernels.w4a8.w4a8_triton`, FP8 dots: sm_89+; the Gluon
ones on sm_90) for the ``"group"`` operand, ``torch._scaled_mm`` on the FP8 matrix of the ``"lut"`` operand
(:mod:`quantpatch.kernels.w4a8.w4a8_lut_triton`), imported on the first CUDA input (or by ``patch_model``) and
registered here, and the pure-PyTorch reference computing in float32 (FireQ's accumulator precision). On other
devices the reference is the path; shapes the kernels do not take fall back to it with one warning.
"""

from __future__ import annotations

import math
from types import ModuleType

import torch
from torch import nn

from quantpatch.dispatch import (
    REFERENCE,
    W4A8_KERNELS_MODULE,
    Implementation,
    LinearCall,
    PlannedLinear,
    Quiet,
    check_in_features,
    on_kernels_import,
    register,
    rows_view,
    run_op,
)
from quantpatch.fallback import note_implementation
from quantpatch.kernels.w4a8.w4a8_ref import (
    GROUP_SIZE,
    WEIGHT_OPERANDS,
    PackedWeight,
    dequantize_weight,
    quantize_weight,
    unpack_weight,
    w4a8_linear_ref,
    weight_nbytes,
)

OP, KEY = "w4a8_linear", "w4a8_fp8"  # the op of quantpatch.dispatch and its key (LinearConfig.kind)
ROUTE_LUT = "scaled_mm (lut)"  # the "lut" operand: its FP8 matrix through torch._scaled_mm


def _register_kernels(kernels: ModuleType) -> None:
    """The Triton kernels (:mod:`quantpatch.kernels.w4a8.w4a8_triton`) as the ``"triton"`` implementation."""

    def unsupported(call: LinearCall) -> str | None:
        """Quiet where the device cannot run the kernels (the reference is that device's path), a reason to warn
        about where a capable device gets a layer they do not take."""
        reason = kernels.device_unsupported(call.x)
        if reason is not None:
            return Quiet(reason)
        return kernels.layer_unsupported(call.x, call.layer)

    def run(call: LinearCall) -> torch.Tensor:
        x, layer = call.x, call.layer
        buffers = layer._buffers  # the buffer dict: nn.Module.__getattr__ costs host time a call
        y = kernels.w4a8_linear(x, buffers["qweight"], buffers["scales"], buffers["pts_exp"], buffers["bias"])
        # asked after the call: a Gluon kernel that failed to compile has switched this device to Triton
        gluon = kernels.uses_gluon(math.prod(x.shape[:-1]), layer.out_features, layer.in_features, x.device)
        note_implementation("gluon" if gluon else "triton")
        return y

    def plan(call: LinearCall):
        """:func:`run` for every input of ``call.x``'s signature (``dispatch.LinearPlans``): the kernel
        :func:`~quantpatch.kernels.w4a8.w4a8_triton.w4a8_linear_2d` picks for its shape called directly; None where
        ``x`` has no :func:`~quantpatch.dispatch.rows_view`."""
        x, layer = call.x, call.layer
        k, n = layer.in_features, layer.out_features
        rows = rows_view(x, k)
        if rows is None:
            return None
        m, out_shape = rows.shape[0], (*x.shape[:-1], n)
        linear_2d = kernels.linear_2d_of(m, n, k, x.device)  # asked after the call that compiled the kernel, as run()
        name = "triton" if linear_2d is kernels.w4a8_linear_2d else "gluon"

        def planned(layer: W4A8Linear, x: torch.Tensor) -> torch.Tensor:
            buffers = layer._buffers
            y = linear_2d(x.view(m, k), buffers["qweight"], buffers["scales"], buffers["pts_exp"], buffers["bias"])
            note_implementation(name)
            return y.view(out_shape)

        return planned

    register(OP, KEY, Implementation("triton", 10, unsupported, run, plan))
    register(OP, KEY, Implementation(ROUTE_LUT, 20, _lut_unsupported, _lut_run))


def _lut_unsupported(call: LinearCall) -> str | None:
    """Why ``torch._scaled_mm`` cannot run this call's ``"lut"`` product (quiet for the ``"group"`` operand, which
    the Triton and Gluon kernels take, and where the device cannot run FP8 GEMMs: the reference is its path)."""
    from quantpatch.fp8_linear import scaled_mm_inputs_unsupported

    x, layer = call.x, call.layer
    if layer.weight_operand != "lut":
        return Quiet(f"weight_operand={layer.weight_operand!r} (this path takes 'lut')")
    reason = scaled_mm_inputs_unsupported(x, layer._buffers["bias"])
    if reason is not None:
        return reason
    if layer.group_size != GROUP_SIZE or layer.in_features % GROUP_SIZE or layer.out_features % 16:
        return (f"{layer.what}: group_size {layer.group_size}, in_features a multiple of {GROUP_SIZE} and "
                "out_features of 16 are what torch._scaled_mm's operands take")
    if torch.compiler.is_compiling():
        return Quiet("traced by torch.compile: the path launches its kernels eagerly")
    return None if x.numel() else Quiet("an empty input")


def _lut_run(call: LinearCall) -> torch.Tensor:
    """``y = β · 2⁻ⁿ · x̂ · e4m3(ŵ σ)ᵀ + b``: FireQ's activation quantization, the look-up-table operand as an FP8
    matrix (``w4a8_lut_triton``), then :func:`~quantpatch.fp8_linear.scaled_mm_rowwise` with per-token ``β`` and
    per-channel ``2⁻ⁿ`` (:func:`_pts_scale_row`). Eager only: :func:`_lut_unsupported` declines ``torch.compile``
    traces."""
    from quantpatch.fp8_linear import scaled_mm_rowwise
    from quantpatch.kernels.w4a8.w4a8_lut_triton import lut_weight_fp8

    layer = call.layer
    buffers = layer._buffers
    weight = lut_weight_fp8(buffers["qweight"], buffers["scales"])
    return scaled_mm_rowwise(call.x, _quantize_tokens, weight, _pts_scale_row(layer), buffers["bias"])


def _quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FireQ's per-token activation quantization of ``x (M, K)`` (the Triton kernel): ``x̂ float8_e4m3fn (M, K)`` and
    ``β`` as ``float32 (M, 1)``, the scales ``torch._scaled_mm`` takes."""
    from quantpatch.kernels.w4a8.w4a8_act_quant_triton import quantize_activation_fp8

    x_hat, beta = quantize_activation_fp8(x)
    return x_hat, beta.float().view(-1, 1)


def _pts_scale_row(layer: W4A8Linear) -> torch.Tensor:
    """The layer's per-channel scales ``2⁻ⁿ`` as ``float32 (1, O)``, made once per ``pts_exp`` buffer and version.

    Kept in a plain attribute (not a buffer: ``state_dict`` does not carry it) with the buffer it was made from, its
    address and its version: a buffer replaced (``.to()``, ``load_state_dict(assign=True)``) or written in place
    (``load_packed``, ``load_state_dict``) makes it anew; holding the buffer keeps a new one from taking its address.
    """
    pts_exp = layer._buffers["pts_exp"]
    cached = layer._pts_scale_cache
    if cached is None or cached[0] is not pts_exp or cached[1] != (pts_exp.data_ptr(), pts_exp._version):
        row = torch.exp2(-pts_exp.float()).expand(1, layer.out_features).contiguous()
        cached = layer._pts_scale_cache = (pts_exp, (pts_exp.data_ptr(), pts_exp._version), row)
    return cached[2]


def _reference(call: LinearCall) -> torch.Tensor:
    """:func:`~quantpatch.kernels.w4a8.w4a8_ref.w4a8_linear_ref` of the layer's buffers."""
    x, module = call.x, call.layer
    packed = module.packed()
    unpacked = None
    if module.cache_unpacked:  # reference speed-up: unpack once per weight version
        key = (module.qweight.data_ptr(), module.qweight._version, module.scales.data_ptr(), module.scales._version,
               module.compute_dtype)
        if module._unpacked is None or module._unpacked[0] != key:
            module._unpacked = (key, unpack_weight(packed, module.compute_dtype))
        unpacked = module._unpacked[1]
    return w4a8_linear_ref(x, packed, module.bias, operand=module.weight_operand,
                           compute_dtype=module.compute_dtype, unpacked=unpacked)


register(OP, KEY, Implementation(REFERENCE, 0, lambda call: None, _reference))
on_kernels_import(W4A8_KERNELS_MODULE, _register_kernels)


def w4a8_matmul(x: torch.Tensor, module: W4A8Linear) -> torch.Tensor:
    """``module``'s product on ``x (..., K)`` → ``(..., O)``: the best implementation that takes it (from the second
    call of an input signature on, the one its first call chose, with no checks: ``dispatch.LinearPlans``)."""
    y = module.plans.run(module, x, None)
    if y is not None:
        return y
    check_in_features(x, module)
    return run_op(OP, KEY, LinearCall(x, module), what=module.what, plans=module.plans)


class W4A8Linear(PlannedLinear):
    """FireQ W4A8-FP linear layer: ``y = x Wᵀ + b`` with INT4/e4m3-group weights and per-token FP8 activations.

    Args:
        in_features, out_features: ``K`` and ``O``.
        bias: keep a bias buffer.
        group_size: input channels per e4m3 weight scale (128).
        weight_operand: ``"group"`` (per-group FP32 partials × σ) or ``"lut"`` (FireQ's e4m3(ŵ σ) table).
        device: where the (empty) buffers are made; ``"meta"`` for a skeleton that
            ``load_state_dict(..., assign=True)`` fills.
        dtype: dtype of the bias buffer.

    Shapes: ``x (..., K)`` → ``y (..., O)`` in ``x``'s dtype.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        group_size: int = GROUP_SIZE,
        weight_operand: str = "group",
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if weight_operand not in WEIGHT_OPERANDS:
            raise ValueError(f"weight_operand={weight_operand!r} is not valid; choose one of {list(WEIGHT_OPERANDS)}")
        if group_size <= 0 or group_size % 2:
            raise ValueError(f"group_size must be a positive even int, got {group_size}")
        self.in_features, self.out_features = in_features, out_features
        self.what = f"W4A8Linear({in_features}->{out_features})"  # how warnings and errors name the layer
        self.group_size, self.weight_operand = group_size, weight_operand
        self.compute_dtype = torch.float32  # FireQ accumulates in FP32
        # The reference path may keep the unpacked INT4 values (4 bytes each, not counted in
        # the memory accounting and not saved): set True for repeated CPU evaluation.
        self.cache_unpacked = False
        self._unpacked = None
        self._pts_scale_cache = None  # the "lut" path's 2⁻ⁿ row and what it was made from (_pts_scale_row)
        groups = -(-in_features // group_size)
        kp = groups * group_size
        self.register_buffer("qweight", torch.zeros(out_features, kp // 2, dtype=torch.uint8, device=device))
        self.register_buffer("scales", torch.zeros(out_features, groups, dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer("pts_exp", torch.zeros((), dtype=torch.int32, device=device))
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device))
        else:
            self.register_buffer("bias", None)

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        group_size: int = GROUP_SIZE,
        pts: bool = True,
        pts_exp: int | None = None,
        weight_operand: str = "group",
    ) -> W4A8Linear:
        """Quantize an ``nn.Linear`` (round to nearest; CAS is merged into its weight beforehand by ``convert``).

        ``pts``: choose the per-tensor ``2ⁿ`` by FireQ Definition 3.2 (``pts_exp`` forces ``n``).
        The new module's buffers are on the linear's device; the bias keeps its dtype.
        """
        w = linear.weight.detach()
        packed = quantize_weight(w, group_size, pts=pts, pts_exp=pts_exp)
        has_bias = linear.bias is not None
        bias_dtype = linear.bias.dtype if has_bias else w.dtype
        module = cls(linear.in_features, linear.out_features, has_bias, group_size=group_size,
                     weight_operand=weight_operand, device=w.device, dtype=bias_dtype)
        module.load_packed(packed)
        if has_bias:
            module.bias.copy_(linear.bias.detach())
        return module

    def load_packed(self, packed: PackedWeight) -> None:
        """Copy a :class:`~quantpatch.kernels.w4a8.w4a8_ref.PackedWeight` into the buffers (shapes must match)."""
        if packed.in_features != self.in_features or packed.group_size != self.group_size:
            raise ValueError(
                f"packed weight is K={packed.in_features}, group {packed.group_size}; "
                f"module is K={self.in_features}, group {self.group_size}"
            )
        self.qweight.copy_(packed.qweight)
        self.scales.copy_(packed.scales)
        self.pts_exp.fill_(packed.pts_exp)

    def packed(self) -> PackedWeight:
        """The buffers as a :class:`~quantpatch.kernels.w4a8.w4a8_ref.PackedWeight`."""
        return PackedWeight(self.qweight, self.scales, int(self.pts_exp), self.in_features, self.group_size)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The effective float weight ``(O, K)`` (PTS undone) that the product uses."""
        return dequantize_weight(self.packed(), self.weight_operand, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return w4a8_matmul(x, self)

    def _apply(self, fn, recurse=True):
        # ``model.to(torch.bfloat16)`` casts every floating buffer; the e4m3 scales must stay
        # e4m3 (their values are exact in any wider float, so casting back loses nothing).
        super()._apply(fn, recurse)
        if self.scales.dtype != torch.float8_e4m3fn:
            self.scales = self.scales.to(torch.float8_e4m3fn)
        return self

    # -- memory accounting -----------------------------------------------------
    def weight_nbytes(self) -> int:
        """Bytes of the packed weight and its scales (what replaces the float weight)."""
        return self.qweight.numel() * self.qweight.element_size() + self.scales.numel() * self.scales.element_size()

    def memory_footprint(self) -> dict[str, int]:
        """Bytes by buffer, ``total`` and ``bf16_weight`` (the ``O·K·2`` bytes a bf16 weight takes)."""
        parts = {name: b.numel() * b.element_size() for name, b in self.named_buffers(recurse=False)}
        assert self.weight_nbytes() == weight_nbytes(self.out_features, self.in_features, self.group_size)
        return {**parts, "total": sum(parts.values()), "bf16_weight": self.out_features * self.in_features * 2}

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"group_size={self.group_size}, pts_exp={int(self.pts_exp) if not self.pts_exp.is_meta else '?'}, "
            f"weight_operand={self.weight_operand!r}"
        )


def linear_weight_bytes(model: nn.Module) -> dict[str, int]:
    """Weight bytes of every ``nn.Linear`` / :class:`W4A8Linear` in ``model`` (bias excluded), by FQN."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, W4A8Linear):
            out[name] = m.weight_nbytes()
        elif isinstance(m, nn.Linear):
            out[name] = m.weight.numel() * m.weight.element_size()
    return out
