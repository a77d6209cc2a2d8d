"""Offline calibration: run text through a model with forward hooks and keep the statistics a mode needs.

``calibrate(model, texts, mode="fireq")`` tokenizes up to ``samples`` texts (each cut to
``seq_len`` tokens), runs them one at a time under ``torch.no_grad`` with a tqdm bar, and
returns a :class:`CalibrationStats`. Hooks are always removed, also when a forward raises.

Dispatch: the mode's KV-cache kind (else its linear kind) picks a *calibrator* from
:data:`CALIBRATORS`; a calibrator is ``fn(model, samples, config, progress) -> CalibrationStats``
with ``samples`` a list of ``(1, N)`` int64 token tensors. ``"fireq"`` is implemented here;
``"turbo"`` (head priority = gap × std) is resolved lazily from
``quantpatch.calibration_turbo:calibrate_turbo``; :func:`register_calibrator` adds others.

FireQ statistics (keys ``"<module FQN>:<stat>"`` in :attr:`CalibrationStats.tensors`, float32):

* every decoder linear's input ``x (…, K)``: ``act_absmax (K,)`` = ``max |x_c|`` and
  ``act_absmean (K,)`` = mean ``|x_c|`` over all calibration tokens;
* every attention module: ``k_pair_norm_max (Hkv, D/2)`` = ``max_n ‖(k_i, k_{i+D/2})‖₂`` of the
  pre-RoPE keys (RPN, FireQ Thm. 3.1), ``k_absmax (Hkv, D)`` = post-RoPE ``max_n |k_c|`` (CRS
  pair choice and factors, §3.2.1), ``v_absmax (Hkv, D)`` (diagnostics).

The model families whose layout we know (the Llama block: RMSNorm → q/k/v → RoPE (rotate-half
pairs ``(i, i + D/2)``) → attention → o; RMSNorm → gate/up → down) are in :data:`LAYOUTS`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from quantpatch.config import ModeConfig
from quantpatch.fallback import UnsupportedError
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


def _fireq_calibrator(model: nn.Module, samples: list[torch.Tensor], config: ModeConfig, progress: bool
                      ) -> CalibrationStats:
    """FireQ statistics (module docstring) for every decoder block of ``model``."""
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


# --------------------------------------------------------------------------- dispatch

Calibrator = Callable[[nn.Module, list, ModeConfig, bool], CalibrationStats]

# key -> calibrator, or "module:function" imported on first use.
CALIBRATORS: dict[str, Calibrator | str] = {
    "fireq": _fireq_calibrator,
    "turbo": "quantpatch.calibration_turbo:calibrate_turbo",
}


def register_calibrator(key: str, fn: Calibrator | str) -> None:
    """Add (or replace) the calibrator used for modes whose calibration key is ``key``."""
    CALIBRATORS[key] = fn


def calibration_key(config: ModeConfig) -> str:
    """Which calibrator a mode uses: its KV-cache kind, else ``"fireq"`` for W4A8 linears."""
    if config.kv_cache.kind != "none":
        return config.kv_cache.kind
    if config.linear.kind == "w4a8_fp8":
        return "fireq"
    raise ValueError(f"mode {config.name!r} has no KV-cache or linear quantization to calibrate")


def _resolve(key: str) -> Calibrator:
    if key not in CALIBRATORS:
        raise ValueError(f"no calibrator for {key!r}; registered: {sorted(CALIBRATORS)}")
    fn = CALIBRATORS[key]
    if isinstance(fn, str):
        module, _, attr = fn.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"calibrator {key!r} ({CALIBRATORS[key]}) is not available: {err}") from err
    return fn


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
        mode: a mode name or ``ModeConfig`` (``"fireq"``; ``"turbo"`` via ``calibration_turbo``).

    Returns:
        :class:`CalibrationStats` (tensors on CPU, float32).
    """
    config = get_mode(mode)
    key = calibration_key(config)
    calibrator = _resolve(key)
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
