"""Offline calibration: run text through a model with forward hooks and keep the statistics a mode needs.

``calibrate(model, texts, mode="fireq")`` tokenizes up to ``samples`` texts (each cut to
``seq_len`` tokens), runs them one at a time under ``torch.no_grad`` with a tqdm bar, and
returns a :class:`CalibrationStats`. Hooks are always removed, also when a forward raises.

The statistics depend on the method: the mode's :func:`calibration_key` (its KV-cache kind, else
``"fireq"`` for W4A8 linears) picks the calibrator of its method (:mod:`quantpatch.methods`: FireQ's
activation and K/V extrema in :mod:`quantpatch.methods.fireq`, TurboAttention's per-channel K/V ranges in
:mod:`quantpatch.methods.turbo`), ``fn(model, samples, config, progress) -> CalibrationStats`` with
``samples`` a list of ``(1, N)`` int64 token tensors. This module holds what every method shares: the
statistics container, the model layout, the hooks' cleanup and the tokenized samples.

The model families whose layout we know (the Llama block: RMSNorm → q/k/v → RoPE (rotate-half
pairs ``(i, i + D/2)``) → attention → o; RMSNorm → gate/up → down) are in :data:`LAYOUTS`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from quantpatch.config import ModeConfig
from quantpatch.fallback import UnsupportedError
from quantpatch.methods import get_method
from quantpatch.modes import get_mode

logger = logging.getLogger("quantpatch")

STATS_VERSION = 1

# Config keys that define the architecture (and so the meaning of every stored tensor). An
# allow-list, so a Transformers release that adds a config field does not change the hash.
ARCH_KEYS = (
    "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "rope_theta", "rope_parameters",
    "rope_scaling", "tie_word_embeddings", "attention_bias", "mlp_bias", "hidden_act", "max_position_embeddings",
)


def architecture_hash(config: Any) -> str:
    """sha256 (hex, first 16) of the architecture keys of a Transformers config (or its dict)."""
    data = config if isinstance(config, dict) else config.to_dict()
    arch = {k: data[k] for k in ARCH_KEYS if k in data and data[k] is not None}
    return hashlib.sha256(json.dumps(arch, sort_keys=True, default=str).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- model layout


@dataclass(frozen=True)
class LayerSites:
    """FQNs of one decoder block's modules and its attention geometry."""

    prefix: str
    attn: str
    q: str
    k: str
    v: str
    o: str
    gate: str
    up: str
    down: str
    input_norm: str
    post_norm: str
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def linears(self) -> tuple[str, ...]:
        return (self.q, self.k, self.v, self.o, self.gate, self.up, self.down)


def _llama_layout(model: nn.Module) -> list[LayerSites]:
    cfg = model.config
    heads, kv_heads = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    names = dict(model.named_modules())
    layers = [n for n in names if n.endswith(".self_attn") and f"{n[:-10]}.mlp" in names]
    if not layers:
        raise UnsupportedError(f"found no Llama-style decoder blocks (self_attn + mlp) in {type(model).__name__}")
    sites = []
    for attn in layers:
        p = attn[: -len(".self_attn")]
        s = LayerSites(
            p, attn, f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj", f"{attn}.o_proj",
            f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj", f"{p}.mlp.down_proj",
            f"{p}.input_layernorm", f"{p}.post_attention_layernorm", heads, kv_heads, head_dim,
        )
        missing = [n for n in (*s.linears, s.input_norm, s.post_norm) if n not in names]
        if missing:
            raise UnsupportedError(f"decoder block {p} lacks {missing}; quantpatch knows the Llama block layout")
        sites.append(s)
    return sites


# model_type -> layout function. RMSNorm must compute ``weight * x̂`` (not Gemma's ``(1 + weight)``)
# and K must be the k_proj output itself (no per-head k_norm as in Qwen3) for CAS/RPN merging.
LAYOUTS: dict[str, Callable[[nn.Module], list[LayerSites]]] = {
    "llama": _llama_layout,
    "mistral": _llama_layout,
    "qwen2": _llama_layout,
}


