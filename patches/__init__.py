"""quantpatch.patches: per-library, per-model-family patchers (Transformers, Diffusers).

:func:`patch_for` picks the library patcher from the model's class hierarchy without
importing either library.
"""

from __future__ import annotations

from typing import Any, Callable


def selected(name: str, include: list[str] | None, exclude: list[str] | None) -> bool:
    """Whether site ``name`` passes ``patch_model``'s include/exclude substring filters."""
    if include and not any(s in name for s in include):
        return False
    return not (exclude and any(s in name for s in exclude))


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
