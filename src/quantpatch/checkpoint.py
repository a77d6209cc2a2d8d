"""Checkpoints of converted models: ``save(model, dir)`` and ``load(dir, base_model=...)``.

Layout of a checkpoint directory::

    quantpatch_config.json     versioned: format, ModeConfig, convert options, base model
                               (model type, architecture hash, full config), per-layer data
                               (W4A8 linears: shapes, group size, PTS exponent, ...), per-head
                               choices (CRS pairs), tied-weight aliases, calibration metadata,
                               sha256 and size of every tensor file
    model.safetensors          the whole converted state dict: packed INT4 weights (uint8),
                               e4m3 group scales (F8_E4M3), PTS exponents, CAS-merged norms,
                               CRS factors/pairs buffers, embeddings; tied tensors stored once;
                               non-persistent buffers (RoPE inv_freq) as "__nonpersistent__.<name>"
    calibration.safetensors    the calibration statistics (keys ``"<module FQN>:<stat>"``)

The checkpoint is self-contained: the base model's weights are not read again. ``load``
rebuilds the architecture from the base config with its parameters on the meta device
(``accelerate.init_empty_weights``), swaps in ``W4A8Linear`` skeletons on meta, and fills
everything with ``load_state_dict(assign=True)``, so peak memory is about one copy of the
checkpoint rather than the float model plus the checkpoint.

What a method adds is its own (:mod:`quantpatch.methods`): each attention site's record goes to the method
whose converter wrote its kind (``"kv"``), which registers the site's buffers on the skeleton
(``Method.add_site``) and gives its fields of :func:`info` (``Method.summarize``).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantpatch.calibration import ARCH_KEYS, CalibrationStats, architecture_hash
from quantpatch.config import ModeConfig
from quantpatch.conversion import STATE_ATTR, ConvertState, FireQOptions
from quantpatch.methods import all_methods, method_of_site
from quantpatch.w4a8_linear import W4A8Linear

logger = logging.getLogger("quantpatch")

FORMAT = "quantpatch-checkpoint"
CHECKPOINT_VERSION = 1
CONFIG_FILE = "quantpatch_config.json"
MODEL_FILE = "model.safetensors"
STATS_FILE = "calibration.safetensors"
NONPERSISTENT = "__nonpersistent__."


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: missing or corrupted file, newer version, wrong base model."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _dedupe(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Drop tensors that share storage with an earlier one (tied weights); ``aliases[dropped] = kept``."""
    seen: dict[tuple, str] = {}
    out, aliases = {}, {}
    for name, t in state.items():
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if t.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        out[name] = t.detach().contiguous()
    return out, aliases


# --------------------------------------------------------------------------- save


def save(model: nn.Module, directory: str | Path, *, tokenizer: Any = None) -> Path:
    """Write a converted model (see the module docstring) to ``directory``.

    Args:
        model: a model converted by :func:`quantpatch.convert` (it carries ``_quantpatch_state``).
        tokenizer: optionally saved alongside (``save_pretrained``), for the CLI's convenience.

    Returns:
        The directory path.
    """
    from safetensors.torch import save_file

    state: ConvertState | None = getattr(model, STATE_ATTR, None)
    if state is None:
        raise ValueError("save() needs a model converted with quantpatch.convert (it has no quantpatch state)")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state_dict = model.state_dict()
    tensors, aliases = _dedupe(state_dict)
    # Non-persistent buffers (RoPE inv_freq) too: a model cast with .to(dtype) carries them cast,
    # and a bitwise round trip needs the same values.
    tensors.update({NONPERSISTENT + n: b.detach().contiguous() for n, b in model.named_buffers()
                    if n not in state_dict})
    save_file({k: v.cpu() for k, v in tensors.items()}, str(directory / MODEL_FILE), metadata={"format": FORMAT})
    files = {MODEL_FILE: directory / MODEL_FILE}
    stats = state.stats
    if stats is not None and stats.tensors:
        save_file({k: v.contiguous().cpu() for k, v in stats.tensors.items()}, str(directory / STATS_FILE),
                  metadata={"format": FORMAT})
        files[STATS_FILE] = directory / STATS_FILE
    w4a8 = [m for m in model.modules() if isinstance(m, W4A8Linear)]
    config = {
        "format": FORMAT,
        "version": CHECKPOINT_VERSION,
        "quantpatch_version": _version(),
        "mode": state.mode.to_dict(),
        "options": state.options.to_dict(),
        "quantized": state.quantized,
        "base_model": {
            **state.base,
            "architecture": type(model).__name__,
            "config": json.loads(model.config.to_json_string()),
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        },
        "linears": state.linears,
        "attention": state.attention,
        "tied": aliases,
        "calibration": dict(stats.meta) if stats is not None else None,
        "memory": {
            "w4a8_weight_bytes": sum(m.weight_nbytes() for m in w4a8),
            "bf16_weight_bytes": sum(m.in_features * m.out_features * 2 for m in w4a8),
        },
        "files": {name: {"sha256": _sha256(p), "bytes": p.stat().st_size} for name, p in files.items()},
    }
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))
    logger.info("saved quantpatch checkpoint to %s (%d W4A8 linears)", directory, len(w4a8))
    return directory


