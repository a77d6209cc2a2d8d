"""Quantized attention inside Diffusers' context parallelism (Ulysses and ring).

After ``transformer.enable_parallelism(config=ContextParallelConfig(...))`` the processors pass a
``parallel_config`` to ``dispatch_attention_fn``, and Diffusers' backends run their attention inside its
templated context-parallel attention (``_templated_context_parallel_attention``): Ulysses' all-to-alls around
one call over the whole sequence with ``H / ulysses_degree`` heads, or ring's loop over the KV chunks whose
partial outputs it merges by their log-sum-exp::

    out = out_prev - sigmoid(lse - lse_prev) · (out_prev - out),  lse = lse_prev - logsigmoid(lse_prev - lse)

A patched processor hands that same machinery :func:`forward_op` in place of a backend's: ``quantpatch.attention``
in ``(B, S, H, D)``, returning with the output the natural-log LSE ``(B, S, H)`` of the very quantized softmax
that output used (the LSE of the unsmoothed scores: each KV chunk has its own smooth-K mean), which is what the
merge above needs. Nothing is registered in Diffusers' backend registry, so ``set_attention_backend`` /
``reset_attention_backend`` keep their meaning for the calls that run the processor's own attention.

The speed policy decides on the lengths the attention runs at (:func:`attention_lengths`), not the local ones.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from quantpatch.api import attention
from quantpatch.config import AttentionConfig
from quantpatch.fallback import SiteRecord, running_site


def attention_lengths(parallel_config: Any, nq: int, nk: int) -> tuple[int, int]:
    """``(Nq, Nk)`` of one attention call under ``parallel_config`` for local lengths ``nq`` / ``nk``.

    Ulysses gathers the sequence (``× ulysses_degree``) and splits the heads; ring keeps the local query chunk and
    attends to one KV chunk of the local length per step.
    """
    degree = parallel_config.context_parallel_config.ulysses_degree
    return nq * degree, nk * degree


def materialized(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a plain tensor a GPU kernel can read: ring attention's KV chunks are views of a lazy all-gather
    (an ``AsyncCollectiveTensor``), whose data pointer is not the gathered buffer's until it is waited on."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return tensor.wait() if isinstance(tensor, AsyncCollectiveTensor) else tensor


def forward_op(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
               dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool, return_lse: bool,
               _save_ctx: bool = True, _parallel_config: Any = None, *, config: AttentionConfig, record: SiteRecord,
               strict: bool):
    """A forward op of Diffusers' templated context-parallel attention running ``quantpatch.attention``.

    ``query (B, Sq, H, D)``, ``key`` / ``value (B, Sk, H, D)`` as the templated attention hands them (after
    Ulysses' all-to-all, or one ring step's KV chunk). Returns ``out (B, Sq, H, D)`` in the query's dtype, and with
    ``return_lse`` also ``lse (B, Sq, H)`` float32, natural log. Inference only: nothing is saved for a backward.
    """
    query, key, value = (materialized(t) for t in (query, key, value))
    with running_site(record):
        result = attention(query, key, value, mode=config, is_causal=is_causal, scale=scale, layout="BSHD",
                           attn_mask=attn_mask, return_lse=return_lse, strict=strict)
    if not return_lse:
        return result
    out, lse = result
    return out, lse.transpose(1, 2)


def backward_op(ctx: Any, grad_out: torch.Tensor, *args: Any, **kwargs: Any):
    raise NotImplementedError("quantpatch attention is inference-only: run context-parallel models under "
                              "torch.no_grad() (no backward through the quantized kernels)")


@functools.cache
def _templated() -> Callable:
    from diffusers.models.attention_dispatch import _templated_context_parallel_attention

    return _templated_context_parallel_attention


def bound_forward_op(config: AttentionConfig, record: SiteRecord, strict: bool) -> Callable:
    """:func:`forward_op` for one patched site (made once, at patch time)."""
    return functools.partial(forward_op, config=config, record=record, strict=strict)


def context_parallel_attention(op: Callable, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attn_mask: torch.Tensor | None, is_causal: bool, scale: float | None,
                               enable_gqa: bool, parallel_config: Any) -> torch.Tensor:
    """Diffusers' templated context-parallel attention over ``op`` (a :func:`bound_forward_op`):
    ``(B, S_local, H, D)`` in and out, as ``dispatch_attention_fn`` takes and returns them."""
    return _templated()(query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa, False, forward_op=op,
                        backward_op=backward_op, _parallel_config=parallel_config)
