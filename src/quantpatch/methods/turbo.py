"""TurboAttention: KV-cache calibration (per-head bit widths, buffer scales), its conversion and checkpoint records.

TurboAttention §3.2 stores the ``n_h`` lowest-priority KV heads of every layer in 2 bits and the
rest in 4 bits, with (eq. 11)::

    priority^(h) = gap^(h) × std^(h)
    gap^(h)      = max − min over every value of head h      (post-RoPE K, or V)
    std^(h)      = standard deviation of the D channel gaps   (each max − min over the tokens)

Both need only the running max and min of every channel, so calibration streams the texts
through the model one at a time and keeps ``(layers, KV heads, D)`` extrema for K and for V
(:class:`KVChannelRange`).

Ranking: §3.2 ranks "all heads" of a layer and §5.6 selects "0 to 16 heads" of LLaMA-3-8B's 8 KV
heads, i.e. a pool of the layer's K heads and V heads. ``ranking="joint"`` (default) ranks that pool
of ``2·Hkv``; ``"separate"`` ranks K and V each on its own (``turbo_ref.head_bits``). On
pydoc-llama-21m with half the pool at 2 bits (SDPA over the dequantized cache, 2×512 tokens read
through the cache, perplexity vs the fp32 cache): joint +6.75 % (the pool's lowest priorities are the
V heads: K, post-RoPE, has the outlier channels), separate +7.99 %; random joint picks +7.4 to
+12.1 %, random separate picks +7.3 to +16.8 %; every K head at 2 bits +15.3 %.

The result, :class:`~quantpatch.head_precision.HeadPrecision`, is plain data (JSON round trip, versioned);
``quantpatch.TurboCache(model, head_bits=...)`` takes it. Two ways to get one:

* ``calibrate_head_precision(model, texts, tokenizer)``: texts in, :class:`HeadPrecision` out;
* the checkpoint pipeline: ``stats = quantpatch.calibrate(model, texts, "turbo", tokenizer=tok)``
  (:func:`calibrate_turbo`: channel extrema per attention module, ``"<FQN>:k_channel_max"`` ...),
  ``quantpatch.convert(model, stats, "turbo")`` (:func:`convert_turbo`: no weight changes; the
  per-head widths go into ``ConvertState.attention``), ``quantpatch.save`` writes them to
  ``quantpatch_config.json``, and ``patch_model(model, "turbo")`` on such a model makes
  ``generate()`` use them (:func:`~quantpatch.head_precision.head_precision_of`). A turbo site record
(``kv = "turbo"``) holds widths only: loading adds nothing to the model (:func:`add_site`).

Nothing here imports Transformers: the model is only called (``model(input_ids, use_cache=True)``)
and its returned cache read (``past_key_values.layers[i].keys`` / ``.values``: post-RoPE,
``(B, Hkv, N, D)``).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from quantpatch.calibration import CalibrationStats
from quantpatch.config import KVCacheConfig, ModeConfig
from quantpatch.conversion import ConvertState, FireQOptions
from quantpatch.head_precision import HeadPrecision, attention_modules, check_ranking, kv_config_of
from quantpatch.kernels.turbo_kv.turbo_ref import head_bits, select_two_bit_heads, two_bit_head_count
from quantpatch.methods import Method

logger = logging.getLogger("quantpatch")


def priority_from_channel_range(channel_max: torch.Tensor, channel_min: torch.Tensor) -> torch.Tensor:
    """Eq. 11 from per-channel extrema ``(..., Hkv, D)`` → ``(..., Hkv)``.

    Equal to ``turbo_ref.head_priority(x)`` when the extrema are taken over ``x``'s batch and tokens.
    """
    channel_gap = (channel_max - channel_min).to(torch.float32)
    gap = (channel_max.amax(dim=-1) - channel_min.amin(dim=-1)).to(torch.float32)
    return gap * channel_gap.std(dim=-1, correction=0)


@dataclass
class KVChannelRange:
    """Running per-channel max/min of the post-RoPE K and V of every layer and KV head.

    Attributes:
        k_max, k_min, v_max, v_min: float32 ``(L, Hkv, D)`` (±inf before the first update).
        tokens: tokens observed (summed over the batch).
    """

    k_max: torch.Tensor
    k_min: torch.Tensor
    v_max: torch.Tensor
    v_min: torch.Tensor
    tokens: int = 0

    @classmethod
    def empty(cls, num_layers: int, kv_heads: int, head_dim: int) -> KVChannelRange:
        def full(value: float) -> torch.Tensor:
            return torch.full((num_layers, kv_heads, head_dim), value, dtype=torch.float32)

        return cls(full(float("-inf")), full(float("inf")), full(float("-inf")), full(float("inf")))

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Fold one layer's ``k``, ``v`` ``(B, Hkv, N, D)`` into the extrema."""
        for x, hi, lo in ((k, self.k_max, self.k_min), (v, self.v_max, self.v_min)):
            if x.shape[1:2] + x.shape[3:] != hi.shape[1:]:
                raise ValueError(f"layer {layer}: K/V of shape {tuple(x.shape)} do not match (B, Hkv, N, D) = "
                                 f"(·, {hi.shape[1]}, ·, {hi.shape[2]})")
            xf = x.detach().to(torch.float32).cpu()
            hi[layer] = torch.maximum(hi[layer], xf.amax(dim=(0, 2)))
            lo[layer] = torch.minimum(lo[layer], xf.amin(dim=(0, 2)))

    def absmax(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_absmax, v_absmax)``: ``max |x|`` per layer and head, each float32 ``(L, Hkv)``."""
        return (torch.maximum(self.k_max.abs(), self.k_min.abs()).amax(dim=-1),
                torch.maximum(self.v_max.abs(), self.v_min.abs()).amax(dim=-1))

    def priorities(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_priority, v_priority)``, each float32 ``(L, Hkv)``."""
        if not torch.isfinite(self.k_max).all():
            raise ValueError("every layer needs at least one calibration token before priorities exist")
        return priority_from_channel_range(self.k_max, self.k_min), priority_from_channel_range(self.v_max, self.v_min)


