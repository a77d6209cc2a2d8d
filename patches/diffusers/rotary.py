"""Rotary embeddings of Diffusers' attention processors, computed in one kernel launch per tensor.

A processor rotates its query and key just before its attention call, in eight or more elementwise kernels over
float32 intermediates: at Wan2.1's 480p (32,760 tokens) about 3.6 GB of memory traffic a layer. Two forms are taken
over, each bit for bit (:mod:`quantpatch.kernels.rotary.rotary_ref`), by the Triton kernel of
:mod:`quantpatch.kernels.rotary.rotary_triton` on CUDA in eager mode:

* Wan's ``WanAttnProcessor`` defines its rotation inside its call. Where a processor's source applies exactly that
  rotation (:func:`rotary_parameter`), the wrapping processor passes ``rotary_emb=None`` to it and the attention
  call it then makes rotates the query and key itself (:func:`rotate`, the ``"wan"`` tables).
* CogVideoX, Flux and HunyuanVideo call Diffusers' ``embeddings.apply_rotary_emb``. While such a processor runs, that
  name (in ``diffusers.models.embeddings`` and in the processor's module, where it is the same function) is
  :func:`paired_rotary`'s replacement, which takes the ``use_real=True, use_real_unbind_dim=-1`` calls on CUDA
  (the ``"paired"`` tables) and hands every other call to the original.
* LTX-Video's processor calls its module's own ``apply_rotary_emb(x, freqs)``, the same arithmetic over all
  ``C = heads · head_dim`` channels of ``x (B, S, C)`` before the heads are split. Where that function's source is
  exactly this rotation, it is :func:`channel_rotary`'s replacement while the processor runs (the ``"paired"``
  tables, a row per group of 128 channels).

Processors whose source differs (another Diffusers version) run their own rotation unchanged.

A replacement's call pays little host work besides the launch (LTX-Video rotates twice in each of its 28 blocks):
what the kernel's checks and launch arguments depend on, the layout of the call's tensors, is decided on the first
call with that layout and kept (:class:`~quantpatch.kernels.rotary.rotary_triton.RotaryPlan`); later calls launch
on the caller's own tensors, without making the views the kernel reads.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from quantpatch.kernels.rotary.rotary_ref import rotary_embedding_ref
from quantpatch.patches import plain_cuda_eager, source_holds

_APPLY = "apply_rotary_emb"  # Diffusers' name of its rotation, in diffusers.models.embeddings

# What the processor's __call__ must say, whitespace aside: the rotation rotary_embedding_ref computes, applied to
# the query and the key with the call's rotary_emb = (freqs_cos, freqs_sin).
_ROTATION = (
    "x1,x2=hidden_states.unflatten(-1,(-1,2)).unbind(-1)",
    "cos=freqs_cos[...,0::2]",
    "sin=freqs_sin[...,1::2]",
    "out=torch.empty_like(hidden_states)",
    "out[...,0::2]=x1*cos-x2*sin",
    "out[...,1::2]=x1*sin+x2*cos",
    "returnout.type_as(hidden_states)",
    "query=apply_rotary_emb(query,*rotary_emb)",
    "key=apply_rotary_emb(key,*rotary_emb)",
)
_PARAMETER = "rotary_emb"
CHANNEL_GROUP = 128  # channels of LTX-Video's (B, S, C) rotation the kernel takes as one head
# LTX-Video's module-level rotation of x (B, S, C) by float32 (B, S, C) tables: the "paired" arithmetic over C
_CHANNEL_ROTATION = (
    "defapply_rotary_emb(x,freqs):cos,sin=freqs",
    "x_real,x_imag=x.unflatten(2,(-1,2)).unbind(-1)",
    "x_rotated=torch.stack([-x_imag,x_real],dim=-1).flatten(2)",
    "out=(x.float()*cos+x_rotated.float()*sin).to(x.dtype)returnout",
)


def rotary_parameter(processor: Any) -> int | None:
    """The position of ``rotary_emb`` among ``processor``'s call arguments after ``attn``, where its ``__call__``
    rotates the query and key as :func:`rotate` does (None otherwise: the processor keeps its own rotation)."""
    call = type(processor).__call__
    try:
        params = list(inspect.signature(call).parameters)
    except (TypeError, ValueError):
        return None
    if _PARAMETER not in params or not source_holds(call, _ROTATION):
        return None
    return params.index(_PARAMETER) - 2  # after self and attn


def take_rotary(attn: Any, index: int, args: tuple, kwargs: dict) -> tuple[tuple, dict, tuple | None]:
    """The call's arguments with ``rotary_emb`` set to None, and the ``(cos, sin)`` it held; the arguments unchanged
    and None where there is none to take (cross-attention) or the module adds image keys (Wan's I2V branch
    attends with the rotated query)."""
    if _PARAMETER in kwargs:
        rotary = kwargs[_PARAMETER]
    elif len(args) > index:
        rotary = args[index]
    else:
        return args, kwargs, None
    if rotary is None or getattr(attn, "add_k_proj", None) is not None or not isinstance(rotary, (tuple, list)) \
            or len(rotary) != 2:
        return args, kwargs, None
    if _PARAMETER in kwargs:
        kwargs = {**kwargs, _PARAMETER: None}
    else:
        args = args[:index] + (None,) + args[index + 1:]
    return args, kwargs, tuple(rotary)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x (B, S, H, D)`` rotated as Wan's processor rotates it: one Triton launch on CUDA in eager mode where the
    kernel takes the shapes, the reference otherwise."""
    out = _fused(_wan_plan, None, x, cos, sin)
    return rotary_embedding_ref(x, cos, sin) if out is None else out