def _version() -> str:
    from quantpatch import __version__

    return __version__


# --------------------------------------------------------------------------- load


# Top-level keys every checkpoint config has (``save`` writes them all) and the JSON type of each.
REQUIRED_KEYS = {"mode": dict, "options": dict, "quantized": bool, "base_model": dict, "linears": dict,
                 "attention": dict, "files": dict}


def _check_version(version: Any, what: str, current: int) -> None:
    """Raise :class:`CheckpointError` unless ``version`` is an int (not a bool) in ``[1, current]``."""
    if isinstance(version, bool) or not isinstance(version, int):
        raise CheckpointError(f"{what} version must be an integer, got {version!r} ({type(version).__name__})")
    if version < 1:
        raise CheckpointError(f"{what} version {version} is not valid (versions start at 1)")
    if version > current:
        raise CheckpointError(f"{what} version {version} is newer than this quantpatch reads ({current}); "
                              "upgrade quantpatch")


def read_config(directory: str | Path) -> dict[str, Any]:
    """Parse and validate ``quantpatch_config.json`` (format, version, keys, mode); raises :class:`CheckpointError`."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: {directory} is not a quantpatch checkpoint")
    try:
        config = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON (corrupted?): {err}") from err
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        found = config.get("format") if isinstance(config, dict) else type(config).__name__
        raise CheckpointError(f"{path} is not a quantpatch checkpoint config (format {found!r})")
    _check_version(config.get("version"), f"{path}: checkpoint", CHECKPOINT_VERSION)
    for key, kind in REQUIRED_KEYS.items():
        if not isinstance(config.get(key), kind):
            raise CheckpointError(f"{path}: {key!r} must be a JSON {'object' if kind is dict else 'boolean'}, "
                                  f"got {config.get(key)!r:.80}")
    base = config["base_model"]
    if not isinstance(base.get("config"), dict) or not isinstance(base.get("arch_hash"), str):
        raise CheckpointError(f"{path}: 'base_model' lacks its 'config' (object) or 'arch_hash' (string)")
    try:
        ModeConfig.from_dict(config["mode"])
        FireQOptions.from_dict(config["options"])
    except (ValueError, TypeError) as err:
        raise CheckpointError(f"{path}: invalid mode or options: {err}") from err
    return config


def _check_files(directory: Path, config: dict[str, Any], verify: bool) -> None:
    for name, info in config["files"].items():
        if not (isinstance(info, dict) and isinstance(info.get("bytes"), int) and isinstance(info.get("sha256"), str)):
            raise CheckpointError(f"{directory / CONFIG_FILE}: files entry {name!r} needs 'bytes' (int) and 'sha256' "
                                  f"(string), got {info!r:.80}")
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} is missing")
        if path.stat().st_size != info["bytes"]:
            raise CheckpointError(f"checkpoint file {path} has {path.stat().st_size} bytes, expected "
                                  f"{info['bytes']} (truncated or corrupted)")
        if verify and _sha256(path) != info["sha256"]:
            raise CheckpointError(f"checkpoint file {path} fails its sha256 check (corrupted or modified)")
    if MODEL_FILE not in config["files"]:
        raise CheckpointError(f"{directory / CONFIG_FILE} lists no {MODEL_FILE}")


def _short(value: Any, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 1] + "…"


def _describe(base_model: Any, base_cfg: Any) -> str:
    """``LlamaForCausalLM (model_type 'llama', from 'org/name')``: a base model in a few words, never its printout."""
    name = getattr(base_cfg, "_name_or_path", "") or (base_model if isinstance(base_model, (str, Path)) else "")
    kind = type(base_model).__name__ if isinstance(base_model, nn.Module) else type(base_cfg).__name__
    return f"{kind} (model_type {getattr(base_cfg, 'model_type', None)!r}" + (f", from {str(name)!r})" if name else ")")


def _base_config(config: dict[str, Any], base_model: Any):
    """The Transformers config to rebuild from; checks ``base_model`` against the checkpoint's."""
    from transformers import AutoConfig, PretrainedConfig

    stored = config["base_model"]
    if base_model is None:
        data = dict(stored["config"])
        model_type = data.pop("model_type")
        return AutoConfig.for_model(model_type, **data)
    if isinstance(base_model, PretrainedConfig):
        base_cfg = base_model
    elif isinstance(base_model, nn.Module):
        if not isinstance(getattr(base_model, "config", None), PretrainedConfig):
            raise CheckpointError(f"base_model is a {type(base_model).__name__} without a Transformers config; pass "
                                  "the model it was converted from, its PretrainedConfig, or its path / hub id")
        base_cfg = base_model.config
    elif isinstance(base_model, (str, Path)):
        try:
            base_cfg = AutoConfig.from_pretrained(str(base_model))
        except (OSError, ValueError) as err:
            raise CheckpointError(f"cannot read the base model config from {str(base_model)!r}: {err}") from err
    else:
        raise CheckpointError(f"base_model must be a path or hub id, a PretrainedConfig or a Transformers model; got "
                              f"a {type(base_model).__name__}")
    if architecture_hash(base_cfg) != stored["arch_hash"]:
        mine, theirs = base_cfg.to_dict(), stored["config"]
        keys = ["model_type"] if theirs.get("model_type") != mine.get("model_type") else ARCH_KEYS
        diff = [f"{k}: checkpoint {_short(theirs.get(k))}, base {_short(mine.get(k))}"
                for k in keys if theirs.get(k) != mine.get(k)]
        made_from = f"{stored.get('architecture')} (model_type {stored.get('model_type')!r}" + (
            f", from {stored['name_or_path']!r})" if stored.get("name_or_path") else ")")
        raise CheckpointError(
            f"base model {_describe(base_model, base_cfg)} does not match the checkpoint, made from {made_from}: "
            + ("; ".join(diff) or "architecture hash differs")
        )
    return base_cfg