def _widths(low: set[int], kv_heads: int, bits: int, low_bits: int) -> list[int]:
    return [low_bits if h in low else bits for h in range(kv_heads)]


def _joint_rows(low: set[int], kv_heads: int, bits: int, low_bits: int) -> tuple[list[int], list[int]]:
    """K and V widths from picks in the joint pool (``h`` < Hkv: K head ``h``; else V head ``h − Hkv``)."""
    return (_widths({i for i in low if i < kv_heads}, kv_heads, bits, low_bits),
            _widths({i - kv_heads for i in low if i >= kv_heads}, kv_heads, bits, low_bits))


def head_precision_from_priorities(
    k_priority: torch.Tensor,
    v_priority: torch.Tensor,
    n_h: int | float,
    *,
    ranking: str = "joint",
    bits: int = 4,
    low_bits: int = 2,
    tokens: int = 0,
    k_absmax: torch.Tensor | None = None,
    v_absmax: torch.Tensor | None = None,
) -> HeadPrecision:
    """Eq. 12 per layer: ``low_bits`` for the ``n_h`` lowest-priority heads, ``bits`` for the rest.

    ``ranking="joint"`` ranks a layer's ``Hkv`` K heads and ``Hkv`` V heads together and ``n_h`` counts
    in that pool of ``2·Hkv`` (TurboAttention §5.6 selects "0 to 16 heads" of LLaMA-3-8B's 8 KV heads);
    ``"separate"`` ranks K and V each on its own, ``n_h`` per tensor (``turbo_ref.head_bits``). A
    fraction puts the same share of the cache in ``low_bits`` either way.

    Args:
        k_priority / v_priority: ``(L, Hkv)``.
    """
    check_ranking(ranking)
    if k_priority.shape != v_priority.shape or k_priority.dim() != 2:
        raise ValueError(
            f"priorities must both be (L, Hkv), got {tuple(k_priority.shape)} and {tuple(v_priority.shape)}"
        )
    kv_heads = k_priority.shape[1]
    k_bits, v_bits = [], []
    for p_k, p_v in zip(k_priority, v_priority):
        if ranking == "joint":
            low = set(select_two_bit_heads(torch.cat([p_k, p_v]), n_h).tolist())
            k_row, v_row = _joint_rows(low, kv_heads, bits, low_bits)
        else:
            k_row = head_bits(p_k, n_h, bits=bits, low_bits=low_bits)
            v_row = head_bits(p_v, n_h, bits=bits, low_bits=low_bits)
        k_bits.append(k_row)
        v_bits.append(v_row)
    return HeadPrecision(
        k_bits,
        v_bits,
        k_priority.tolist(),
        v_priority.tolist(),
        k_absmax=() if k_absmax is None else k_absmax.tolist(),
        v_absmax=() if v_absmax is None else v_absmax.tolist(),
        n_h=n_h,
        ranking=ranking,
        tokens=tokens,
    )


