"""FireQ (Baek et al. 2025): its calibration statistics, its conversion and its checkpoint records.

Calibration (:func:`calibrate_fireq`, keys ``"<module FQN>:<stat>"`` in
:attr:`~quantpatch.calibration.CalibrationStats.tensors`, float32):

* every decoder linear's input ``x (…, K)``: ``act_absmax (K,)`` = ``max |x_c|`` and
  ``act_absmean (K,)`` = mean ``|x_c|`` over all calibration tokens;
* every attention module: ``k_pair_norm_max (Hkv, D/2)`` = ``max_n ‖(k_i, k_{i+D/2})‖₂`` of the
  pre-RoPE keys (RPN, FireQ Thm. 3.1), ``k_absmax (Hkv, D)`` = post-RoPE ``max_n |k_c|`` (CRS
  pair choice and factors, §3.2.1), ``v_absmax (Hkv, D)`` (diagnostics).

Conversion (:func:`convert_fireq`), per decoder block, in this order:

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

Steps 1-3 keep the float function (up to float rounding; tests assert it).

Checkpoint: each attention site's record (``kv = "int4_token"``) lists its CRS pairs per KV head; loading
registers the CRS buffers for ``load_state_dict`` to fill (:func:`add_site`). The W4A8 linears' records are
:class:`~quantpatch.w4a8_linear.W4A8Linear`'s, rebuilt by :mod:`quantpatch.checkpoint`. What the patched
attention reads at run time (the CRS buffers, applied online) is :mod:`quantpatch.crs`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from quantpatch.calibration import CalibrationStats, LayerSites, decoder_layers, hooked
from quantpatch.config import ModeConfig
from quantpatch.conversion import ConvertState, FireQOptions
from quantpatch.crs import CRS_FACTORS, CRS_PAIRS, add_crs_buffers, apply_online_crs
from quantpatch.fallback import UnsupportedError
from quantpatch.kernels.fireq_kv.fireq_ref import crs_factors, select_crs_pairs
from quantpatch.methods import Method
from quantpatch.patches import selected
from quantpatch.w4a8_linear import W4A8Linear

logger = logging.getLogger("quantpatch")


# --------------------------------------------------------------------------- calibration


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Max:
    """Running element-wise max of float32 tensors."""

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None

    def update(self, x: torch.Tensor) -> None:
        x = x.detach().float()
        self.value = x if self.value is None else torch.maximum(self.value, x)


def calibrate_fireq(model: nn.Module, samples: list[torch.Tensor], config: ModeConfig, progress: bool
                      ) -> CalibrationStats:
    """The ``"fireq"`` calibrator of :func:`quantpatch.calibrate`: the statistics of the module docstring for
    every decoder block of ``model``."""
    from tqdm.auto import tqdm

    layers = decoder_layers(model)
    modules = dict(model.named_modules())
    act_max: dict[str, _Max] = {}
    act_sum: dict[str, torch.Tensor] = {}
    act_count: dict[str, int] = {}
    k_pair, k_abs, v_abs = ({s.attn: _Max() for s in layers} for _ in range(3))
    rope: dict[str, tuple[torch.Tensor, torch.Tensor] | None] = {}

    def linear_hook(name: str):
        def hook(module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).abs()
            act_max.setdefault(name, _Max()).update(x.amax(0))
            act_sum[name] = act_sum.get(name, 0) + x.sum(0, dtype=torch.float64)
            act_count[name] = act_count.get(name, 0) + x.shape[0]
        return hook

    def attn_pre_hook(site: LayerSites):
        def hook(module, args, kwargs):
            pe = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
            rope[site.attn] = pe
        return hook

    def kv_hook(site: LayerSites, which: str):
        def hook(module, args, out):
            b, n = out.shape[0], out.shape[1]
            x = out.detach().float().view(b, n, site.num_kv_heads, site.head_dim).transpose(1, 2)  # (B, Hkv, N, D)
            if which == "v":
                v_abs[site.attn].update(x.abs().amax(dim=(0, 2)))
                return
            half = site.head_dim // 2
            k_pair[site.attn].update(torch.sqrt(x[..., :half] ** 2 + x[..., half:] ** 2).amax(dim=(0, 2)))
            pe = rope.get(site.attn)
            if pe is None:
                raise UnsupportedError(f"{site.attn} was called without position_embeddings; cannot form post-RoPE K")
            cos, sin = (t.detach().float().unsqueeze(1) for t in pe)
            k_rot = x * cos + _rotate_half(x) * sin  # Llama's apply_rotary_pos_emb
            k_abs[site.attn].update(k_rot.abs().amax(dim=(0, 2)))
        return hook

    handles: list = []
    tokens = 0
    with hooked(handles), torch.no_grad():
        for site in layers:
            for name in site.linears:
                handles.append(modules[name].register_forward_pre_hook(linear_hook(name)))
            handles.append(modules[site.attn].register_forward_pre_hook(attn_pre_hook(site), with_kwargs=True))
            handles.append(modules[site.k].register_forward_hook(kv_hook(site, "k")))
            handles.append(modules[site.v].register_forward_hook(kv_hook(site, "v")))
        device = next(model.parameters()).device
        for ids in tqdm(samples, desc="calibrating (fireq)", disable=not progress):
            model(ids.to(device), use_cache=False)
            tokens += ids.numel()
    tensors: dict[str, torch.Tensor] = {}
    for name in act_max:
        tensors[f"{name}:act_absmax"] = act_max[name].value.cpu()
        tensors[f"{name}:act_absmean"] = (act_sum[name] / act_count[name]).float().cpu()
    for site in layers:
        tensors[f"{site.attn}:k_pair_norm_max"] = k_pair[site.attn].value.cpu()
        tensors[f"{site.attn}:k_absmax"] = k_abs[site.attn].value.cpu()
        tensors[f"{site.attn}:v_absmax"] = v_abs[site.attn].value.cpu()
    return CalibrationStats(tensors, {"tokens": tokens})


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


def _set_module(model: nn.Module, fqn: str, new: nn.Module) -> None:
    parent, _, child = fqn.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def convert_fireq(model: nn.Module, stats: CalibrationStats | None, config: ModeConfig, *, quantize: bool,
                   options: FireQOptions, include, exclude, progress: bool) -> ConvertState:
    """The ``"fireq"`` converter of :func:`quantpatch.convert`: steps 1-4 of the module docstring, per block."""
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
            if not selected(name, include, exclude):
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
    if state.quantized and not state.linears:
        logger.warning("convert: include=%r / exclude=%r select none of the decoder linears (e.g. %r): no linear "
                       "was quantized", include, exclude, layers[0].linears[0] if layers else None)
    return state


# --------------------------------------------------------------------------- checkpoint records


def crs_pairs_per_head(site: dict[str, Any]) -> int:
    """CRS pairs per KV head of one site record: one row of pairs per KV head (rows of length 0 with CRS off)."""
    pairs = site.get("crs_pairs") or []
    return len(pairs[0]) if pairs else 0


def add_site(module: nn.Module, site: dict[str, Any]) -> None:
    """The load hook: empty CRS buffers (on meta) of the shape the site record gives, for ``load_state_dict``."""
    add_crs_buffers(module, site["num_kv_heads"], site["head_dim"], crs_pairs_per_head(site), device="meta")


def summarize(sites: list[dict[str, Any]]) -> dict[str, Any]:
    """``checkpoint.info``'s FireQ field: ``crs_pairs_per_head`` (0 without FireQ sites)."""
    return {"crs_pairs_per_head": max((crs_pairs_per_head(site) for site in sites), default=0)}


METHOD = Method(key="fireq", site_kinds=("int4_token", "none"), calibrate=calibrate_fireq, convert=convert_fireq,
                add_site=add_site, summarize=summarize)