def _skeleton(config: dict[str, Any], base_cfg) -> nn.Module:
    """The model with parameters on meta, W4A8Linear skeletons and each site's buffers (meta) from its method."""
    import transformers
    from accelerate import init_empty_weights

    arch = config["base_model"].get("architecture")
    with init_empty_weights(include_buffers=False):  # buffers (RoPE inv_freq) are computed for real
        cls = getattr(transformers, arch, None) if arch else None
        model = cls(base_cfg) if cls is not None else transformers.AutoModelForCausalLM.from_config(base_cfg)
    for fqn, info in config["linears"].items():
        parent, _, child = fqn.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        if not isinstance(getattr(owner, child, None), nn.Linear):
            raise CheckpointError(f"checkpoint layer {fqn} is not an nn.Linear in the rebuilt {type(model).__name__}")
        bias_dtype = getattr(torch, info["bias_dtype"]) if info.get("bias_dtype") else torch.float32
        setattr(owner, child, W4A8Linear(info["in_features"], info["out_features"], info["bias"],
                                         group_size=info["group_size"], weight_operand=info["weight_operand"],
                                         device="meta", dtype=bias_dtype))
    for fqn, site in config["attention"].items():
        try:
            method = method_of_site(site.get("kv"))
        except ValueError as err:
            raise CheckpointError(f"checkpoint attention site {fqn}: {err}") from err
        method.add_site(model.get_submodule(fqn), site)
    return model


def _tie(model: nn.Module, alias: str, source: str) -> None:
    parent, _, child = alias.rpartition(".")
    src_parent, _, src_child = source.rpartition(".")
    src = getattr(model.get_submodule(src_parent) if src_parent else model, src_child)
    setattr(model.get_submodule(parent) if parent else model, child, src)


