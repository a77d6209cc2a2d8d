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

Processors whose source differs (another Diffusers version) run their own rotation unchanged.
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
    if _kernel_takes(x, cos, sin):
        from quantpatch.kernels.rotary.rotary_triton import rotary_embedding_checked

        return rotary_embedding_checked(x, cos, sin, "wan")
    return rotary_embedding_ref(x, cos, sin)


def _kernel_takes(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Plain CUDA tensors in eager mode (:func:`~quantpatch.patches.plain_cuda_eager`), of shapes the kernel
    takes."""
    if not plain_cuda_eager(x, cos, sin):
        return False
    from quantpatch.kernels.rotary.rotary_triton import rotary_unsupported

    return rotary_unsupported(x, cos, sin) is None


def rotary_modules(processor: Any, module: Any) -> tuple:
    """The modules whose ``apply_rotary_emb`` a processor's call may read as Diffusers' own: Diffusers' embeddings
    module (a call may import it there) and the processor's ``module`` where it holds the same function; none
    where the processor's source never calls that name, or Diffusers has no such function."""
    try:
        from diffusers.models import embeddings
        source = inspect.getsource(type(processor).__call__)
    except (ImportError, OSError, TypeError):
        return ()
    original = getattr(embeddings, _APPLY, None)
    if original is None or f"{_APPLY}(" not in source:
        return ()
    return tuple(m for m in (embeddings, module) if getattr(m, _APPLY, None) is original)


def paired_rotary(original):
    """A drop-in for Diffusers' ``apply_rotary_emb`` (``original``): its ``use_real=True, use_real_unbind_dim=-1``
    calls on CUDA tensors with float32 ``(S, D)`` tables in one launch (``"paired"`` tables), bit for bit; every
    other call to ``original``. Only float32 tables: Diffusers multiplies ``x.float()`` by them, so tables in a
    narrower dtype give float32 products, where the kernel would round them to the tables' dtype."""

    def apply_rotary_emb(x, freqs_cis, use_real=True, use_real_unbind_dim=-1, sequence_dim=2):
        if use_real and use_real_unbind_dim == -1 and sequence_dim in (1, 2) and x.dim() == 4 \
                and isinstance(freqs_cis, (tuple, list)) and len(freqs_cis) == 2 and freqs_cis[0].dim() == 2 \
                and freqs_cis[0].dtype == torch.float32:
            view = x if sequence_dim == 1 else x.transpose(1, 2)  # (B, S, H, D)
            cos, sin = (t[None, :, None, :] for t in freqs_cis)
            if _kernel_takes(view, cos, sin):
                from quantpatch.kernels.rotary.rotary_triton import rotary_embedding_checked

                out = rotary_embedding_checked(view, cos, sin, "paired")
                return out if sequence_dim == 1 else out.transpose(1, 2)
        return original(x, freqs_cis, use_real=use_real, use_real_unbind_dim=use_real_unbind_dim,
                        sequence_dim=sequence_dim)

    return apply_rotary_emb
