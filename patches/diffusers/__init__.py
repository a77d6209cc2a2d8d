"""Diffusers patcher: wrap the transformer's own attention processors, and fuse Wan's blocks' adaptive layer norms
(:mod:`.adaln`).

Only the transformer (denoiser) is patched, never the VAE or text encoders; a pipeline is
accepted and its ``transformer`` component found.
"""

from __future__ import annotations

from typing import Any

import torch

from quantpatch.config import ModeConfig
from quantpatch.patches import note_untested, selected
from quantpatch.patches.diffusers.adaln import fuse_blocks
from quantpatch.patches.diffusers.families import FAMILIES
from quantpatch.patches.diffusers.processors import wrap_processor
from quantpatch.patching import PATCHED_MARK, PatchHandle


def processor_owners(model: Any) -> dict[str, Any]:
    """``{"<module>.processor": module}`` for every attention module of ``model``.

    Walks the modules rather than reading ``attn_processors``: some transformers lack
    ``AttentionMixin`` (``MochiTransformer3DModel`` in Diffusers 0.42) and their attention
    modules (``MochiAttention``) hold a plain ``processor`` attribute with no setter.
    """
    if not isinstance(model, torch.nn.Module):
        return {}
    return {f"{name}.processor": m for name, m in model.named_modules() if name and "processor" in vars(m)}


def find_transformer(model: Any) -> Any:
    """The denoising transformer of a pipeline (or ``model`` itself if it is one)."""
    if hasattr(model, "set_attn_processor") or processor_owners(model):
        return model
    transformer = getattr(model, "transformer", None)
    if transformer is None or not (hasattr(transformer, "set_attn_processor") or processor_owners(transformer)):
        raise ValueError(f"{type(model).__name__} has no transformer with attention processors to patch")
    return transformer


def patch_diffusers_model(
    model: Any,
    mode: ModeConfig,
    handle: PatchHandle,
    *,
    strict: bool,
    include: list[str] | None,
    exclude: list[str] | None,
) -> None:
    """Wrap every attention processor of the transformer and fuse its blocks' adaptive layer norms where they are
    Wan's (:func:`~quantpatch.patches.diffusers.adaln.fuse_blocks`), recording the originals in ``handle``."""
    transformer = find_transformer(model)
    # patch_model marks only the object it was given: a pipeline and its transformer must see each other's mark
    if getattr(transformer, PATCHED_MARK, None) is not None:
        raise ValueError("this model's transformer is already patched by quantpatch; call .remove() on its handle")
    name = type(transformer).__name__
    route = FAMILIES.get(name)
    if route is None:
        message = f"{name} is not in quantpatch's tested Diffusers families {sorted(FAMILIES)}"
        note_untested(handle, message, strict=strict, how="patched through its processors' SDPA calls all the same")
        route = "sdpa"
    # No AttentionMixin (Mochi): swap each module's ``processor`` attribute, recorded in the handle.
    owners = None if hasattr(transformer, "attn_processors") else processor_owners(transformer)
    originals = dict(transformer.attn_processors) if owners is None else {s: m.processor for s, m in owners.items()}
    replacements = {}
    for site, processor in originals.items():
        is_selected = selected(site, include, exclude)
        if not is_selected or isinstance(processor, torch.nn.Module):
            reason = "excluded" if not is_selected else "stateful (nn.Module) processor kept"
            handle.add_site(site, "attention", f"original {type(processor).__name__} ({reason})")
            replacements[site] = processor
            continue
        record = handle.add_site(site, "attention", f"quantpatch {mode.name} attention in {type(processor).__name__}")
        replacements[site] = wrap_processor(processor, handle.attention_config(site), record, strict, route,
                                            handle.policy)
    if owners is None:
        transformer.set_attn_processor(replacements)
        handle.add_undo(lambda: transformer.set_attn_processor(originals))
    else:
        for site, module in owners.items():
            handle.setattr(module, "processor", replacements[site])
    fused = fuse_blocks(transformer, handle)
    if fused:
        handle.remarks.append(f"{fused} blocks run their adaptive layer norms and gated residuals fused (one launch "
                              "each on CUDA)")
    if transformer is not model:
        handle.setattr(transformer, PATCHED_MARK, handle)