def random_head_precision(
    num_layers: int,
    kv_heads: int,
    n_h: int | float,
    *,
    seed: int,
    ranking: str = "joint",
    bits: int = 4,
    low_bits: int = 2,
) -> HeadPrecision:
    """The ablation baseline: the same number of ``low_bits`` heads per layer as ``ranking`` picks, at random."""
    check_ranking(ranking)
    pool = 2 * kv_heads if ranking == "joint" else kv_heads
    count = two_bit_head_count(n_h, pool)
    gen = torch.Generator().manual_seed(seed)
    k_bits, v_bits = [], []
    for _ in range(num_layers):
        draws = 1 if ranking == "joint" else 2  # separate: one draw for K, one for V
        picks = [set(torch.randperm(pool, generator=gen)[:count].tolist()) for _ in range(draws)]
        if ranking == "joint":
            k_row, v_row = _joint_rows(picks[0], kv_heads, bits, low_bits)
        else:
            k_row, v_row = (_widths(p, kv_heads, bits, low_bits) for p in picks)
        k_bits.append(k_row)
        v_bits.append(v_row)
    return HeadPrecision(k_bits, v_bits, n_h=n_h, ranking=ranking, method="random", remarks=(f"seed {seed}",))


def uniform_head_precision(num_layers: int, kv_heads: int, bits: int = 4) -> HeadPrecision:
    """Every K and V head at ``bits``."""
    rows = [[bits] * kv_heads for _ in range(num_layers)]
    return HeadPrecision(rows, rows, n_h=0, method="uniform")


def _model_kv_shape(model: Any) -> tuple[int, int, int]:
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim


@torch.no_grad()
def collect_kv_channel_range(
    model: Any,
    texts: Iterable[str] | Iterable[torch.Tensor],
    tokenizer: Any = None,
    *,
    max_length: int = 2048,
    progress: bool = True,
) -> KVChannelRange:
    """Run each text through ``model`` (one forward with ``use_cache=True``) and fold its post-RoPE K/V in.

    Args:
        texts: strings (tokenized with ``tokenizer``) or 1-D token id tensors; each is cut to ``max_length``.
    """
    num_layers, kv_heads, head_dim = _model_kv_shape(model)
    stats = KVChannelRange.empty(num_layers, kv_heads, head_dim)
    device = next(model.parameters()).device
    texts = list(texts)
    for text in tqdm(texts, desc="calibrating KV head priorities", disable=not progress, leave=False):
        if isinstance(text, str):
            if tokenizer is None:
                raise ValueError("string calibration texts need a tokenizer")
            ids = torch.tensor(tokenizer(text).input_ids, dtype=torch.long)
        else:
            ids = torch.as_tensor(text, dtype=torch.long).flatten()
        ids = ids[:max_length]
        if ids.numel() == 0:
            continue
        out = model(ids.unsqueeze(0).to(device), use_cache=True)
        cache = out.past_key_values
        for layer in range(num_layers):
            stats.update(layer, cache.layers[layer].keys, cache.layers[layer].values)
        stats.tokens += ids.numel()
    if stats.tokens == 0:
        raise ValueError("no calibration tokens: pass at least one non-empty text")
    return stats


