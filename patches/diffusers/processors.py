"""Processors that wrap a Diffusers model's own attention processor.

The wrapped processor runs unchanged (its projections, QK norms, RoPE and joint text/video
attention stay exact; Wan's RoPE runs in the attention call instead, bit for bit, :mod:`.rotary`); only its
attention product is routed to ``quantpatch.attention``:
while it runs, the name it calls (``dispatch_attention_fn`` in its module, or
``torch.nn.functional.scaled_dot_product_attention``) is swapped, inside try/finally.
Under context parallelism (a ``parallel_config`` in the dispatch call) the attention runs inside
Diffusers' own Ulysses / ring machinery (:mod:`~quantpatch.patches.diffusers.context_parallel`).
The attributes Diffusers sets on a processor (``_parallel_config`` from ``enable_parallelism``,
``_attention_backend`` from ``set_attention_backend``) reach the wrapped processor, which reads them.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Callable

import torch

from quantpatch.api import attention
from quantpatch.config import AttentionConfig
from quantpatch.dispatch import AttentionCall, speed_reason, speed_route
from quantpatch.fallback import SiteRecord, fall_back, note_sdpa_route, running_site
from quantpatch.patches.diffusers.context_parallel import (
    attention_lengths,
    bound_forward_op,
    context_parallel_attention,
)
from quantpatch.patches.diffusers.key_padding import kept_prefixes
from quantpatch.patches.diffusers.rotary import fused_rotation, rotary_parameter, rotate, take_rotary


class _Router:
    """The quantized replacements for one processor call, with the originals for fallback."""

    def __init__(self, config: AttentionConfig, record: SiteRecord, strict: bool, dispatch: Callable | None,
                 policy: str):
        self.config, self.record, self.strict, self.policy = config, record, strict, policy
        self.original_dispatch = dispatch
        self.original_sdpa = torch.nn.functional.scaled_dot_product_attention
        self.context_parallel_op = bound_forward_op(config, record, strict)
        self.pending_rotary: tuple[torch.Tensor, torch.Tensor] | None = None  # (cos, sin) taken from the processor

    def _rotated(self, query, key, layout: str):
        """``query`` and ``key`` rotated by the processor's pending rotary embedding (:mod:`.rotary`), once."""
        cos, sin = self.pending_rotary
        self.pending_rotary = None
        if layout == "BSHD":
            return rotate(query, cos, sin), rotate(key, cos, sin)
        return tuple(rotate(t.transpose(1, 2), cos, sin).transpose(1, 2) for t in (query, key))

    def _keeps_original(self, layout, query, key, value, attn_mask, dropout_p, is_causal, scale,
                        lengths: tuple[int, int]) -> bool:
        """Whether this call runs the processor's own attention (the reason recorded on the site). ``lengths``:
        the ``(Nq, Nk)`` the attention runs at."""
        if self.policy == "speed":
            why = speed_reason(self.config, query.device, query.shape[-1], *lengths, is_causal)
            if why is None:  # long enough: does a kernel take it (a mask, a dtype)?
                q, k, v = (t.transpose(1, 2) for t in (query, key, value)) if layout == "BSHD" else (query, key, value)
                call = AttentionCall(q, k, v, self.config, is_causal, scale, attn_mask, False)
                _, _, why = speed_route(call, lengths)
            if why is not None:  # the processor's own attention: its unpatched result and speed
                note_sdpa_route(self.record, why)
                return True
        reason = None
        if dropout_p:
            reason = "attention dropout"
        elif is_causal and lengths[0] != lengths[1]:
            reason = "top-left causal mask with q_len != kv_len"
        if reason:
            with running_site(self.record):
                fall_back(self.record.name, reason, strict=self.strict)
            return True
        return False

    def _kept_rows(self, query, key, value, attn_mask, scale) -> list | None:
        """The unmasked calls ``[(query, key, value), ...]`` over the keys a prefix-keeping mask keeps
        (:mod:`.key_padding`): one for the batch where every row keeps the same prefix, one per row where the rows
        keep different ones. None where the mask keeps no prefixes, the policy is not ``"speed"``, or a kernel would
        not take every one of those calls: the processor's own masked call then runs, with its bits. BSHD layout."""
        counts = kept_prefixes(attn_mask, key.shape[1]) if self.policy == "speed" else None
        if counts is None:
            return None
        if len(set(counts)) == 1:
            calls = [(query, key[:, :counts[0]], value[:, :counts[0]])]
        elif len(counts) == query.shape[0] == key.shape[0]:
            calls = [(query[b:b + 1], key[b:b + 1, :n], value[b:b + 1, :n]) for b, n in enumerate(counts)]
        else:
            return None
        for q, k, v in calls:
            call = AttentionCall(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.config, False, scale,
                                 None, False)
            if speed_route(call)[2] is not None:
                return None
        return calls

    def dispatch(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False, attention_kwargs=None, *, backend=None, parallel_config=None):
        if self.pending_rotary is not None:
            query, key = self._rotated(query, key, "BSHD")
        if attn_mask is not None and parallel_config is None and not is_causal and not dropout_p:
            kept = self._kept_rows(query, key, value, attn_mask, scale)
            if kept is not None:  # routed above: a kernel takes each unmasked call (one a row where rows differ)
                with running_site(self.record):
                    outs = [attention(q, k, v, mode=self.config, scale=scale, layout="BSHD", strict=self.strict)
                            for q, k, v in kept]
                return outs[0] if len(outs) == 1 else torch.cat(outs)
        lengths = (query.shape[1], key.shape[1])
        if parallel_config is not None:  # Diffusers' context parallelism: Ulysses / ring around our attention
            lengths = attention_lengths(parallel_config, *lengths)
        if self._keeps_original("BSHD", query, key, value, attn_mask, dropout_p, is_causal, scale, lengths):
            return self.original_dispatch(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                                          attention_kwargs=attention_kwargs, backend=backend,
                                          parallel_config=parallel_config)
        if parallel_config is not None:
            return context_parallel_attention(self.context_parallel_op, query, key, value, attn_mask, is_causal,
                                              scale, enable_gqa, parallel_config)
        with running_site(self.record):
            return attention(query, key, value, mode=self.config, is_causal=is_causal, scale=scale, layout="BSHD",
                             attn_mask=attn_mask, strict=self.strict)  # the route is decided above

    def sdpa(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if self.pending_rotary is not None:
            query, key = self._rotated(query, key, "BHSD")
        if self._keeps_original("BHSD", query, key, value, attn_mask, dropout_p, is_causal, scale,
                                (query.shape[2], key.shape[2])):
            return self.original_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                      is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        with running_site(self.record):
            return attention(query, key, value, mode=self.config, is_causal=is_causal, scale=scale, layout="BHSD",
                             attn_mask=attn_mask, strict=self.strict)  # the route is decided above


class QuantpatchProcessor:
    """Runs ``original`` with its attention product quantized; see the module docstring.

    The router and the names it swaps are resolved once, at patch time: a call adds two attribute swaps (four with
    ``dispatch_attention_fn``) to the processor's own work. A processor that rotates its query and key as Wan's does
    (:func:`~quantpatch.patches.diffusers.rotary.rotary_parameter`) gets ``rotary_emb=None`` and its attention
    call rotates them in one kernel launch each, bit for bit as the processor would have; one that calls Diffusers'
    ``apply_rotary_emb`` (or LTX-Video's own) finds the one-launch form of it
    (:func:`~quantpatch.patches.diffusers.rotary.fused_rotation`) under that name while it runs.
    """

    def __init__(self, original: Any, config: AttentionConfig, record: SiteRecord, strict: bool, route: str,
                 policy: str):
        self.original, self.config, self.record, self.strict, self.route = original, config, record, strict, route
        self.policy = policy
        self.module = sys.modules[type(original).__module__]
        dispatch = getattr(self.module, "dispatch_attention_fn", None)
        self.router = _Router(config, record, strict, dispatch, policy)
        self.swaps_dispatch = route == "dispatch" and dispatch is not None
        self.rotary_index = rotary_parameter(original) if self.swaps_dispatch else None
        self.rotary_modules, self.fused_rotary = ((), None) if self.rotary_index is not None \
            else fused_rotation(original, self.module)

    def __call__(self, attn: Any, *args: Any, **kwargs: Any) -> Any:
        functional, router = torch.nn.functional, self.router
        if self.rotary_index is not None:
            args, kwargs, router.pending_rotary = take_rotary(attn, self.rotary_index, args, kwargs)
        router.original_sdpa = functional.scaled_dot_product_attention
        functional.scaled_dot_product_attention = router.sdpa
        if self.swaps_dispatch:
            router.original_dispatch = self.module.dispatch_attention_fn
            self.module.dispatch_attention_fn = router.dispatch
        rotations = [m.apply_rotary_emb for m in self.rotary_modules]
        for m in self.rotary_modules:
            m.apply_rotary_emb = self.fused_rotary
        try:
            out = self.original(attn, *args, **kwargs)
            if router.pending_rotary is not None:
                raise RuntimeError(f"{type(self.original).__name__} made no attention call, so the query and key "
                                   "rotation taken out of it was never applied")
            return out
        finally:
            router.pending_rotary = None
            functional.scaled_dot_product_attention = router.original_sdpa
            if self.swaps_dispatch:
                self.module.dispatch_attention_fn = router.original_dispatch
            for m, rotation in zip(self.rotary_modules, rotations):
                m.apply_rotary_emb = rotation

    def __getattr__(self, name: str) -> Any:  # e.g. _attention_backend, read by the model
        if name == "original":
            raise AttributeError(name)
        return getattr(self.original, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # the wrapped processor reads what Diffusers sets (enable_parallelism's _parallel_config, a backend)
        if name in _OWN_ATTRIBUTES:
            object.__setattr__(self, name, value)
        else:
            setattr(self.original, name, value)


_OWN_ATTRIBUTES = frozenset(("original", "config", "record", "strict", "route", "policy", "module", "router",
                             "swaps_dispatch", "rotary_index", "rotary_modules", "fused_rotary"))


def wrap_processor(original: Any, config: AttentionConfig, record: SiteRecord, strict: bool, route: str,
                   policy: str) -> Any:
    """A :class:`QuantpatchProcessor` whose ``__call__`` signature is ``original``'s.

    Diffusers drops call kwargs that the processor's signature lacks, so the wrapper must
    present the wrapped processor's parameters (image_rotary_emb, ...).
    """
    call = type(original).__call__

    def __call__(self, attn, *args, **kwargs):
        return QuantpatchProcessor.__call__(self, attn, *args, **kwargs)

    __call__.__signature__ = inspect.signature(call)
    cls = type(f"Quantpatch{type(original).__name__}", (QuantpatchProcessor,), {"__call__": __call__})
    return cls(original, config, record, strict, route, policy)
