"""Transformers' rotary embedding (``apply_rotary_pos_emb`` with ``rotate_half``) in one kernel launch per tensor.

Llama-style models rotate their query and key in six elementwise kernels a tensor (``q · cos``, the two halves'
``torch.cat``, a negation, ``· sin``, the sum), in the model's dtype. Where a patched model's modeling module
defines exactly that rotation (:func:`rotary_module`), its ``apply_rotary_pos_emb`` becomes
:func:`halves_rotary`'s replacement while any patched model holds it (:func:`take_over`, reference-counted, so
patches removed in any order leave the original): on CUDA in eager mode one Triton launch for the query and one
for the key (:mod:`quantpatch.kernels.rotary.rotary_triton`, the ``"halves"`` form, products rounded to the model's
dtype as PyTorch rounds them), bit for bit; every other call goes to the original.
"""

from __future__ import annotations

import inspect
import sys
from types import ModuleType
from typing import Any

from quantpatch.patches import plain_cuda_eager, source_holds

_APPLY = "apply_rotary_pos_emb"
# What the module's functions must say, whitespace aside: the rotation of rotary_ref's "halves" form.
_ROTATION = {
    _APPLY: ("cos=cos.unsqueeze(unsqueeze_dim)", "sin=sin.unsqueeze(unsqueeze_dim)",
             "q_embed=(q*cos)+(rotate_half(q)*sin)", "k_embed=(k*cos)+(rotate_half(k)*sin)", "returnq_embed,k_embed"),
    "rotate_half": ("x1=x[...,:x.shape[-1]//2]", "x2=x[...,x.shape[-1]//2:]", "returntorch.cat((-x2,x1),dim=-1)"),
}
_PARAMETERS = ["q", "k", "cos", "sin", "unsqueeze_dim"]
# Calls with fewer positions (batch × sequence) run the original: decode steps and short prompts, where the model's
# six small kernels take less host time than two launches of the kernel (Llama-3-8B generate() at B=1 after a 4k
# prompt ran 0.95× unpatched with every call in one launch; H200)
MIN_TOKENS = 1024
_HELD: dict[str, list] = {}  # module name → [original function, patched models holding the replacement]


def rotary_module(attention: Any) -> ModuleType | None:
    """The modeling module of an attention module whose ``apply_rotary_pos_emb`` and ``rotate_half`` are the
    rotation :func:`halves_rotary` computes (None otherwise)."""
    module = sys.modules.get(type(attention).__module__)
    if module is None:
        return None
    held = _HELD.get(module.__name__)
    original = held[0] if held else getattr(module, _APPLY, None)
    functions = {_APPLY: original, "rotate_half": getattr(module, "rotate_half", None)}
    if not all(source_holds(functions[name], lines) for name, lines in _ROTATION.items()):
        return None
    try:
        if list(inspect.signature(original).parameters) != _PARAMETERS:
            return None
    except (TypeError, ValueError):
        return None
    return module


def halves_rotary(original):
    """A drop-in for a modeling module's ``apply_rotary_pos_emb`` (``original``): calls on plain CUDA tensors (a
    tensor subclass such as a DTensor goes to ``original``), ``(B, H, S, D)`` query and key of at least
    :data:`MIN_TOKENS` positions with ``(B or 1, S, D)`` tables of their dtype in one launch each, bit for bit; every
    other call to ``original``."""

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        # the position count first: a decode step leaves after one comparison
        if unsqueeze_dim == 1 and q.dim() == 4 and q.shape[0] * q.shape[2] >= MIN_TOKENS and k.dim() == 4 \
                and cos.dim() == 3 and plain_cuda_eager(q, k, cos, sin) and cos.dtype == q.dtype == k.dtype:
            from quantpatch.kernels.rotary.rotary_triton import rotary_embedding_checked, rotary_unsupported

            c, s = cos[:, :, None], sin[:, :, None]  # (B, S, 1, D)
            qv, kv = q.transpose(1, 2), k.transpose(1, 2)  # (B, S, H, D)
            if rotary_unsupported(qv, c, s) is None and rotary_unsupported(kv, c, s) is None:
                return (rotary_embedding_checked(qv, c, s, "halves").transpose(1, 2),
                        rotary_embedding_checked(kv, c, s, "halves").transpose(1, 2))
        return original(q, k, cos, sin, unsqueeze_dim)

    return apply_rotary_pos_emb


def take_over(module: ModuleType, handle: Any) -> None:
    """Give ``module`` the one-launch ``apply_rotary_pos_emb`` until ``handle`` is removed (the original returns
    when the last patched model holding it is)."""
    held = _HELD.get(module.__name__)
    if held is None:
        original = getattr(module, _APPLY)
        held = _HELD[module.__name__] = [original, 0]
        setattr(module, _APPLY, halves_rotary(original))
    held[1] += 1

    def release():
        held[1] -= 1
        if held[1] == 0:
            setattr(module, _APPLY, held[0])
            del _HELD[module.__name__]

    handle.add_undo(release)
