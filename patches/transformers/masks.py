"""The mask function registered beside our attention in Transformers' ``AttentionMaskInterface``.

Transformers builds the attention mask through the function registered under the model's
attention implementation. Its ``sdpa_mask`` returns ``None`` (so the attention may use
``is_causal``) when the mask is plainly causal or bidirectional, but it refuses to decide this
while ``torch.compile`` traces (with torch < 2.14 dynamo reports every compile as an export),
and then materialises a ``(B, 1, q_len, kv_len)`` boolean mask that our kernels cannot take.

:func:`shape_skipping_mask` wraps the original function and skips the mask from static facts
alone: no 2D padding mask was given, no sliding window reaches back past the keys, the caller
allowed the skip, and ``q_len == kv_len`` (prefill, causal) or ``q_len == 1`` (decode over the
whole cache). These depend on shapes and ``None``-ness only, never on tensor values, so the
decision is the same traced or eager (dynamo guards on the shapes). Everything else goes to the
original function unchanged. It is only installed over ``sdpa``, whose fallback attention reads
a ``None`` mask with ``q_len > 1`` as causal, as our attention does.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable


def _no_mask_needed(args: dict[str, Any]) -> bool:
    if args.get("attention_mask") is not None:
        return False
    local_size = args.get("local_size")
    if local_size is not None and args["kv_length"] >= local_size:
        return False
    if args.get("allow_is_causal_skip"):
        return args["q_length"] == 1 or args["q_length"] == args["kv_length"]
    return bool(args.get("allow_is_bidirectional_skip"))


def shape_skipping_mask(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` (a Transformers mask function such as ``sdpa_mask``) that returns ``None`` for plain masks.

    Returns ``None`` where :func:`_no_mask_needed` holds, else ``original(*args, **kwargs)``: a
    ``(batch, 1, q_len, kv_len)`` boolean mask, or ``None`` where ``original`` skips it itself.
    """
    signature = inspect.signature(original)
    defaults = {name: p.default for name, p in signature.parameters.items() if p.default is not p.empty}

    @functools.wraps(original)
    def mask(*args: Any, **kwargs: Any) -> Any:
        if args:  # bind positional arguments to their names; Transformers passes keywords (binding: ~10 µs a call)
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            named = {**bound.arguments.pop("kwargs", {}), **bound.arguments}
        else:
            named = {**defaults, **kwargs}
        if _no_mask_needed(named):
            return None
        return original(*args, **kwargs)

    return mask
