"""The attention function registered with Transformers' ``AttentionInterface``.

Transformers calls it with ``(B, H, S, D)`` query/key/value after RoPE and the cache update
and expects ``(B, S, H, D)`` back. GQA is native (no ``repeat_kv``). Causality: with no mask
and ``q_len > 1`` the call is causal (bottom-right aligned); otherwise the boolean mask built
by ``sdpa_mask`` (padding, sliding windows, chunked prefill) is honoured as given.

With a ``TurboCache`` under a ``turbo`` site, ``key``/``value`` of a decode call are placeholders
and the attention runs on the compressed layer found by ``module.layer_idx``
(``turbo_cache.turbo_layer_for`` / ``turbo_cache_attention``); fallbacks get the layer dequantized.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch

from quantpatch.api import attention
from quantpatch.config import AttentionConfig
from quantpatch.convert import apply_online_crs, crs_buffers
from quantpatch.fallback import SiteRecord, fall_back, running_site
from quantpatch.patches.transformers.turbo_cache import READS_TURBO_LAYERS, turbo_cache_attention, turbo_layer_for

SITE_ATTR = "_quantpatch_site"


@dataclass(frozen=True)
class AttentionSite:
    """What a patched attention module runs: ``config`` None means the original attention."""

    config: AttentionConfig | None
    record: SiteRecord
    strict: bool
    original_impl: str
    softcap: float | None


def original_attention(module: Any, impl: str) -> Callable:
    """The attention function the model used before patching."""
    from transformers import AttentionInterface

    if impl in AttentionInterface._global_mapping:
        return AttentionInterface._global_mapping[impl]
    return sys.modules[type(module).__module__].eager_attention_forward


def _unsupported(site: AttentionSite, module: Any, dropout: float, softcap: float | None, kwargs: dict) -> str | None:
    if dropout and module.training:
        return "attention dropout during training"
    if softcap or site.softcap:
        return "attention logit softcapping"
    if kwargs.get("s_aux") is not None:
        return "attention sinks"
    return None


def make_attention_function() -> Callable:
    """A fresh ``AttentionInterface`` function (one per patch, so each can be unregistered)."""

    def quantpatch_attention_forward(
        module: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        softcap: float | None = None,
        is_causal: bool | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        site: AttentionSite | None = getattr(module, SITE_ATTR, None)
        turbo_layer = turbo_layer_for(module, key)  # key/value are placeholders of a compressed cache layer
        reason = None if site is None or site.config is None else _unsupported(site, module, dropout, softcap, kwargs)
        if site is None or site.config is None or reason:
            if reason:
                with running_site(site.record):
                    fall_back(f"{site.record.name}", reason, strict=site.strict)
            if turbo_layer is not None:
                key, value = turbo_layer.dequantized(query.dtype)
            impl = original_attention(module, site.original_impl if site else "sdpa")
            return impl(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                        softcap=softcap, is_causal=is_causal, **kwargs)
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        causal = bool(causal) and attention_mask is None and query.shape[2] > 1
        crs = crs_buffers(module) if site.config.numerics == "fireq" else None
        if crs is not None:  # a converted fireq model: CRS post-RoPE, online (q · t, k / t)
            query, key = apply_online_crs(query, key, crs[0])
            if query.shape[2] < key.shape[2]:  # decode / chunked prefill over the cache: INT4 K/V, FP8 Q
                from quantpatch.kernels.fireq_ref import fireq_decode_attention_ref

                with running_site(site.record):
                    out = fireq_decode_attention_ref(query, key, value, cfg=site.config, is_causal=causal,
                                                     scale=scaling, attn_mask=attention_mask)
                return out.to(query.dtype).transpose(1, 2).contiguous(), None
        with running_site(site.record):
            if turbo_layer is not None:  # decode / chunk over a TurboCache layer: read the compressed blocks
                out = turbo_cache_attention(query, turbo_layer, cfg=site.config, attn_mask=attention_mask,
                                            is_causal=causal, scale=scaling)
            else:
                out = attention(query, key, value, mode=site.config, is_causal=causal, scale=scaling,
                                attn_mask=attention_mask, strict=site.strict)
        return out.transpose(1, 2).contiguous(), None

    setattr(quantpatch_attention_forward, READS_TURBO_LAYERS, True)
    return quantpatch_attention_forward