def load(
    directory: str | Path,
    base_model: Any = None,
    *,
    device: str | torch.device = "cpu",
    patch_attention: bool = False,
    policy: str = "speed",
    verify: bool = True,
) -> nn.Module:
    """Rebuild a converted model from a checkpoint written by :func:`save`.

    Args:
        directory: the checkpoint directory.
        base_model: the model it was made from, to check against (a path or hub id whose
            ``config.json`` is read, a ``PretrainedConfig``, or a model); None trusts the
            config stored in the checkpoint. Its weights are never loaded.
        device: where the tensors are loaded.
        patch_attention: also run :func:`quantpatch.patch_model` with the checkpoint's mode
            (the handle is ``model._quantpatch_handle``).
        policy: that patch's routing policy (``"speed"`` or ``"always"``, as in ``patch_model``).
        verify: check each file's sha256 (size is always checked).

    Returns:
        The model in eval mode, ``model._quantpatch_state`` restored.

    Raises:
        CheckpointError: a missing/corrupted file, a malformed config (its message names the key),
            a checkpoint version that is not an int in ``[1, CHECKPOINT_VERSION]``, or a base model
            whose architecture differs (the message names both models and the differing config keys).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = Path(directory)
    config = read_config(directory)
    _check_files(directory, config, verify)
    base_cfg = _base_config(config, base_model)
    model = _skeleton(config, base_cfg)
    try:
        tensors = load_file(str(directory / MODEL_FILE), device=str(device))
    except (SafetensorError, OSError, RuntimeError) as err:
        raise CheckpointError(f"cannot read {directory / MODEL_FILE} (corrupted?): {err}") from err
    extra = {k[len(NONPERSISTENT):]: tensors.pop(k) for k in list(tensors) if k.startswith(NONPERSISTENT)}
    result = model.load_state_dict(tensors, strict=False, assign=True)
    for name, t in extra.items():
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        if child not in owner._buffers:
            raise CheckpointError(f"{directory / MODEL_FILE} has buffer {name!r} the rebuilt model lacks")
        owner._buffers[child] = t  # stays non-persistent
    tied = config.get("tied", {})
    missing = [k for k in result.missing_keys if k not in tied]
    if missing or result.unexpected_keys:
        raise CheckpointError(f"{directory / MODEL_FILE} does not match the rebuilt model: missing {missing[:8]}"
                              f"{'…' if len(missing) > 8 else ''}, unexpected {result.unexpected_keys[:8]}")
    for alias, source in tied.items():
        _tie(model, alias, source)
    on_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if on_meta:
        raise CheckpointError(f"tensors left unloaded (still on meta): {on_meta[:8]}")
    model.to(device).eval()
    stats = None
    if config.get("calibration") is not None:
        stats_tensors = {}
        if STATS_FILE in config["files"]:
            try:
                stats_tensors = load_file(str(directory / STATS_FILE))
            except (SafetensorError, OSError, RuntimeError) as err:
                raise CheckpointError(f"cannot read {directory / STATS_FILE} (corrupted?): {err}") from err
        stats = CalibrationStats(stats_tensors, dict(config["calibration"]))
    mode = ModeConfig.from_dict(config["mode"])
    base = {k: v for k, v in config["base_model"].items() if k not in ("config", "architecture", "dtype")}
    state = ConvertState(mode, FireQOptions.from_dict(config["options"]), config["quantized"],
                         config["linears"], config["attention"], stats, base)
    setattr(model, STATE_ATTR, state)
    if patch_attention:
        from quantpatch.patching import patch_model

        patch_model(model, mode, policy=policy)
    return model


# --------------------------------------------------------------------------- info


def info(directory: str | Path, *, verify: bool = False) -> dict[str, Any]:
    """A summary of a checkpoint (mode, base model, layers, memory, calibration, files) without loading tensors."""
    directory = Path(directory)
    config = read_config(directory)
    _check_files(directory, config, verify)
    mem = config.get("memory", {})
    sites = list(config["attention"].values())
    per_method = {}
    for method in all_methods():
        per_method.update(method.summarize([site for site in sites if site.get("kv") in method.site_kinds]))
    pts = sorted({v["pts_exp"] for v in config["linears"].values()})
    return {
        "directory": str(directory),
        "version": config["version"],
        "quantpatch_version": config.get("quantpatch_version"),
        "mode": config["mode"]["name"],
        "options": config["options"],
        "base_model": {k: v for k, v in config["base_model"].items() if k != "config"},
        "w4a8_linears": len(config["linears"]),
        "pts_exponents": pts,
        "zero_scale_groups": sum(v["zero_scale_groups"] for v in config["linears"].values()),
        "attention_sites": len(config["attention"]),
        "kv_cache": ModeConfig.from_dict(config["mode"]).kv_cache.kind,
        **per_method,
        "weight_bytes": mem.get("w4a8_weight_bytes"),
        "bf16_weight_bytes": mem.get("bf16_weight_bytes"),
        "compression_vs_bf16": (mem["bf16_weight_bytes"] / mem["w4a8_weight_bytes"]
                                if mem.get("w4a8_weight_bytes") else None),
        "calibration": config.get("calibration"),
        "files": config.get("files"),
    }