def decoder_layers(model: nn.Module) -> list[LayerSites]:
    """The decoder blocks of a supported Transformers causal LM, in order."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in LAYOUTS:
        raise UnsupportedError(
            f"calibration/convert supports model types {sorted(LAYOUTS)}; got {model_type!r}"
        )
    return LAYOUTS[model_type](model)


# --------------------------------------------------------------------------- statistics


@dataclass
class CalibrationStats:
    """Calibration statistics: tensors keyed ``"<module FQN>:<stat>"`` plus JSON metadata.

    ``meta`` holds ``mode``, ``samples``, ``seq_len``, ``tokens``, ``model_type``,
    ``arch_hash`` and ``version``. :meth:`to_dict` / :meth:`from_dict` give a JSON-able form
    (tensors as nested lists); checkpoints store :attr:`tensors` in safetensors instead.
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def mode(self) -> str:
        return self.meta.get("mode", "")

    def get(self, fqn: str, stat: str) -> torch.Tensor:
        key = f"{fqn}:{stat}"
        if key not in self.tensors:
            raise KeyError(f"calibration statistics have no {stat!r} for {fqn!r} (mode {self.mode!r})")
        return self.tensors[key]

    def has(self, fqn: str, stat: str) -> bool:
        return f"{fqn}:{stat}" in self.tensors

    def to_dict(self) -> dict[str, Any]:
        return {
            "meta": dict(self.meta),
            "tensors": {k: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                            "data": t.flatten().tolist()} for k, t in sorted(self.tensors.items())},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CalibrationStats:
        tensors = {
            k: torch.tensor(v["data"], dtype=getattr(torch, v["dtype"])).reshape(v["shape"])
            for k, v in data.get("tensors", {}).items()
        }
        meta = dict(data.get("meta", {}))
        if meta.get("version", 1) > STATS_VERSION:
            raise ValueError(f"calibration statistics version {meta['version']} is newer than {STATS_VERSION}")
        return cls(tensors, meta)

    def summary(self) -> str:
        m = self.meta
        return (f"{m.get('mode')} calibration: {m.get('samples')} samples, {m.get('tokens')} tokens "
                f"(seq_len {m.get('seq_len')}), {len(self.tensors)} tensors")


# --------------------------------------------------------------------------- hooks


@contextlib.contextmanager
def hooked(handles: list) -> Iterator[None]:
    """Remove every hook handle in ``handles`` on exit (normal or not); hooks may be appended inside."""
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        handles.clear()


# --------------------------------------------------------------------------- dispatch


def calibration_key(config: ModeConfig) -> str:
    """Which method (:mod:`quantpatch.methods`) a mode uses: its KV-cache kind, else ``"fireq"`` for W4A8 linears."""
    if config.kv_cache.kind != "none":
        return config.kv_cache.kind
    if config.linear.kind == "w4a8_fp8":
        return "fireq"
    raise ValueError(f"mode {config.name!r} has no KV-cache or linear quantization to calibrate")


def token_samples(texts: Sequence[str | torch.Tensor], tokenizer: Any = None, *, samples: int | None = 64,
                  seq_len: int = 512) -> list[torch.Tensor]:
    """Up to ``samples`` calibration inputs ``(1, ≤ seq_len)`` int64: texts tokenized (or token tensors) and cut."""
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    out = []
    for text in texts:
        if samples is not None and len(out) >= samples:
            break
        if isinstance(text, torch.Tensor):
            ids = text.reshape(-1).long()
        else:
            if tokenizer is None:
                raise ValueError("calibrate got text but no tokenizer; pass tokenizer= or token id tensors")
            ids = torch.tensor(tokenizer(text).input_ids, dtype=torch.long)
        if ids.numel() >= 2:
            out.append(ids[:seq_len].unsqueeze(0))
    if not out:
        raise ValueError("no calibration sample has 2 or more tokens")
    return out


def calibrate(
    model: nn.Module,
    texts: Sequence[str | torch.Tensor],
    mode: str | ModeConfig = "fireq",
    *,
    tokenizer: Any = None,
    samples: int | None = 64,
    seq_len: int = 512,
    progress: bool = True,
) -> CalibrationStats:
    """Collect the statistics ``mode`` needs from ``model`` on ``texts``.

    Args:
        model: a Transformers causal LM of a family in :data:`LAYOUTS` (any device/dtype).
        texts: strings (tokenized with ``tokenizer``) or 1-D token id tensors; the first
            ``samples`` with ≥ 2 tokens are used, each cut to ``seq_len`` tokens.
        mode: a mode name or ``ModeConfig`` with a calibration method (``"fireq"``, ``"turbo"``).

    Returns:
        :class:`CalibrationStats` (tensors on CPU, float32).
    """
    config = get_mode(mode)
    key = calibration_key(config)
    calibrator = get_method(key).calibrate
    batch = token_samples(texts, tokenizer, samples=samples, seq_len=seq_len)
    was_training = model.training
    model.eval()
    try:
        stats = calibrator(model, batch, config, progress)
    finally:
        model.train(was_training)
    stats.meta.update({
        "version": STATS_VERSION,
        "mode": config.name,
        "calibrator": key,
        "samples": len(batch),
        "seq_len": seq_len,
        "tokens": sum(t.numel() for t in batch),
        "model_type": getattr(model.config, "model_type", None),
        "arch_hash": architecture_hash(model.config),
    })
    logger.info("%s", stats.summary())
    return stats
