"""quantpatch.patches: per-library, per-model-family patchers (Transformers, Diffusers).

:func:`patch_for` picks the library patcher from the model's class hierarchy without
importing either library.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable


def name_filter(argument: str, value: Any) -> list[str] | None:
    """A name filter as given to ``patch_model`` or ``convert`` (``include``, ``linear_exclude``, ...) as a list of
    substrings: None stays None, a string is one substring (not its characters), else an iterable of strings;
    anything other raises ``TypeError`` naming ``argument``."""
    if value is None:
        return None
    if isinstance(value, str):
        return [value]
    try:
        items = list(value)
    except TypeError:
        raise TypeError(f"{argument} takes a list of name substrings, got {type(value).__name__}") from None
    wrong = [item for item in items if not isinstance(item, str)]
    if wrong:
        raise TypeError(f"{argument} takes name substrings (str), got {wrong[0]!r}")
    return items


def selected(name: str, include: list[str] | None, exclude: list[str] | None) -> bool:
    """Whether site ``name`` passes ``patch_model``'s include/exclude substring filters."""
    if include and not any(s in name for s in include):
        return False
    return not (exclude and any(s in name for s in exclude))


def source_holds(function: Any, lines: tuple[str, ...] | list[str]) -> bool:
    """Whether ``function``'s source, whitespace removed, contains every one of ``lines`` (written without
    whitespace); False where it has no source."""
    try:
        source = "".join(inspect.getsource(function).split())
    except (OSError, TypeError):
        return False
    return all(line in source for line in lines)


def plain_cuda_eager(*tensors: Any) -> bool:
    """Whether ``tensors`` are plain CUDA tensors (no subclass such as a DTensor) outside a ``torch.compile``
    trace, with no gradient to record (:func:`~quantpatch.dispatch.records_grad`): what the one-launch kernels are
    handed."""
    import torch

    from quantpatch.dispatch import records_grad

    return (all(type(t) is torch.Tensor for t in tensors) and tensors[0].is_cuda
            and not torch.compiler.is_compiling() and not records_grad(*tensors))


def note_untested(handle: Any, message: str, *, strict: bool, how: str) -> None:
    """An untested model family: raise under ``strict``, else patch it ``how`` and say so."""
    from quantpatch.fallback import UnsupportedError, logger

    if strict:
        raise UnsupportedError(message)
    handle.remarks.append(f"{message}; {how}")
    logger.warning(message)


def _class_names(obj: Any) -> set[tuple[str, str]]:
    return {(cls.__module__.split(".")[0], cls.__name__) for cls in type(obj).__mro__}


def patch_for(model: Any) -> Callable:
    """The patch function for ``model``'s library; raises ``ValueError`` for anything else."""
    names = _class_names(model)
    if ("transformers", "PreTrainedModel") in names:
        from quantpatch.patches.transformers import patch_transformers_model

        return patch_transformers_model
    if {("diffusers", "DiffusionPipeline"), ("diffusers", "ModelMixin")} & names:
        from quantpatch.patches.diffusers import patch_diffusers_model

        return patch_diffusers_model
    raise ValueError(
        f"patch_model supports transformers PreTrainedModel and diffusers pipelines/models, got {type(model).__name__}"
    )
