"""``convert``: fold calibrated smoothing scales into a model's weights and swap in quantized linears.

FireQ (Baek et al. 2025), per decoder block, in this order:

1. **CAS** (Definition 3.1, eq. 6-7): for a weight ``W (O, K)`` and its input channel ``i``,
   ``λᵢ = ω̄ / absmean(W[:, i])`` with ``ω̄`` the mean of the channel absmeans; ``W ← W Λ`` and
   ``Λ⁻¹`` goes into whatever produces the input, so the float function is unchanged:

   - q/k/v read one RMSNorm output: one ``Λ`` from the absmeans of ``[W_q; W_k; W_v]``'s
     columns, ``Λ⁻¹`` into ``input_layernorm.weight``;
   - gate/up likewise with ``post_attention_layernorm.weight``;
   - down_proj: ``Λ⁻¹`` into up_proj's rows (``down(act(gate) ⊙ up)`` is linear in ``up``);
   - o_proj: ``Λ⁻¹`` into v_proj's rows. Under GQA a v_proj row feeds the o_proj columns of
     all query heads of its group, so ``λ`` is computed per (KV head, channel) from the
     absmeans pooled over the group's columns and repeated for each query head.

   Sites are chosen with :attr:`FireQOptions.cas_sites` (FireQ sets one of its Λ to a constant
   "for quantization stability" without saying which; leaving a site out is that constant).
2. **RPN** (§3.2.1 Stage 1, Thm. 3.1): for each KV head and each RoPE pair ``(i, i + D/2)``
   that is not a CRS outlier pair, ``s = α · max_n ‖(k_i, k_{i+D/2})‖₂`` over the pre-RoPE
   calibration keys; k_proj rows (and bias) ``/ s``, the q_proj rows of every query head of
   the group ``· s``. Both channels of a pair share ``s``, so it commutes with RoPE and
   ``q·k`` is unchanged.
3. **CRS** (§3.2.1 Stage 2): the ``crs_pairs`` (8) pairs with the largest post-RoPE channel
   absmax per KV head; each of their channels gets ``t = β · max_n |k_c|``, applied online
   after RoPE (``q · t``, ``k / t``, :func:`~quantpatch.crs.apply_online_crs`). Stored as buffers on the
   attention module (:mod:`quantpatch.crs`: ``CRS_FACTORS`` ``(Hkv, D)`` float32, ``CRS_PAIRS`` ``(Hkv, P)`` int64).
4. **PTS + quantization**: every selected decoder linear becomes a
   :class:`~quantpatch.w4a8_linear.W4A8Linear`; PTS (Definition 3.2) is chosen per weight
   after CAS/RPN. The LM head and embeddings are never touched.

Steps 1-3 keep the float function (up to float rounding; tests assert it). ``convert`` works
in place and is not undone by a handle: like ``torchao.quantize_``, it is an offline
transformation whose result is saved with :func:`quantpatch.checkpoint.save`.

Dispatch mirrors calibration: :data:`CONVERTERS` by :func:`~quantpatch.calibration.calibration_key`.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from quantpatch.calibration import CalibrationStats, LayerSites, architecture_hash, calibration_key, decoder_layers
from quantpatch.config import ModeConfig
from quantpatch.crs import CRS_FACTORS, CRS_PAIRS, add_crs_buffers, apply_online_crs
from quantpatch.kernels.fireq_kv.fireq_ref import crs_factors, select_crs_pairs
from quantpatch.modes import get_mode
from quantpatch.w4a8_linear import W4A8Linear

logger = logging.getLogger("quantpatch")

STATE_ATTR = "_quantpatch_state"
CAS_SITES = ("qkv", "o", "gate_up", "down")


@dataclass(frozen=True)
class FireQOptions:
    """Convert-time choices the mode config does not hold (stored in the checkpoint).

    Attributes:
        rpn: apply RoPE-preserving normalization to the non-outlier pairs.
        rpn_alpha: α of Thm. 3.1 (FireQ App. E uses 8). Per-token INT4 is scale invariant but
            its e4m3 token scale is not: ``α = 8`` bounds every key by 1/8, so every token's
            σ = absmax/7 ≤ 1/56 lies in e4m3's subnormals (< 2⁻⁶, steps of 2⁻⁹) and loses
            precision. The default ``α = 1`` keeps σ ≤ 1/7 in the normal range (measured on
            pydoc-llama-21m, 16k tokens: INT4 KV + RPN perplexity +2.34 % at α = 1 vs +3.06 % at
            α = 8; eval/results/fireq_ablation/summary.md).
        crs_beta: β of CRS (FireQ: 8), default 1 for the same reason.
        cas_sites: which CAS merges to apply (subset of ``("qkv", "o", "gate_up", "down")``)
            when the mode's ``linear.cas`` is on.
        weight_operand: ``"group"`` or ``"lut"`` (:mod:`quantpatch.kernels.w4a8.w4a8_ref`).
    """

    rpn: bool = True
    rpn_alpha: float = 1.0
    crs_beta: float = 1.0
    cas_sites: tuple[str, ...] = CAS_SITES
    weight_operand: str = "group"

    def __post_init__(self) -> None:
        object.__setattr__(self, "cas_sites", tuple(self.cas_sites))
        unknown = set(self.cas_sites) - set(CAS_SITES)
        if unknown:
            raise ValueError(f"FireQOptions.cas_sites has unknown {sorted(unknown)}; valid: {list(CAS_SITES)}")
        if self.rpn_alpha <= 0 or self.crs_beta <= 0:
            raise ValueError("FireQOptions.rpn_alpha and crs_beta must be positive")
        if self.weight_operand not in ("group", "lut"):
            raise ValueError(f"FireQOptions.weight_operand={self.weight_operand!r}; choose 'group' or 'lut'")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["cas_sites"] = list(self.cas_sites)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FireQOptions:
        valid = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - valid
        if unknown:
            raise ValueError(f"unknown FireQOptions field(s) {sorted(unknown)}; valid: {sorted(valid)}")
        return cls(**data)


@dataclass
class ConvertState:
    """What ``convert`` did, kept on the model (``model._quantpatch_state``) for ``save``.

    ``linears``: FQN → ``in_features``, ``out_features``, ``bias``, ``bias_dtype``,
    ``group_size``, ``weight_operand``, ``pts_exp``, ``zero_scale_groups`` (groups whose e4m3
    scale underflowed to 0). ``attention``: FQN → ``num_heads``, ``num_kv_heads``, ``head_dim``,
    ``crs_pairs`` (list per KV head), ``kv`` (``"int4_token"`` or ``"none"``).
    """

    mode: ModeConfig
    options: FireQOptions
    quantized: bool
    linears: dict[str, dict[str, Any]] = field(default_factory=dict)
    attention: dict[str, dict[str, Any]] = field(default_factory=dict)
    stats: CalibrationStats | None = None
    base: dict[str, Any] = field(default_factory=dict)

    def report(self) -> str:
        lines = [f"quantpatch convert ({self.mode.name}): {len(self.linears)} W4A8 linears, "
                 f"{len(self.attention)} attention sites, options {self.options.to_dict()}"]
        for name, info in self.linears.items():
            lines.append(f"  linear    {name}: {info['out_features']}x{info['in_features']} pts 2^{info['pts_exp']}, "
                         f"{info['zero_scale_groups']} zero-scale groups")
        for name, info in self.attention.items():
            lines.append(f"  attention {name}: KV {info['kv']}, CRS pairs {info['crs_pairs']}")
        return "\n".join(lines)


# --------------------------------------------------------------------------- merging helpers


def _absmean_columns(*linears: nn.Linear) -> torch.Tensor:
    """Per-input-channel ``mean |w|`` over the stacked rows of ``linears`` (float64, ``(K,)``)."""
    return torch.cat([lin.weight.detach().double().abs() for lin in linears], dim=0).mean(dim=0)


def cas_lambda(absmean: torch.Tensor) -> torch.Tensor:
    """FireQ eq. 6: ``λᵢ = ω̄ / absmean_i`` with ``ω̄`` the mean absmean; channels with absmean 0 get 1."""
    target = absmean[absmean > 0].mean() if (absmean > 0).any() else absmean.new_ones(())
    return torch.where(absmean > 0, target / absmean, torch.ones_like(absmean))


@torch.no_grad()
def _scale_columns(lin: nn.Linear, lam: torch.Tensor) -> None:
    lin.weight.copy_((lin.weight.double() * lam.to(lin.weight.device)).to(lin.weight.dtype))


@torch.no_grad()
def _scale_rows(lin: nn.Linear, s: torch.Tensor) -> None:
    s = s.to(lin.weight.device)
    lin.weight.copy_((lin.weight.double() * s[:, None]).to(lin.weight.dtype))
    if lin.bias is not None:
        lin.bias.copy_((lin.bias.double() * s).to(lin.bias.dtype))


@torch.no_grad()
def _scale_norm(norm: nn.Module, s: torch.Tensor) -> None:
    w = getattr(norm, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 1:
        raise ValueError(f"{type(norm).__name__} has no 1-D weight to merge CAS into")
    w.copy_((w.double() * s.to(w.device)).to(w.dtype))
    b = getattr(norm, "bias", None)
    if isinstance(b, torch.Tensor):
        b.copy_((b.double() * s.to(b.device)).to(b.dtype))


def _head_of_query(site: LayerSites) -> torch.Tensor:
    """KV head of each query head (Transformers' ``repeat_kv``: query head ``h`` reads ``h // G``)."""
    return torch.arange(site.num_heads) // (site.num_heads // site.num_kv_heads)


def merge_cas(site: LayerSites, modules: dict[str, nn.Module], sites: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Merge CAS into one decoder block (module docstring); returns the ``λ`` applied per site."""
    m = modules
    applied = {}
    if "qkv" in sites:
        lam = cas_lambda(_absmean_columns(m[site.q], m[site.k], m[site.v]))
        for name in (site.q, site.k, site.v):
            _scale_columns(m[name], lam)
        _scale_norm(m[site.input_norm], 1 / lam)
        applied["qkv"] = lam
    if "gate_up" in sites:
        lam = cas_lambda(_absmean_columns(m[site.gate], m[site.up]))
        for name in (site.gate, site.up):
            _scale_columns(m[name], lam)
        _scale_norm(m[site.post_norm], 1 / lam)
        applied["gate_up"] = lam
    if "down" in sites:
        lam = cas_lambda(_absmean_columns(m[site.down]))
        _scale_columns(m[site.down], lam)
        _scale_rows(m[site.up], 1 / lam)
        applied["down"] = lam
    if "o" in sites:
        o = m[site.o].weight.detach().double().abs()
        group = site.num_heads // site.num_kv_heads
        pooled = o.reshape(o.shape[0], site.num_kv_heads, group, site.head_dim).mean(dim=(0, 2))  # (Hkv, D)
        lam_kv = cas_lambda(pooled.flatten()).reshape(site.num_kv_heads, site.head_dim)
        _scale_columns(m[site.o], lam_kv[_head_of_query(site)].flatten())
        _scale_rows(m[site.v], 1 / lam_kv.flatten())
        applied["o"] = lam_kv
    return applied


def rpn_scales(pair_norm_max: torch.Tensor, alpha: float, skip_pairs: torch.Tensor | None = None) -> torch.Tensor:
    """RPN factors ``(Hkv, D)``: ``s = α · max ‖pair‖`` for each pair, 1 for ``skip_pairs`` (CRS) and zero pairs."""
    s = alpha * pair_norm_max.double()
    s = torch.where(s > 0, s, torch.ones_like(s))
    if skip_pairs is not None and skip_pairs.numel():
        s = s.scatter(-1, skip_pairs.to(s.device), 1.0)
    return torch.cat((s, s), dim=-1)


def merge_rpn(site: LayerSites, modules: dict[str, nn.Module], s: torch.Tensor) -> None:
    """``k_proj`` rows ``/ s``, the q_proj rows of each query head ``· s`` of its KV head (``s (Hkv, D)``)."""
    _scale_rows(modules[site.k], 1 / s.flatten())
    _scale_rows(modules[site.q], s[_head_of_query(site)].flatten())


# --------------------------------------------------------------------------- online attention side


def fireq_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    crs: torch.Tensor | None = None,
    *,
    kv_int4: bool = True,
    fp8: bool = True,
    kv_operand: str = "fp8",
    is_causal: bool = False,
    scale: float | None = None,
    attn_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """FireQ attention of a query chunk whose K/V go through the INT4 cache: CRS, INT4 K/V, FP8 Q and P.

    ``q (B, H, Nq, D)``, ``k``/``v`` ``(B, Hkv, Nk, D)`` post-RoPE; ``crs (Hkv, D)`` factors or
    None. ``kv_int4``: K and V are quantized to INT4 per token (e4m3 scales) and attended as
    FireQ's decode does (:func:`~quantpatch.kernels.fireq_kv.fireq_ref.fireq_decode_attention_ref`: Q FP8
    per token, P̃ FP8); used for every query, this is the cache a prefill writes, attended by
    all positions (how perplexity sees KV quantization: FireQ's own prefill reads FP8 K/V, App. D,
    yet its WikiText-2 ablation, Table 3, moves with RPN/CRS, so its perplexity attends to INT4
    K/V). Without ``kv_int4``, ``fp8`` runs the
    ``fireq`` FP8 prefill attention, and neither gives float attention. ``kv_operand``: ``"fp8"``
    (FireQ's e4m3 look-up table ``e4m3(x̂ σ)``) or ``"exact"`` (``x̂ σ`` unrounded, as a kernel that
    applies the K scale after the dot would). Returns ``(B, H, Nq, D)`` in ``q``'s dtype.
    """
    q, k = apply_online_crs(q, k, crs)
    if kv_int4:
        from quantpatch.kernels.fireq_kv.fireq_ref import fireq_decode_attention_ref

        out = fireq_decode_attention_ref(q, k, v, is_causal=is_causal, scale=scale, attn_mask=attn_mask,
                                         kv_operand=kv_operand)
    else:
        from quantpatch.api import attention

        out = attention(q, k, v, mode="fireq" if fp8 else "off", is_causal=is_causal, scale=scale,
                        attn_mask=attn_mask)
    return out.to(q.dtype)


# --------------------------------------------------------------------------- convert


def _selected(name: str, include, exclude) -> bool:
    if include and not any(s in name for s in include):
        return False
    return not (exclude and any(s in name for s in exclude))


def _set_module(model: nn.Module, fqn: str, new: nn.Module) -> None:
    parent, _, child = fqn.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def _convert_fireq(model: nn.Module, stats: CalibrationStats | None, config: ModeConfig, *, quantize: bool,
                   options: FireQOptions, include, exclude, progress: bool) -> ConvertState:
    from tqdm.auto import tqdm

    layers = decoder_layers(model)
    modules = dict(model.named_modules())
    lin_cfg, kv_cfg = config.linear, config.kv_cache
    use_kv = kv_cfg.kind == "fireq"
    state = ConvertState(config, options, quantized=quantize and lin_cfg.kind == "w4a8_fp8", stats=stats)
    if use_kv and stats is None:
        raise ValueError(f"mode {config.name!r} needs calibration statistics for RPN/CRS; run calibrate() first")
    include = include if include is not None else (list(lin_cfg.include) or None)
    for site in tqdm(layers, desc="converting (fireq)", disable=not progress):
        if lin_cfg.kind == "w4a8_fp8" and lin_cfg.cas:
            merge_cas(site, modules, options.cas_sites)
        if use_kv:
            pairs = torch.zeros(site.num_kv_heads, 0, dtype=torch.long)
            k_absmax = stats.get(site.attn, "k_absmax")
            if kv_cfg.crs_pairs:
                pairs = select_crs_pairs(k_absmax, kv_cfg.crs_pairs)
            if options.rpn:
                merge_rpn(site, modules, rpn_scales(stats.get(site.attn, "k_pair_norm_max"), options.rpn_alpha, pairs))
            attn = modules[site.attn]
            device = modules[site.k].weight.device
            add_crs_buffers(attn, site.num_kv_heads, site.head_dim, pairs.shape[1], device)
            if pairs.numel():
                getattr(attn, CRS_FACTORS).copy_(crs_factors(k_absmax.float(), pairs, options.crs_beta))
                getattr(attn, CRS_PAIRS).copy_(pairs)
            state.attention[site.attn] = {
                "num_heads": site.num_heads, "num_kv_heads": site.num_kv_heads, "head_dim": site.head_dim,
                "crs_pairs": pairs.tolist(), "kv": "int4_token",
            }
        if not state.quantized:
            continue
        for name in site.linears:
            if not _selected(name, include, exclude):
                continue
            lin = modules[name]
            if not isinstance(lin, nn.Linear):
                raise TypeError(f"{name} is a {type(lin).__name__}, not an nn.Linear (converted twice?)")
            q = W4A8Linear.from_linear(lin, group_size=lin_cfg.group_size, pts=lin_cfg.pts,
                                       weight_operand=options.weight_operand)
            _set_module(model, name, q)
            state.linears[name] = {
                "in_features": q.in_features, "out_features": q.out_features, "bias": q.bias is not None,
                "bias_dtype": str(q.bias.dtype).removeprefix("torch.") if q.bias is not None else None,
                "group_size": q.group_size, "weight_operand": q.weight_operand, "pts_exp": int(q.pts_exp),
                "zero_scale_groups": int((q.scales.float() == 0).sum()),
            }
    return state


Converter = Callable[..., ConvertState]
CONVERTERS: dict[str, Converter | str] = {
    "fireq": _convert_fireq,
    "turbo": "quantpatch.calibration_turbo:convert_turbo",
}


def register_converter(key: str, fn: Converter | str) -> None:
    """Add (or replace) the converter for modes whose calibration key is ``key``."""
    CONVERTERS[key] = fn


def convert(
    model: nn.Module,
    stats: CalibrationStats | None,
    mode: str | ModeConfig = "fireq",
    *,
    quantize: bool = True,
    options: FireQOptions | dict | None = None,
    include: list[str] | None = None,
    exclude: list[str] | None = None,
    progress: bool = True,
) -> ConvertState:
    """Merge the mode's smoothing into ``model``'s weights (in place) and quantize its linears.

    Args:
        model: a Transformers causal LM of a family in ``calibration.LAYOUTS``, not yet converted.
        stats: from :func:`quantpatch.calibrate` on the same (unconverted) model; may be None
            for a linear-only mode (CAS and PTS need only the weights).
        mode: mode name or ``ModeConfig``; its ``linear`` part says whether to quantize linears
            and whether CAS/PTS are on, its ``kv_cache`` part whether to merge RPN and set up CRS
            (``crs_pairs = 0`` turns CRS off).
        quantize: False merges CAS/RPN and sets CRS buffers but keeps ``nn.Linear`` (the float
            model then computes the original function).
        options: :class:`FireQOptions` (or a dict of its fields).
        include / exclude: FQN substrings selecting decoder linears (default: the mode's
            ``linear.include``, else all q/k/v/o/gate/up/down); the LM head is never converted.

    Returns:
        The :class:`ConvertState`, also stored as ``model._quantpatch_state``.
    """
    config = get_mode(mode)
    if getattr(model, STATE_ATTR, None) is not None:
        raise ValueError("this model is already converted by quantpatch; load the original weights to convert again")
    if stats is not None and stats.meta.get("arch_hash") not in (None, architecture_hash(model.config)):
        raise ValueError("calibration statistics were collected on a different model architecture")
    if isinstance(options, dict):
        options = FireQOptions.from_dict(options)
    options = options or FireQOptions()
    key = calibration_key(config)
    fn = CONVERTERS.get(key)
    if fn is None:
        raise ValueError(f"no converter for {key!r}; registered: {sorted(CONVERTERS)}")
    if isinstance(fn, str):
        module, _, attr = fn.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"converter {key!r} ({CONVERTERS[key]}) is not available: {err}") from err
    state = fn(model, stats, config, quantize=quantize, options=options, include=include, exclude=exclude,
               progress=progress)
    state.base = {
        "model_type": getattr(model.config, "model_type", None),
        "arch_hash": architecture_hash(model.config),
        "name_or_path": getattr(model.config, "_name_or_path", "") or getattr(model, "name_or_path", ""),
    }
    setattr(model, STATE_ATTR, state)
    logger.info("%s", state.report().splitlines()[0])
    return state