def calibrate_head_precision(
    model: Any,
    texts: Iterable[str] | Iterable[torch.Tensor],
    tokenizer: Any = None,
    *,
    config: KVCacheConfig | ModeConfig | str | None = "turbo",
    n_h: int | float | None = None,
    ranking: str = "joint",
    max_length: int = 2048,
    progress: bool = True,
) -> HeadPrecision:
    """Pick the 2-bit KV heads of every layer by priority = gap × std (TurboAttention §3.2).

    Args:
        model: a causal LM returning its cache (``past_key_values.layers[i].keys``) from ``forward``.
        texts: calibration texts (a few documents suffice: extrema converge fast).
        config: the KV-cache settings (``bits``, ``low_bits``, ``two_bit_heads``); a mode name works.
        n_h: 2-bit heads per layer, overriding ``config.two_bit_heads`` (an int count or a float fraction).
        ranking: ``joint`` (default) or ``separate``, see :func:`head_precision_from_priorities`.

    Returns:
        a :class:`HeadPrecision` (``.report()`` prints the choice, ``.to_dict()`` stores it).
    """
    kv = kv_config_of(config)
    n_h = kv.two_bit_heads if n_h is None else n_h
    stats = collect_kv_channel_range(model, texts, tokenizer, max_length=max_length, progress=progress)
    k_priority, v_priority = stats.priorities()
    k_absmax, v_absmax = stats.absmax()
    result = head_precision_from_priorities(
        k_priority, v_priority, n_h, ranking=ranking, bits=kv.bits, low_bits=kv.low_bits, tokens=stats.tokens,
        k_absmax=k_absmax, v_absmax=v_absmax,
    )
    logger.info("%s", result.report())
    return result


# --------------------------------------------------------------------------- checkpoint pipeline

STATS = ("k_channel_max", "k_channel_min", "v_channel_max", "v_channel_min")


def _fqns(model: Any, num_layers: int) -> list[str]:
    modules = attention_modules(model)
    missing = [i for i in range(num_layers) if i not in modules]
    if missing:
        raise ValueError(f"found no attention module (with layer_idx and num_key_value_groups) for layers {missing}")
    return [modules[i][0] for i in range(num_layers)]


def calibrate_turbo(model: Any, samples: list[torch.Tensor], config: ModeConfig, progress: bool):
    """The ``"turbo"`` calibrator of :func:`quantpatch.calibrate`: per attention module (FQN), float32
    ``(Hkv, D)`` ``k_channel_max``, ``k_channel_min``, ``v_channel_max``, ``v_channel_min`` of the post-RoPE
    K and of V over every calibration token."""
    kv_config_of(config)  # a turbo KV cache, or raise
    ranges = collect_kv_channel_range(model, samples, max_length=max(s.numel() for s in samples), progress=progress)
    tensors = {}
    for layer, fqn in enumerate(_fqns(model, ranges.k_max.shape[0])):
        for stat, table in zip(STATS, (ranges.k_max, ranges.k_min, ranges.v_max, ranges.v_min)):
            tensors[f"{fqn}:{stat}"] = table[layer].clone()
    return CalibrationStats(tensors, {"kv_tokens": ranges.tokens})


def channel_range_from_stats(stats: Any, model: Any) -> KVChannelRange:
    """The :class:`KVChannelRange` that :func:`calibrate_turbo` stored in ``stats``."""
    num_layers, kv_heads, head_dim = _model_kv_shape(model)
    ranges = KVChannelRange.empty(num_layers, kv_heads, head_dim)
    for layer, fqn in enumerate(_fqns(model, num_layers)):
        for stat, table in zip(STATS, (ranges.k_max, ranges.k_min, ranges.v_max, ranges.v_min)):
            table[layer] = stats.get(fqn, stat).to(torch.float32)
    ranges.tokens = int(stats.meta.get("kv_tokens", stats.meta.get("tokens", 0)))
    return ranges


def head_precision_from_ranges(
    ranges: KVChannelRange, config: KVCacheConfig | ModeConfig | str | None = "turbo", *,
    n_h: int | float | None = None, ranking: str = "joint",
) -> HeadPrecision:
    """Eq. 11-12 on calibrated extrema: ``config.low_bits`` for the ``n_h`` (default ``config.two_bit_heads``)
    lowest-priority heads of each layer, with the calibrated absmax as the buffer-scale floor."""
    kv = kv_config_of(config)
    k_priority, v_priority = ranges.priorities()
    k_absmax, v_absmax = ranges.absmax()
    return head_precision_from_priorities(
        k_priority, v_priority, kv.two_bit_heads if n_h is None else n_h, ranking=ranking, bits=kv.bits,
        low_bits=kv.low_bits, tokens=ranges.tokens, k_absmax=k_absmax, v_absmax=v_absmax,
    )


