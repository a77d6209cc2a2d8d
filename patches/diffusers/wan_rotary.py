"""Wan2.1's rotary embedding, taken out of its attention processor into one kernel launch per tensor.

Diffusers' ``WanAttnProcessor`` rotates its query and key just before its attention call, in eight elementwise
kernels over float32 intermediates: at 480p (32,760 tokens) about 3.6 GB of memory traffic a layer, 6 % of a
Wan2.1-1.3B step on an H200. Where a processor's source applies exactly that rotation
(:func:`rotary_parameter`), the wrapping processor passes ``rotary_emb=None`` to it and the attention call it then
makes rotates the query and key itself (:func:`rotate`): the Triton kernel of
:mod:`quantpatch.kernels.rotary.rotary_triton` on CUDA in eager mode, the reference elsewhere, both bit for bit
the processor's own arithmetic. Processors whose source differs (another Diffusers version) run unchanged.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from quantpatch.kernels.rotary.rotary_ref import rotary_interleaved_ref

# What the processor's __call__ must say, whitespace aside: the rotation rotary_interleaved_ref computes, applied to
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


def rotary_parameter(processor: Any) -> int | None:
    """The position of ``rotary_emb`` among ``processor``'s call arguments after ``attn``, where its ``__call__``
    rotates the query and key as :func:`rotate` does (None otherwise: the processor keeps its own rotation)."""
    call = type(processor).__call__
    try:
        source = "".join(inspect.getsource(call).split())
        params = list(inspect.signature(call).parameters)
    except (OSError, TypeError, ValueError):
        return None
    if _PARAMETER not in params or not all(line in source for line in _ROTATION):
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
    """``x (B, S, H, D)`` rotated as the processor rotates it: one Triton launch on CUDA in eager mode where the
    kernel takes the shapes, the reference otherwise."""
    if x.is_cuda and not torch.compiler.is_compiling():
        from quantpatch.kernels.rotary.rotary_triton import rotary_interleaved, rotary_unsupported

        if rotary_unsupported(x, cos, sin) is None:
            return rotary_interleaved(x, cos, sin)
    return rotary_interleaved_ref(x, cos, sin)
