"""Diffusers patcher: wrap the transformer's own attention processors.

Only the transformer (denoiser) is patched, never the VAE or text encoders; a pipeline is
accepted and its ``transformer`` component found.
"""

from __future__ import annotations

from typing import Any

import torch

from quantpatch.config import ModeConfig
from quantpatch.fallback import UnsupportedError, logger
from quantpatch.patches.diffusers.families import FAMILIES
from quantpatch.patches.diffusers.processors import wrap_processor
from quantpatch.patching import PatchHandle


def find_transformer(model: Any) -> Any:
    """The denoising transformer of a pipeline (or ``model`` itself if it is one)."""
    if hasattr(model, "set_attn_processor"):
        return model
    transformer = getattr(model, "transformer", None)
    if transformer is None or not hasattr(transformer, "set_attn_processor"):
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
    """Wrap every attention processor of the transformer, recording the originals in ``handle``."""
    transformer = find_transformer(model)
    name = type(transformer).__name__
    route = FAMILIES.get(name)
    if route is None:
        message = f"{name} is not in quantpatch's tested Diffusers families {sorted(FAMILIES)}"
        if strict:
            raise UnsupportedError(message)
        handle.notes.append(message + "; patched through its processors' SDPA calls all the same")
        logger.warning(message)
        route = "sdpa"
    originals = dict(transformer.attn_processors)
    replacements = {}
    for site, processor in originals.items():
        selected = not (include and not any(s in site for s in include)) and not (
            exclude and any(s in site for s in exclude)
        )
        if not selected or isinstance(processor, torch.nn.Module):
            reason = "excluded" if not selected else "stateful (nn.Module) processor kept"
            handle.add_site(site, "attention", f"original {type(processor).__name__} ({reason})")
            replacements[site] = processor
            continue
        record = handle.add_site(site, "attention", f"quantpatch {mode.name} attention in {type(processor).__name__}")
        replacements[site] = wrap_processor(processor, handle.attention_config(site), record, strict, route)
    transformer.set_attn_processor(replacements)
    handle.add_undo(lambda: transformer.set_attn_processor(originals))
