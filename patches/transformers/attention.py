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
from quantpatch.fallback import SiteRecord, fall_back, running_site
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
# What a call can be refused for besides dropout (refused only while training): most calls pass none of these names
_SCREENED_INPUTS = frozenset({"softcap", *REFUSED_INPUTS})


def _unsupported(site: AttentionSite, module: Any, kwargs: dict) -> str | None:
    """Why our attention cannot honour a call with these keyword arguments (None: it can)."""
    if module.training and kwargs.get("dropout"):
        return "attention dropout during training"
    if site.softcap is None and _SCREENED_INPUTS.isdisjoint(kwargs):  # the usual call: one set test
        return None
    if kwargs.get("softcap") or site.softcap:
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
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        # ``dropout``, ``scaling``, ``softcap`` and ``is_causal`` stay in ``kwargs``: the original attention gets the
        # model's arguments as the model passed them, and a short call binds nothing it does not read
        site: AttentionSite | None = getattr(module, SITE_ATTR, None)
        turbo_layer = turbo_layer_for(module, key)  # key/value are placeholders of a compressed cache layer
        config = None if site is None else site.config
        reason = None if config is None else _unsupported(site, module, kwargs)
        if config is None or reason:
            if reason:
                with running_site(site.record):
                    fall_back(f"{site.record.name}", reason, strict=site.strict)
            if turbo_layer is not None:
                key, value = turbo_layer.dequantized(query.dtype)
            impl = site.original if site else original_attention(module, "sdpa")
            return impl(module, query, key, value, attention_mask, **kwargs)
        shape = query.shape
        nq = shape[2]
        causal = attention_mask is None and nq > 1  # cheap tests first: a decode step never reads the flags
        if causal:
            is_causal = kwargs.get("is_causal")
            causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
        if turbo_layer is None and site.policy == "speed":
            why = speed_reason(config, query.device, shape[-1], nq, key.shape[2], causal)
            if why is None:  # long enough: does a kernel take it (a mask, a position bias, a dtype)?
                position_bias = kwargs.get("position_bias")
                mask = attention_mask if position_bias is None else position_bias
                call = AttentionCall(query, key, value, config, causal, kwargs.get("scaling"), mask, False)
                _, _, why = speed_route(call)
            if why is not None:  # the model's own attention: exactly its unpatched result and speed
                site.record.count_sdpa(why)
                return site.original(module, query, key, value, attention_mask, **kwargs)
        scaling = kwargs.get("scaling")  # read here, not above: the short calls that end above never use them
        position_bias = kwargs.get("position_bias")
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
