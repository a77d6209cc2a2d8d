"""Transformers patcher: our attention through ``AttentionInterface`` / ``set_attn_implementation``.

Each ``patch_model`` call registers its own attention and mask functions under a fresh key
(so two patched models never share state and ``remove()`` leaves no global entry behind),
tags every attention site (a module whose ``forward`` dispatches through
``ALL_ATTENTION_FUNCTIONS``) with its config, and switches the model's implementation. The sites' rotary
embedding, where it is Transformers' ``rotate_half`` one, runs in one launch a tensor (:mod:`.rotary`).
"""

from __future__ import annotations

import itertools
from typing import Any

from quantpatch.config import ModeConfig
from quantpatch.patches import note_untested, selected, source_holds
from quantpatch.patches.transformers.attention import (
    SITE_ATTR,
    AttentionSite,
    make_attention_function,
    original_attention,
)
from quantpatch.patches.transformers.families import FAMILIES
from quantpatch.patches.transformers.masks import shape_skipping_mask
from quantpatch.patches.transformers.rotary import rotary_module, take_over
from quantpatch.patches.transformers.tensor_parallel import rank_kv_heads
from quantpatch.patches.transformers.turbo_cache import install_generate_hook
from quantpatch.patching import PatchHandle

_keys = itertools.count()
MASK_COMPATIBLE = ("sdpa", "eager")


def _dispatches_attention(module: Any) -> bool:
    return source_holds(type(module).forward, ["ALL_ATTENTION_FUNCTIONS"])


def patch_transformers_model(
    model: Any,
    mode: ModeConfig,
    handle: PatchHandle,
    *,
    strict: bool,
    include: list[str] | None,
    exclude: list[str] | None,
) -> None:
    """Patch every attention site of a ``PreTrainedModel`` in place, recording each change in ``handle``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    model_type = getattr(model.config, "model_type", None)
    family = FAMILIES.get(model_type)
    if family is None:
        message = f"model type {model_type!r} is not in quantpatch's tested families {sorted(FAMILIES)}"
        note_untested(handle, message, strict=strict, how="patched through AttentionInterface all the same")
    if not model._can_set_attn_implementation():
        raise ValueError(f"{type(model).__name__} does not dispatch attention through AttentionInterface")
    if mode.kv_cache.kind not in ("none", "turbo") or mode.linear.kind not in ("none", "fp8"):
        handle.remarks.append(
            f"mode {mode.name!r}: only its attention numerics are applied by patch_model so far "
            f"(KV cache {mode.kv_cache.kind!r}, linear {mode.linear.kind!r} come from calibrated checkpoints)"
        )

    # Fallbacks run the original attention, so the mask must be in its format (bool for sdpa,
    # additive for eager); quantpatch.attention takes either. Other originals fall back to sdpa.
    # Over sdpa, plain causal/bidirectional masks are skipped from shapes alone (masks.py), so that
    # torch.compile traces reach the kernels with is_causal rather than a materialised mask.
    original_impl = model.config._attn_implementation
    if original_impl not in MASK_COMPATIBLE:
        original_impl = "sdpa"
    softcap = getattr(model.config, family.softcap, None) if family and family.softcap else None
    sites = [(n, m) for n, m in model.named_modules() if _dispatches_attention(m)]
    if not sites:
        raise ValueError(f"found no attention module dispatching through AttentionInterface in {type(model).__name__}")
    kv_heads = rank_kv_heads(model)
    # the rotary embedding in one launch a tensor, bit for bit, whatever the mode (rotary.py)
    for rotary in {m.__name__: m for m in map(rotary_module, (module for _, module in sites)) if m}.values():
        take_over(rotary, handle)
    for name, module in sites:
        is_selected = selected(name, include, exclude)
        runs = f"quantpatch {mode.name} attention" if is_selected else f"original {original_impl} attention (excluded)"
        record = handle.add_site(name, "attention", runs)
        config = handle.attention_config(name) if is_selected else None
        site = AttentionSite(config, record, strict, original_attention(module, original_impl), softcap, handle.policy,
                             kv_heads)
        handle.setattr(module, SITE_ATTR, site)

    key = f"quantpatch_{next(_keys)}"
    handle.setitem(AttentionInterface._global_mapping, key, make_attention_function())
    mask = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[original_impl]
    mask = shape_skipping_mask(mask) if original_impl == "sdpa" else mask
    handle.setitem(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, key, mask)
    configs = {
        id(m.config): m.config
        for m in model.modules()
        if hasattr(getattr(m, "config", None), "_attn_implementation_internal")
    }
    for config in configs.values():
        handle.setattr(config, "_attn_implementation_internal", config._attn_implementation_internal)
    model.set_attn_implementation(key)
    if mode.kv_cache.kind == "turbo":
        install_generate_hook(model, handle, mode.kv_cache, strict=strict)