# (route, its argument, layout of the call's tensors) → the kernel's RotaryPlan, or None where it cannot take them
_PLANS: dict[tuple, Any] = {}


def _fused(route, argument, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """``x`` rotated by the kernel through :func:`_planned`'s plan; None where these are not plain CUDA tensors in
    eager mode (:func:`~quantpatch.patches.plain_cuda_eager`) or the kernel does not take their layout (the
    caller's own rotation runs)."""
    if not plain_cuda_eager(x, cos, sin):
        return None
    plan = _planned(route, argument, x, cos, sin)
    return None if plan is None else plan(x, cos, sin)


def _planned(route, argument, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Any:
    """The plan ``route(x, cos, sin, argument)`` makes for tensors of this layout (shapes, strides, dtypes, devices
    and 16-byte alignment: all the kernel's checks and launch depend on), made on the first call with it; plain
    CUDA tensors in eager mode only (:func:`~quantpatch.patches.plain_cuda_eager`)."""
    key = (route, argument, x.shape, x.stride(), x.dtype, x.get_device(), x.data_ptr() & 15, cos.shape, cos.stride(),
           cos.dtype, cos.get_device(), cos.data_ptr() & 15, sin.shape, sin.stride(), sin.dtype, sin.get_device(),
           sin.data_ptr() & 15)
    try:
        return _PLANS[key]
    except KeyError:
        plan = _PLANS[key] = route(x, cos, sin, argument)
        return plan


def _plan(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, form: str, out_of=None) -> Any:
    """The kernel's plan for ``x (B, S, H, D)``, ``cos``, ``sin`` in ``form`` (None where the kernel cannot take
    them); ``out_of`` turns the output into the caller's layout."""
    from quantpatch.kernels.rotary.rotary_triton import RotaryPlan, rotary_unsupported

    return RotaryPlan(x, cos, sin, form, out_of) if rotary_unsupported(x, cos, sin) is None else None


def _wan_plan(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, _) -> Any:
    return _plan(x, cos, sin, "wan")


def _paired_plan(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sequence_dim: int) -> Any:
    """Diffusers' ``x (B, S, H, D)`` (``sequence_dim=1``) or ``(B, H, S, D)`` (2) with float32 ``(S, D)`` tables."""
    if sequence_dim not in (1, 2) or x.dim() != 4 or cos.dim() != 2 or cos.dtype != torch.float32:
        return None
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    if sequence_dim == 1:
        return _plan(x, cos, sin, "paired")
    return _plan(x.transpose(1, 2), cos, sin, "paired", _swap_heads)


def _swap_heads(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2)


def _channel_plan(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, _) -> Any:
    """LTX-Video's ``x (B, S, C)`` with float32 ``(1 or B, S, C)`` tables, as ``(B, S, C / 128, 128)``."""
    if x.dim() != 3 or x.shape[-1] % CHANNEL_GROUP or cos.shape[1:] != x.shape[1:] or cos.dtype != torch.float32:
        return None
    groups = (x.shape[-1] // CHANNEL_GROUP, CHANNEL_GROUP)
    return _plan(x.unflatten(-1, groups), cos.unflatten(-1, groups), sin.unflatten(-1, groups), "paired", _flat)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.flatten(2)


def fused_rotation(processor: Any, module: Any) -> tuple[tuple, Any]:
    """``(modules, replacement)``: the modules whose ``apply_rotary_emb`` a processor's call may read, and the
    one-launch function to put under that name while it runs. Diffusers' own function (:func:`paired_rotary`) in
    Diffusers' embeddings module (a call may import it there) and in the processor's ``module`` where it holds the
    same function; the processor module's own function instead where that is LTX-Video's rotation
    (:func:`channel_rotary`); ``((), None)`` where the processor's source never calls that name or neither is found."""
    try:
        from diffusers.models import embeddings
    except ImportError:
        return (), None
    if not source_holds(type(processor).__call__, (f"{_APPLY}(",)):
        return (), None
    original, own = getattr(embeddings, _APPLY, None), getattr(module, _APPLY, None)
    if own is not None and own is not original and source_holds(own, _CHANNEL_ROTATION):
        return (module,), channel_rotary(own)
    modules = tuple(m for m in (embeddings, module) if original is not None and getattr(m, _APPLY, None) is original)
    return (modules, paired_rotary(original)) if modules else ((), None)


def paired_rotary(original):
    """A drop-in for Diffusers' ``apply_rotary_emb`` (``original``): its ``use_real=True, use_real_unbind_dim=-1``
    calls on CUDA tensors with float32 ``(S, D)`` tables in one launch (``"paired"`` tables), bit for bit; every
    other call to ``original``. Only float32 tables: Diffusers multiplies ``x.float()`` by them, so tables in a
    narrower dtype give float32 products, where the kernel would round them to the tables' dtype."""

    def apply_rotary_emb(x, freqs_cis, use_real=True, use_real_unbind_dim=-1, sequence_dim=2):
        if use_real and use_real_unbind_dim == -1 and isinstance(freqs_cis, (tuple, list)) and len(freqs_cis) == 2:
            out = _fused(_paired_plan, sequence_dim, x, *freqs_cis)
            if out is not None:
                return out
        return original(x, freqs_cis, use_real=use_real, use_real_unbind_dim=use_real_unbind_dim,
                        sequence_dim=sequence_dim)

    return apply_rotary_emb


def channel_rotary(original):
    """A drop-in for LTX-Video's ``apply_rotary_emb(x, freqs)`` (``original``): ``x (B, S, C)`` on CUDA with float32
    ``(1 or B, S, C)`` tables in one launch (the ``"paired"`` form, the ``C`` channels split into groups of
    :data:`CHANNEL_GROUP` the kernel treats as heads, each with its own table rows: the pairs stay whole), bit for bit;
    every other call to ``original``."""

    def apply_rotary_emb(x, freqs):
        if isinstance(freqs, (tuple, list)) and len(freqs) == 2:
            out = _fused(_channel_plan, None, x, *freqs)
            if out is not None:
                return out
        return original(x, freqs)

    return apply_rotary_emb