def convert_turbo(model: Any, stats: Any, config: ModeConfig, *, quantize: bool = True, options: Any = None,
                  include: list[str] | None = None, exclude: list[str] | None = None, progress: bool = True):
    """The ``"turbo"`` converter of :func:`quantpatch.convert`: choose every attention module's K/V head widths.

    No weight changes (TurboAttention quantizes activations only; ``quantize`` has no linear to act on).
    ``ConvertState.attention[FQN]`` gets ``layer_idx``, ``num_heads``, ``num_kv_heads``, ``head_dim``,
    ``kv = "turbo"``, ``k_bits``, ``v_bits``, ``k_priority``, ``v_priority``, ``k_absmax``, ``v_absmax``,
    ``ranking`` and ``n_h`` (joint ranking, ``n_h = config.kv_cache.two_bit_heads``), which ``save`` writes
    to the checkpoint config and :func:`~quantpatch.head_precision.head_precision_of` reads back.
    """
    if include or exclude:
        raise ValueError("convert(mode='turbo') picks KV head widths for every attention layer; include/exclude "
                         "select linears and do not apply")
    kv = kv_config_of(config)
    num_layers, kv_heads, head_dim = _model_kv_shape(model)
    if stats is None:
        if kv.two_bit_heads:
            raise ValueError("convert(mode='turbo') with two_bit_heads > 0 needs calibration statistics "
                             "(quantpatch.calibrate(model, texts, 'turbo'))")
        hp = uniform_head_precision(num_layers, kv_heads, kv.bits)
    else:
        hp = head_precision_from_ranges(channel_range_from_stats(stats, model), kv)
    state = ConvertState(config, options if options is not None else FireQOptions(), False, stats=stats)
    heads = model.config.get_text_config(decoder=True).num_attention_heads
    for layer, fqn in enumerate(_fqns(model, num_layers)):
        state.attention[fqn] = {
            "layer_idx": layer, "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": head_dim,
            "kv": "turbo", "crs_pairs": [], "ranking": hp.ranking, "n_h": hp.n_h,
            "k_bits": list(hp.k_bits[layer]), "v_bits": list(hp.v_bits[layer]),
            "k_priority": list(hp.k_priority[layer]) if hp.k_priority else [],
            "v_priority": list(hp.v_priority[layer]) if hp.v_priority else [],
            "k_absmax": list(hp.k_absmax[layer]) if hp.k_absmax else [],
            "v_absmax": list(hp.v_absmax[layer]) if hp.v_absmax else [],
        }
    logger.info("%s", hp.report())
    return state


def load_texts(path: str, limit: int | None = None) -> list[str]:
    """The ``text`` field of each line of a jsonl file (the first ``limit`` lines)."""
    texts = []
    with open(path) as f:
        for line in f:
            if line.strip():
                texts.append(json.loads(line)["text"])
            if limit is not None and len(texts) >= limit:
                break
    return texts


# --------------------------------------------------------------------------- checkpoint records


def add_site(module: Any, site: dict[str, Any]) -> None:
    """The load hook: a turbo site record carries per-head widths only, nothing to register on the module."""


def summarize(sites: list[dict[str, Any]]) -> dict[str, Any]:
    """``checkpoint.info``'s TurboAttention field: ``kv_head_bits``, how many KV heads store K (and V) at each
    bit width, ``{"k": {4: 6, 2: 2}, "v": ...}``; None without turbo sites."""
    if not sites:
        return {"kv_head_bits": None}
    return {"kv_head_bits": {part: dict(sorted(Counter(b for site in sites for b in site[f"{part}_bits"]).items(),
                                               reverse=True)) for part in ("k", "v")}}


METHOD = Method(key="turbo", site_kinds=("turbo",), calibrate=calibrate_turbo, convert=convert_turbo,
                add_site=add_site, summarize=summarize)
