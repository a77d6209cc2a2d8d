"""The functional entry point: ``quantpatch.attention``."""

from __future__ import annotations

import torch

from quantpatch.config import AttentionConfig, ModeConfig
from quantpatch.dispatch import (
    AttentionCall,
    attention_signature,
    check_policy,
    plan_attention,
    planned_attention,
    records_grad,
    run_on_device,
    select,
    speed_route,
)
from quantpatch.fallback import current_site, fall_back, note_implementation, note_sdpa_route
from quantpatch.modes import get_mode
from quantpatch.range_check import check_once, checked

LAYOUTS = ("BHSD", "BSHD")
# Bound at import: the Diffusers patcher swaps torch.nn.functional.scaled_dot_product_attention
# while a processor runs, and our own SDPA fallback must not re-enter it.
_TORCH_SDPA = torch.nn.functional.scaled_dot_product_attention
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_PLANNED_MODES = (str, ModeConfig, AttentionConfig)  # modes a call signature may hold (hashable)


def resolve_attention_config(mode: str | ModeConfig | AttentionConfig) -> AttentionConfig:
    """The attention numerics of a mode name, ``ModeConfig`` or ``AttentionConfig``."""
    return mode if isinstance(mode, AttentionConfig) else get_mode(mode).attention


def _validate(q, k, v, attn_mask, layout) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not valid; choose one of {list(LAYOUTS)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D ({layout}), got shape {tuple(t.shape)}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; supported: {[str(d) for d in FLOAT_DTYPES]}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v are on different devices: {q.device}, {k.device}, {v.device}")
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
        if attn_mask.dtype != torch.bool and attn_mask.dtype not in FLOAT_DTYPES:
            raise TypeError(f"attn_mask has dtype {attn_mask.dtype}; pass a bool mask (True = attend) or an "
                            "additive float mask (an integer 0/1 mask is ambiguous, as in torch SDPA)")
        if attn_mask.device != q.device:
            raise ValueError(f"attn_mask is on {attn_mask.device}, q on {q.device}")


def sdpa_attention(call: AttentionCall):
    """Full-precision attention through PyTorch SDPA (bottom-right causal, GQA), output ``(B, H, Nq, Dv)``."""
    from quantpatch.kernels.attention.attention_ref import attention_exact, causal_allowed, expand_kv

    q, k, v = call.q, call.k, call.v
    if call.return_lse:  # SDPA does not return the LSE: use the exact path in float32
        o, lse = attention_exact(
            q, k, v, is_causal=call.is_causal, scale=call.scale, attn_mask=call.attn_mask,
            return_lse=True, dtype=torch.float32,
        )
        return o.to(q.dtype), lse
    h, nq, nk = q.shape[1], q.shape[-2], k.shape[-2]
    mask = call.attn_mask
    if call.is_causal and mask is None and nq == nk:  # square: SDPA's top-left is_causal is ours (flash / cuDNN)
        return _TORCH_SDPA(q, k, v, scale=call.scale, is_causal=True, **_gqa(h, k))
    if call.is_causal and nq > 1:  # SDPA's own is_causal is top-left aligned; ours is bottom-right
        causal = causal_allowed(nq, nk, 0, nk, q.device)
        if mask is None:
            mask = causal
        elif mask.dtype == torch.bool:
            mask = mask & causal
        else:
            mask = mask.masked_fill(~causal, float("-inf"))
    if mask is None:
        return _TORCH_SDPA(q, k, v, scale=call.scale, **_gqa(h, k))
    return _TORCH_SDPA(q, expand_kv(k, h), expand_kv(v, h), attn_mask=mask, scale=call.scale)


def _gqa(h: int, k: torch.Tensor) -> dict:
    return {"enable_gqa": True} if k.shape[1] != h else {}


def _planned_call(q, k, v, mode, is_causal, scale, layout, policy) -> tuple[tuple | None, torch.Tensor | None]:
    """A call with no mask and no LSE: its signature (``dispatch.attention_signature`` of the BHSD views) where it
    may be planned (eager, plain 4-D tensors, a mode and scale that hash by value), and its output where that
    signature's plan is kept, the call's site (or config) checked already (``range_check.check_once``) and, on CUDA,
    its device the current one: the plan's launches, the call counted on its site, nothing else of :func:`attention`
    run."""
    if not (type(q) is type(k) is type(v) is torch.Tensor and q.dim() == k.dim() == v.dim() == 4
            and layout in LAYOUTS and isinstance(mode, _PLANNED_MODES)
            and (scale is None or type(scale) in (float, int)) and not torch.compiler.is_compiling()):
        return None, None
    if records_grad(q, k, v):  # a plan runs kernels, which have no backward: the whole path routes the call
        return None, None
    if layout == "BSHD":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    signature = attention_signature(q, k, v, mode, is_causal, scale, policy)
    planned = planned_attention(signature)
    if planned is None:
        return signature, None
    name, cfg, plan = planned
    site = current_site()
    if not checked(site, cfg) or (q.is_cuda and q.device.index != torch.cuda.current_device()):
        return signature, None
    o = plan(q, k, v)[0]
    if site is not None:
        site.count(name)
    return signature, o.transpose(1, 2) if layout == "BSHD" else o


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mode: str | ModeConfig | AttentionConfig,
    is_causal: bool = False,
    scale: float | None = None,
    layout: str = "BHSD",
    attn_mask: torch.Tensor | None = None,
    return_lse: bool = False,
    strict: bool = False,
    policy: str = "always",
):
    """Quantized scaled-dot-product attention.

    Args:
        q: ``(B, H, Nq, D)`` for ``layout="BHSD"`` (Transformers), ``(B, Nq, H, D)`` for ``"BSHD"`` (Diffusers).
        k, v: ``(B, Hkv, Nk, D)`` / ``(B, Hkv, Nk, Dv)`` in the same layout; ``H % Hkv == 0`` (GQA).
        mode: a mode name (``"sage2-8b"``, ...), a ``ModeConfig`` or an ``AttentionConfig``.
        is_causal: causal mask, bottom-right aligned when ``Nq < Nk`` (a query chunk after a cache).
        scale: softmax scale (default ``1/sqrt(D)``).
        attn_mask: bool (True = attend) or additive float mask broadcastable to ``(B, H, Nq, Nk)``.
        return_lse: also return the log-sum-exp ``(B, H, Nq)`` in float32 (natural log).
        strict: raise :class:`~quantpatch.fallback.UnsupportedError` instead of falling back to SDPA.
        policy: ``"always"`` runs the mode's numerics; ``"speed"`` runs them only where this GPU's
            crossover table (:mod:`quantpatch.routing`) says they beat SDPA, else SDPA (exact, faster).

    Returns:
        ``o`` in ``q``'s dtype and layout (and ``lse`` if asked). Inputs a quantized path cannot
        take (head dims outside [32, 256], ...) run through SDPA after one warning.
    """
    signature = None
    if attn_mask is None and not return_lse:
        signature, o = _planned_call(q, k, v, mode, is_causal, scale, layout, policy)
        if o is not None:
            return o
    _validate(q, k, v, attn_mask, layout)
    if layout == "BSHD":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    b, h, nq, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"batch sizes differ: q {b}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} disagree on heads or length")
    if k.shape[1] == 0 or h % k.shape[1]:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({k.shape[1]})")
    if k.shape[-1] != d:
        raise ValueError(f"q head_dim {d} != k head_dim {k.shape[-1]}")
    nk = k.shape[2]
    if attn_mask is not None:
        try:
            full = torch.broadcast_shapes(attn_mask.shape, (b, h, nq, nk))
        except RuntimeError as err:
            raise ValueError(f"attn_mask {tuple(attn_mask.shape)} does not broadcast to {(b, h, nq, nk)}") from err
        if full != (b, h, nq, nk):
            raise ValueError(f"attn_mask {tuple(attn_mask.shape)} broadcasts to {tuple(full)}, not {(b, h, nq, nk)}")
        # a view: the paths slice query/key blocks of the mask, so its last two dims must be real
        attn_mask = attn_mask.expand(*attn_mask.shape[:-2], nq, nk)
    cfg = resolve_attention_config(mode)
    check_policy(policy)
    call = AttentionCall(q, k, v, cfg, is_causal, scale, attn_mask, return_lse)

    if q.numel() == 0 or nk == 0:  # nothing to attend: zeros (and lse = -inf), like an all-masked row
        result = (q.new_zeros(b, h, nq, v.shape[-1]), q.new_full((b, h, nq), float("-inf"), dtype=torch.float32))
    elif not cfg.quantized:
        result = sdpa_attention(call)
    else:
        if policy == "speed":
            impl, declined, why = speed_route(call)
        else:
            (impl, declined), why = select("attention", cfg.numerics, call), None
        if why is not None:
            note_sdpa_route(None, why)
            result = sdpa_attention(call)
        elif impl is None:
            fall_back(f"quantpatch.attention(numerics={cfg.numerics!r})", "; ".join(declined), strict=strict)
            result = sdpa_attention(call)
        else:
            note_implementation(impl.name)
            check_once(current_site(), q, k, v, cfg, is_causal=is_causal, scale=scale)
            result = run_on_device(impl, call)
            if signature is not None and not declined:
                plan_attention(signature, impl, call)
    o, lse = result if isinstance(result, tuple) else (result, None)
    o = o.to(q.dtype)
    if layout == "BSHD":
        o = o.transpose(1, 2)
    return (o, lse.to(torch.float32)) if return_lse else o
