"""The attention function registered with Transformers' ``AttentionInterface``.

Transformers calls it with ``(B, H, S, D)`` query/key/value after RoPE and the cache update
and expects ``(B, S, H, D)`` back. GQA is native (no ``repeat_kv``). Causality: with no mask
and ``q_len > 1`` the call is causal as SDPA's ``is_causal`` is (top-left: a prefill into an empty
static cache sees none of its empty slots); otherwise the mask built by ``sdpa_mask`` (padding,
sliding windows, chunked prefill) is honoured as given. T5's ``position_bias`` joins the mask.

With a ``TurboCache`` under a ``turbo`` site, ``key``/``value`` of a decode call are placeholders
and the attention runs on the compressed layer found by ``module.layer_idx``
(``turbo_cache.turbo_layer_for`` / ``turbo_cache_attention``); fallbacks get the layer dequantized.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from quantpatch.api import attention
from quantpatch.config import AttentionConfig
from quantpatch.crs import apply_online_crs, crs_buffers
from quantpatch.dispatch import AttentionCall, speed_reason, speed_route
from quantpatch.fallback import SiteRecord, fall_back, note_sdpa_route, running_site
from quantpatch.patches.transformers.turbo_cache import (
    READS_TURBO_LAYERS,
    SITE_ATTR,
    turbo_cache_attention,
    turbo_layer_for,
)


@dataclass(frozen=True)
class AttentionSite:
    """What a patched attention module runs: ``config`` None means the original attention."""

    config: AttentionConfig | None
    record: SiteRecord
    strict: bool
    original: Callable  # the model's own attention function (original_attention), resolved at patch time
    softcap: float | None
    policy: str = "speed"
    kv_heads: slice = field(default_factory=lambda: slice(None))  # the KV heads this rank holds (tensor parallelism)


def original_attention(module: Any, impl: str) -> Callable:
    """The attention function the model used before patching."""
    from transformers import AttentionInterface

    if impl in AttentionInterface._global_mapping:
        return AttentionInterface._global_mapping[impl]
    return sys.modules[type(module).__module__].eager_attention_forward


# Extra attention inputs some families pass through ``AttentionInterface`` that change the result; our
# attention does not compute them, so a call that carries one runs the original attention (reported).
# ``position_bias`` (T5-style relative bias) is honoured instead: it is folded into an additive mask.
REFUSED_INPUTS = {"s_aux": "attention sinks (s_aux)", "sinks": "attention sinks (sinks)", "alibi": "ALiBi bias (alibi)",
                  "head_mask": "a head mask (head_mask)"}


def _unsupported(site: AttentionSite, module: Any, dropout: float, softcap: float | None, kwargs: dict) -> str | None:
    if dropout and module.training:
        return "attention dropout during training"
    if softcap or site.softcap:
        return "attention logit softcapping"
    for name, what in REFUSED_INPUTS.items():
        value = kwargs.get(name)
        if value is not None and value is not False:
            return what
    return None


def _transformers_causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
    """A causal call with no mask, in Transformers' meaning: SDPA's top-left ``is_causal``.

    Transformers hands no mask where ``is_causal`` is exact: ``q_len == kv_len``, or a prefill into an
    empty static cache (``q_len < kv_len``: the keys past ``q_len`` are empty slots no query may see).
    Top-left causal over the first ``q_len`` keys is bottom-right causal over them, which our paths
    compute; returns ``(key, value, mask)`` with the empty slots cut (a bool mask only if ``q_len > kv_len``).
    """
    nq, nk = query.shape[2], key.shape[2]
    if nq <= nk:
        return key[:, :, :nq], value[:, :, :nq], None
    rows = torch.arange(nq, device=query.device)[:, None]
    return key, value, rows >= torch.arange(nk, device=query.device)[None, :]


def _with_position_bias(bias: torch.Tensor, mask: torch.Tensor | None, nk: int) -> torch.Tensor:
    """T5-style ``position_bias`` ``(B|1, H, Nq, >=Nk)`` added to ``mask`` (bool or additive) as one additive mask."""
    bias = bias[..., :nk]
    if mask is None:
        return bias
    if mask.dtype == torch.bool:
        return bias.masked_fill(~mask, float("-inf"))
    return bias + mask


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
            impl = site.original if site else original_attention(module, "sdpa")
            return impl(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                        softcap=softcap, is_causal=is_causal, **kwargs)
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        causal = bool(causal) and attention_mask is None and query.shape[2] > 1
        position_bias = kwargs.get("position_bias")
        if site.policy == "speed" and turbo_layer is None:
            why = speed_reason(site.config, query.device, query.shape[-1], query.shape[2], key.shape[2], causal)
            if why is None:  # long enough: does a kernel take it (a mask, a position bias, a dtype)?
                mask = attention_mask if position_bias is None else position_bias
                _, _, why = speed_route(AttentionCall(query, key, value, site.config, causal, scaling, mask, False))
            if why is not None:  # the model's own attention: exactly its unpatched result and speed
                note_sdpa_route(site.record, why)
                return site.original(
                    module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, softcap=softcap,
                    is_causal=is_causal, **kwargs)
        if causal and turbo_layer is None and query.shape[2] != key.shape[2]:
            key, value, attention_mask = _transformers_causal(query, key, value)
            causal = attention_mask is None
        if position_bias is not None:
            attention_mask = _with_position_bias(position_bias, attention_mask, key.shape[2])
        crs = crs_buffers(module) if site.config.numerics == "fireq" else None
        if crs is not None:  # a converted fireq model: CRS post-RoPE, online (q · t, k / t)
            query, key = apply_online_crs(query, key, crs[0][site.kv_heads])
            if query.shape[2] < key.shape[2]:  # decode / chunked prefill over the cache: INT4 K/V, FP8 Q
                from quantpatch.kernels.fireq_kv.fireq_ref import fireq_decode_attention_ref

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
                                attn_mask=attention_mask, strict=site.strict)  # the route is decided above
        return out.transpose(1, 2).contiguous(), None

    setattr(quantpatch_attention_forward, READS_TURBO_LAYERS, True)
    return quantpatch_attention_forward
