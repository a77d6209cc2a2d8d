"""``convert``: run a mode's converter on a calibrated model and keep what it did for ``save``.

The converter comes from the mode's method (:func:`quantpatch.methods.get_method` by
:func:`~quantpatch.calibration.calibration_key`): FireQ merges CAS/RPN into the weights, picks CRS pairs and
swaps in W4A8 linears (:mod:`quantpatch.methods.fireq`); TurboAttention picks each KV head's bit width
(:mod:`quantpatch.methods.turbo`). ``convert`` works in place and is not undone by a handle: like
``torchao.quantize_``, it is an offline transformation whose result is saved with
:func:`quantpatch.checkpoint.save`.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from quantpatch.calibration import CalibrationStats, architecture_hash, calibration_key
from quantpatch.config import ModeConfig
from quantpatch.methods import get_method
from quantpatch.modes import get_mode

logger = logging.getLogger("quantpatch")

STATE_ATTR = "_quantpatch_state"
CAS_SITES = ("qkv", "o", "gate_up", "down")


@dataclass(frozen=True)
class FireQOptions:
    """Convert-time choices the mode config does not hold (stored in the checkpoint).

    Every checkpoint records them (``quantpatch_config.json`` ``"options"``); only FireQ's converter reads them
    (:mod:`quantpatch.methods.fireq`), a TurboAttention checkpoint carries the ones it was given.

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
    scale underflowed to 0). ``attention``: FQN → the method's site record, with at least
    ``num_heads``, ``num_kv_heads``, ``head_dim``, ``crs_pairs`` (list per KV head) and ``kv``
    (its kind: ``"int4_token"`` or ``"none"`` for FireQ, ``"turbo"``).
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
            ``linear.include``, else all q/k/v/o/gate/up/down; a string is one substring); the LM head is never
            converted.

    Returns:
        The :class:`ConvertState`, also stored as ``model._quantpatch_state``.
    """
    from quantpatch.patches import name_filter

    include, exclude = name_filter("include", include), name_filter("exclude", exclude)
    config = get_mode(mode)
    if getattr(model, STATE_ATTR, None) is not None:
        raise ValueError("this model is already converted by quantpatch; load the original weights to convert again")
    if stats is not None and stats.meta.get("arch_hash") not in (None, architecture_hash(model.config)):
        raise ValueError("calibration statistics were collected on a different model architecture")
    if isinstance(options, dict):
        options = FireQOptions.from_dict(options)
    options = options or FireQOptions()
    method = get_method(calibration_key(config))
    state = method.convert(model, stats, config, quantize=quantize, options=options, include=include,
                           exclude=exclude, progress=progress)
    state.base = {
        "model_type": getattr(model.config, "model_type", None),
        "arch_hash": architecture_hash(model.config),
        "name_or_path": getattr(model.config, "_name_or_path", "") or getattr(model, "name_or_path", ""),
    }
    setattr(model, STATE_ATTR, state)
    logger.info("%s", state.report().splitlines()[0])
    return state
