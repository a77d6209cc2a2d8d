"""Warn when a mode's numerics cannot represent a site's inputs (accuracy collapse), once per site.

A few large key channels stretch a per-token or per-block scale until the ordinary channels round
to a handful of levels: without smoothing, one K channel at 100 leaves INT8 per-token keys
(int8-flash) at CosSim ≈ 0.98, and at 1e4 most modes fall below 0.9. The check runs the mode's
reference on a small sample of the first quantized call of each site (the last
:data:`SAMPLE_QUERIES` queries against the last :data:`SAMPLE_KEYS` keys of :data:`SAMPLE_HEADS`
heads of the first batch entry, so causal alignment is kept) and compares it with float32
attention on the same sample; below the mode's floor it warns with the CosSim and a mode that
copes. It costs one small reference call per site (a few milliseconds on a GPU), never runs while
``torch.compile`` traces or a CUDA graph captures, and changes no result.
"""

from __future__ import annotations

import warnings

import torch

from quantpatch.config import AttentionConfig
from quantpatch.fallback import SiteRecord, logger

SAMPLE_QUERIES, SAMPLE_KEYS, SAMPLE_HEADS = 64, 512, 4
# CosSim on the sample below which a mode has collapsed: well under what each keeps on N(0, 1) and channel-outlier
# inputs (tests/tolerances.py: ≥ 0.9995 for the 8-bit modes, 0.998 fireq, 0.975 sage2-4b's INT4 on randn)
COLLAPSE_FLOOR = {"sage2": 0.99, "int8_flash": 0.99, "turbo": 0.99, "fireq": 0.985}
INT4_COLLAPSE_FLOOR = 0.95


class QuantpatchAccuracyWarning(UserWarning):
    """A mode's numerics lose the attention result on these inputs; a better-suited mode is named."""


_checked_configs: dict[int, AttentionConfig] = {}  # calls outside a patched model: once per config object


def collapse_floor(cfg: AttentionConfig) -> float:
    return INT4_COLLAPSE_FLOOR if cfg.qk_format == "int4" else COLLAPSE_FLOOR[cfg.numerics]


def suggestion(cfg: AttentionConfig) -> str:
    """A mode that copes with large key channels: sage2-8b's smooth K removes channel biases; else full precision."""
    if cfg.numerics == "sage2" and cfg.qk_format == "int8" and cfg.smooth_k:
        return "mode 'off' (full precision) for this site"
    return "mode 'sage2-8b' (its smooth K removes key-channel bias) or 'off' for this site"


def sample_cos_sim(q, k, v, cfg: AttentionConfig, *, is_causal: bool, scale: float | None) -> float:
    """CosSim of ``cfg``'s reference against float32 attention on the sample (``(B, H, S, D)`` inputs)."""
    from quantpatch.kernels.attention.attention_ref import attention_exact
    from quantpatch.kernels.attention.quant_attention_ref import quant_attention_ref
    from quantpatch.metrics import cos_sim

    hkv = min(k.shape[1], SAMPLE_HEADS)
    rep = q.shape[1] // k.shape[1]
    qs = q[:1, : hkv * rep, -SAMPLE_QUERIES:].float()
    ks, vs = (t[:1, :hkv, -SAMPLE_KEYS:].float() for t in (k, v))
    if is_causal and qs.shape[2] > ks.shape[2]:  # keep bottom-right alignment: as many queries as keys at most
        qs = qs[:, :, -ks.shape[2]:]
    ref = attention_exact(qs, ks, vs, is_causal=is_causal, scale=scale, dtype=torch.float32)
    out = quant_attention_ref(qs, ks, vs, cfg, is_causal=is_causal, scale=scale)
    return cos_sim(out, ref)


def checked(site: SiteRecord | None, cfg: AttentionConfig) -> bool:
    """Whether :func:`check_once` has sampled ``site`` (``cfg``, for calls outside a patched model) already."""
    return site.range_checked if site is not None else _checked_configs.get(id(cfg)) is cfg


def check_once(site: SiteRecord | None, q, k, v, cfg: AttentionConfig, *, is_causal: bool,
               scale: float | None) -> None:
    """On the first quantized call of ``site`` (of ``cfg`` for calls outside a patched model), warn if the sample's
    CosSim is below :func:`collapse_floor`."""
    if torch.compiler.is_compiling() or (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        return  # no host sync inside a trace or a CUDA-graph capture
    if checked(site, cfg):
        return
    if site is not None:
        site.range_checked = True
    else:
        _checked_configs[id(cfg)] = cfg
    cos = sample_cos_sim(q, k, v, cfg, is_causal=is_causal, scale=scale)
    floor = collapse_floor(cfg)
    if cos < floor:
        where = site.name if site is not None else f"quantpatch.attention(numerics={cfg.numerics!r})"
        message = (f"{where}: the inputs are outside what {cfg.numerics} numerics represent (CosSim {cos:.4f} "
                   f"< {floor} against full precision on a sample: large key or query channels); use {suggestion(cfg)}")
        if site is not None:
            site.fallbacks.add(f"accuracy: CosSim {cos:.4f} on a sample")
        logger.warning(message)
        warnings.warn(message, QuantpatchAccuracyWarning, stacklevel=4)


def forget_checks() -> None:
    """Check every config again on its next call outside a patched model (tests)."""
    _checked_configs.clear()
