"""Frozen, versioned configuration dataclasses for every quantpatch mode.

A mode is a :class:`ModeConfig`: an attention numerics preset (:class:`AttentionConfig`),
a KV-cache preset (:class:`KVCacheConfig`) and a linear-layer preset
(:class:`LinearConfig`). Every field is a knob one of the seed papers varies; each class
validates itself in ``__post_init__`` and round-trips through JSON.

Validation is driven by the field annotations and each field's ``metadata`` (:func:`_knob`):
a ``bool`` field takes only ``True``/``False``, an ``int`` field an integer that is not a
bool, a ``float`` field a finite real number, a ``str`` field a string from its ``choices``;
``ge``/``le``/``lt`` bound numbers. Any bad field, unknown field or value raises
``ValueError`` naming the field, the value and what is valid.

``ModeConfig.version`` is the JSON schema version. :data:`MIGRATIONS` upgrades an older
dict so that it keeps its meaning: version 2 turned smooth Q off in the ``sage2-8b``
preset, so a version-1 ``sage2-8b`` dict that omits ``smooth_q`` reads as ``smooth_q=True``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import numbers
import typing
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

CONFIG_VERSION = 2

# Value sets shared by validation and by error messages.
NUMERICS = ("none", "sage2", "int8_flash", "turbo", "fireq")
QK_FORMATS = ("int8", "int4", "fp8_e4m3", "fp16", "none")
GRANULARITIES = ("tensor", "block", "warp", "thread", "token")
PV_FORMATS = ("fp8_e4m3", "fp8_e5m2", "int8", "fp16", "none")
V_GRANULARITIES = ("tensor", "block", "channel")
EXP_KINDS = ("exact", "sas")
KV_KINDS = ("none", "turbo", "fireq")
LINEAR_KINDS = ("none", "w4a8_fp8", "fp8")
# exp(x) underflows to 0 in float64 below x = -745: a lower SAS threshold only adds zero LUT entries.
SAS_MIN_THRESHOLD = -745.0


def _knob(default: Any, *, choices: tuple | None = None, ge: float | None = None, le: float | None = None,
          lt: float | None = None) -> Any:
    """A dataclass field with its allowed values: ``choices``, or bounds ``ge <= x``, ``x <= le``, ``x < lt``."""
    rules = {name: value for name, value in (("choices", choices), ("ge", ge), ("le", le), ("lt", lt))
             if value is not None}
    return field(default=default, metadata=rules)


class _Bad(Exception):
    """A value of the wrong type; ``args[0]`` says what was expected (:func:`_check_fields` words the error)."""


def _as_bool(value: Any) -> bool:
    if type(value) is not bool:
        raise _Bad("a bool (True or False)")
    return value


def _as_int(value: Any) -> int:
    if type(value) is int:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _Bad("an int")
    return int(value)  # numpy and other integers: a built-in int, as JSON writes it


def _as_number(value: Any) -> int | float:
    """A finite real; an int stays an int (PEP 484: an int is a float; KVCacheConfig.two_bit_heads tells them apart)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _Bad("a number")
    if not math.isfinite(value):
        raise _Bad("finite")
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def _as_str(value: Any) -> str:
    if type(value) is not str:
        raise _Bad("a str")
    return value


def _checker(annotation: Any) -> Callable[[Any], Any]:
    """The function that checks (and normalizes) a value of a field annotated ``annotation``."""
    simple = {bool: _as_bool, int: _as_int, float: _as_number, str: _as_str}
    if annotation in simple:
        return simple[annotation]
    if typing.get_origin(annotation) is tuple:  # tuple[str, ...]; a bare string is not a sequence of names
        item = typing.get_args(annotation)[0]

        def as_tuple(value: Any) -> tuple:
            if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
                raise _Bad(f"a list of {item.__name__}")
            if not all(isinstance(v, item) for v in value):
                raise _Bad(f"a list of {item.__name__} values only")
            return tuple(value)
        return as_tuple
    if isinstance(annotation, type):  # a nested config part

        def as_instance(value: Any) -> Any:
            if not isinstance(value, annotation):
                raise _Bad(f"an instance of {annotation.__name__}")
            return value
        return as_instance
    raise TypeError(f"no validation rule for annotation {annotation!r}")


def _range_text(rules: dict[str, Any]) -> str:
    """``"negative and >= -745.0"``, ``">= 1"``: the bounds of a field's metadata in words."""
    words = []
    if "lt" in rules:
        words.append("negative" if rules["lt"] == 0 else f"< {rules['lt']}")
    words += [f"{op} {rules[key]}" for key, op in (("ge", ">="), ("le", "<=")) if key in rules]
    return " and ".join(words)


@functools.cache
def _field_checks(cls: type) -> tuple[tuple[str, Callable[[Any], Any], Any], ...]:
    """``(name, checker, rules)`` of each field of a config dataclass, built once per class."""
    hints = typing.get_type_hints(cls)
    return tuple((f.name, _checker(hints[f.name]), f.metadata) for f in fields(cls))


def _check_fields(config: Any) -> None:
    """Type, choices and bounds of every field of a config dataclass (see the module docstring)."""
    for name, check, rules in _field_checks(type(config)):
        value = getattr(config, name)
        try:
            checked = check(value)
        except _Bad as bad:
            raise ValueError(f"{type(config).__name__}.{name} must be {bad.args[0]}, got {value!r} "
                             f"({type(value).__name__})") from None
        if checked is not value:
            object.__setattr__(config, name, checked)  # frozen: store the normalized value
        if not rules:
            continue
        if "choices" in rules and checked not in rules["choices"]:
            raise ValueError(f"{type(config).__name__}.{name}={checked!r} is not valid; "
                             f"choose one of {list(rules['choices'])}")
        if (("ge" in rules and checked < rules["ge"]) or ("le" in rules and checked > rules["le"])
                or ("lt" in rules and checked >= rules["lt"])):
            raise ValueError(f"{type(config).__name__}.{name} must be {_range_text(rules)}, got {checked!r}")


class _JsonConfig:
    """Field validation, JSON round trip and validated ``replace`` shared by the config dataclasses."""

    def __post_init__(self) -> None:
        _check_fields(self)
        self._check_combination()

    def _check_combination(self) -> None:
        """Rules that tie several fields together (after every field passed :func:`_check_fields`)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        if not isinstance(data, dict):
            raise ValueError(f"{cls.__name__} must be a JSON object (dict), got {type(data).__name__}")
        valid = {f.name for f in fields(cls)}
        unknown = set(data) - valid
        if unknown:
            raise ValueError(f"unknown {cls.__name__} field(s) {sorted(unknown)}; valid fields are {sorted(valid)}")
        return cls(**cls._keywords(data))

    @classmethod
    def _keywords(cls, data: dict[str, Any]) -> dict[str, Any]:
        """The constructor keywords of a JSON dict whose keys are all fields."""
        return data

    def replace(self, **changes):
        valid = {f.name for f in fields(self)}
        unknown = set(changes) - valid
        if unknown:
            raise ValueError(
                f"unknown {type(self).__name__} option(s) {sorted(unknown)}; valid options are {sorted(valid)}"
            )
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class AttentionConfig(_JsonConfig):
    """Numerics of the attention product ``softmax(Q Kᵀ · scale) V``.

    Attributes:
        numerics: which paper's algorithm: ``sage2`` (SageAttention2), ``int8_flash``
            (INT-FlashAttention), ``turbo`` (TurboAttention prefill), ``fireq`` (FireQ FP8
            prefill) or ``none`` (full precision).
        qk_format: storage format of Q and K (``int8`` range ±``qk_qmax``, ``int4`` ±7, ``fp8_e4m3``,
            ``fp16``, or ``none``: kept in the compute dtype).
        qk_granularity: grouping of Q/K scales along tokens: one scale per ``tensor``, per
            ``block`` (``block_q``/``block_k`` tokens), per ``warp`` (``block_q / warps`` query
            rows; K as per block), per ``thread`` (SageAttention2 App. A.6) or per ``token``.
        qk_qmax: the integer range used for Q/K (127 for INT8, 7 for INT4, 119 for TurboAttention).
        smooth_k: subtract the per-head mean of K over tokens before quantizing (softmax-invariant).
        smooth_q: subtract the per-block mean of Q; add ΔS = q̄·γ(K)ᵀ back after the product.
        smooth_v: subtract the mean of V over tokens; add it back to O.
        pv_format: format of P̃ and V in the P·V product (``none``: kept in the compute dtype).
        pv_qmax: integer range of P̃ and V when ``pv_format="int8"`` (127; TurboAttention 119).
        v_granularity: scale grouping of V (``channel``: per head dim over all tokens;
            ``tensor``: one scale; ``block``: one per ``block_k`` tokens).
        p_from_block_max: quantize P̃ with a dynamic per-tile scale max(P̃)/``pv_qmax`` (TurboAttention)
            instead of the static scale 1/``pv_qmax`` (SageAttention2, INT-FlashAttention).
        l_from_quantized_p: accumulate the softmax denominator from the quantized P (INT-FlashAttention).
        two_level_accum: accumulate each block's P·V in its own register, then into FP32 (SageAttention2 §3.4).
        emulate_fp22: emulate the FP8-MMA accumulator (1-8-13 bits, truncation) measured on Ada/Hopper.
        exp: ``exact`` exp or ``sas`` (TurboAttention LUT × cubic polynomial with threshold).
        sas_threshold: n_r: scores with s − m < n_r get probability 0.
        block_q, block_k, warps: tile sizes and warps per query block that define the quantization groups.
    """

    numerics: str = _knob("none", choices=NUMERICS)
    qk_format: str = _knob("fp16", choices=QK_FORMATS)
    qk_granularity: str = _knob("token", choices=GRANULARITIES)
    qk_qmax: int = _knob(127, ge=1)
    smooth_k: bool = False
    smooth_q: bool = False
    smooth_v: bool = False
    pv_format: str = _knob("fp16", choices=PV_FORMATS)
    pv_qmax: int = _knob(127, ge=1)
    v_granularity: str = _knob("channel", choices=V_GRANULARITIES)
    p_from_block_max: bool = False
    l_from_quantized_p: bool = False
    two_level_accum: bool = True
    emulate_fp22: bool = False
    exp: str = _knob("exact", choices=EXP_KINDS)
    sas_threshold: float = _knob(-6.0, ge=SAS_MIN_THRESHOLD, lt=0)
    block_q: int = _knob(128, ge=1)
    block_k: int = _knob(64, ge=1)
    warps: int = _knob(4, ge=1)

    def _check_combination(self) -> None:
        owner = "AttentionConfig"
        if self.qk_format == "int4" and self.qk_qmax > 7:
            raise ValueError(f"{owner}.qk_qmax={self.qk_qmax} exceeds the INT4 range [-7, 7]")
        if self.qk_format == "int8" and self.qk_qmax > 127:
            raise ValueError(f"{owner}.qk_qmax={self.qk_qmax} exceeds the INT8 range [-127, 127]")
        if self.pv_format == "int8" and self.pv_qmax > 127:
            raise ValueError(f"{owner}.pv_qmax={self.pv_qmax} exceeds the INT8 range [-127, 127]")
        if self.block_q % self.warps:
            raise ValueError(f"{owner}.block_q={self.block_q} must be a multiple of warps={self.warps}")
        if self.qk_granularity == "thread" and ((self.block_q // self.warps) % 8 or self.block_k % 8):
            raise ValueError(f"{owner}: per-thread groups need block_q/warps and block_k to be multiples of 8")
        if self.emulate_fp22 and not self.pv_format.startswith("fp8"):
            raise ValueError(f"{owner}.emulate_fp22 models the FP8 MMA accumulator; it needs an fp8 pv_format")
        if self.emulate_fp22 and not self.two_level_accum and (self.p_from_block_max or self.v_granularity == "block"):
            raise ValueError(f"{owner}: a single-level FP22 accumulator needs static P and V scales")

    @property
    def quantized(self) -> bool:
        return self.numerics != "none"


@dataclass(frozen=True)
class KVCacheConfig(_JsonConfig):
    """Compressed KV cache.

    Attributes:
        kind: ``none``, ``turbo`` (TurboAttention FlashQ: INT8 symmetric then INT4/INT2
            asymmetric channel-wise per block) or ``fireq`` (INT4 per-token, post-RoPE).
        bits: storage bits of the high-precision heads (4).
        low_bits: storage bits of the low-priority heads (2, TurboAttention only).
        two_bit_heads: number of KV heads per layer stored in ``low_bits`` (an int), or a
            fraction of the KV heads (a float in [0, 1]); chosen by priority = gap × std.
        buffer_tokens: n_b: decode tokens buffered in INT8 before compression.
        int8_qmax: symmetric INT8 range of the first quantization step (TurboAttention uses 119).
        crs_pairs: FireQ: number of outlier RoPE pairs per head scaled post-RoPE (CRS).
    """

    kind: str = _knob("none", choices=KV_KINDS)
    bits: int = _knob(4, choices=(2, 4, 8))
    low_bits: int = _knob(2, choices=(2, 4))
    two_bit_heads: float = _knob(0, ge=0)
    buffer_tokens: int = _knob(64, ge=1)
    int8_qmax: int = _knob(119, ge=1, le=127)
    crs_pairs: int = _knob(8, ge=0)

    def _check_combination(self) -> None:
        if isinstance(self.two_bit_heads, float) and self.two_bit_heads > 1:
            raise ValueError(f"KVCacheConfig.two_bit_heads={self.two_bit_heads}: an int is a head count, a float a "
                             "fraction of the KV heads in [0, 1]")


@dataclass(frozen=True)
class LinearConfig(_JsonConfig):
    """Quantized linear layers: FireQ W4A8-FP, or FP8 weights and activations.

    Attributes:
        kind: ``none``; ``w4a8_fp8`` (INT4 weights with FP8 group scales, FP8 activations; made by
            ``quantpatch.convert``); or ``fp8`` (e4m3 weights per output channel, e4m3 activations per
            token; swapped in by ``patch_model``, no calibration: :mod:`quantpatch.fp8_linear`).
        group_size: input-dimension group sharing one weight scale (128; ``w4a8_fp8`` only).
        cas: merge channel-wise absmean scaling into the weights offline (``w4a8_fp8`` only).
        pts: apply the per-tensor 2^n scaling that prevents FP8-scale underflow (``w4a8_fp8`` only).
        include: module-name substrings to quantize (empty: ``w4a8_fp8`` every decoder linear but the LM
            head, ``fp8`` every linear of the transformer blocks).
        fast_accum: ``fp8`` only: the GPU's FP8 GEMM accumulates in the tensor cores' own precision
            (``torch._scaled_mm(..., use_fast_accum=True)``) instead of promoting its partial sums to float32.
            Off: the GEMM follows the float32-accumulation reference. On (measured on an H100, Wan2.1 and
            Llama-3-8B projection shapes): the GEMM runs 1.15-1.31x as fast; on outputs whose products have mixed
            signs its relative L1 error against float32 accumulation grows from about 1e-4 to 4e-4 (K = 1536) up
            to 1.7e-3 (K = 14336), but a sum of K products of one sign comes out low by up to K / 2^15 of itself
            (5 % at K = 4096, 17 % at K = 14336 measured): an opt-in for models checked with it, never a default.
            The CPU reference keeps float32 accumulation.
    """

    kind: str = _knob("none", choices=LINEAR_KINDS)
    group_size: int = _knob(128, ge=1)
    cas: bool = True
    pts: bool = True
    include: tuple[str, ...] = ()
    fast_accum: bool = False

    def _check_combination(self) -> None:
        if self.fast_accum and self.kind != "fp8":
            raise ValueError(f"LinearConfig.fast_accum is an option of kind 'fp8', not of {self.kind!r}")


@dataclass(frozen=True)
class ModeConfig(_JsonConfig):
    """A named preset of attention, KV-cache and linear settings, versioned for checkpoints."""

    name: str
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)
    linear: LinearConfig = field(default_factory=LinearConfig)
    version: int = _knob(CONFIG_VERSION, ge=1)

    _PARTS: ClassVar[dict[str, type]] = {
        "attention": AttentionConfig,
        "kv_cache": KVCacheConfig,
        "linear": LinearConfig,
    }

    def _check_combination(self) -> None:
        if not self.name.strip():
            raise ValueError("ModeConfig.name must be a non-empty string")
        if self.version > CONFIG_VERSION:
            raise ValueError(
                f"ModeConfig version {self.version} is newer than this quantpatch understands ({CONFIG_VERSION}); "
                "upgrade quantpatch to load it"
            )

    @classmethod
    def _keywords(cls, data: dict[str, Any]) -> dict[str, Any]:
        """A dict of an older ``version`` is first upgraded (:data:`MIGRATIONS`); the parts are parsed."""
        data = _upgrade(data)
        for part, part_cls in cls._PARTS.items():
            if part in data:
                data[part] = part_cls.from_dict(data[part])
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModeConfig:
        return cls.from_dict(json.loads(text))

    def with_options(self, **options: Any) -> ModeConfig:
        """Override fields by dotted name, e.g. ``with_options(**{"attention.smooth_q": False})``.

        A bare name is looked up in the attention, KV-cache and linear parts (it must be
        unambiguous). Unknown names raise ``ValueError`` listing the valid ones.
        """
        parts = {name: getattr(self, name) for name in self._PARTS}
        for key, value in options.items():
            part, _, attr = key.rpartition(".")
            if not part:
                owners = [p for p, cfg in parts.items() if attr in {f.name for f in fields(cfg)}]
                if len(owners) != 1:
                    valid = sorted(f"{p}.{f.name}" for p, cfg in parts.items() for f in fields(cfg))
                    raise ValueError(f"unknown or ambiguous mode option {key!r}; valid options are {valid}")
                part = owners[0]
            if part not in parts:
                raise ValueError(f"unknown option group {part!r}; valid groups are {sorted(parts)}")
            parts[part] = parts[part].replace(**{attr: value})
        return dataclasses.replace(self, **parts)


def _v1_to_v2(data: dict[str, Any]) -> dict[str, Any]:
    """Version 2 turned smooth Q off in the ``sage2-8b`` preset; a version-1 ``sage2-8b`` dict without it meant on."""
    attention = data.get("attention")
    if data.get("name") == "sage2-8b" and isinstance(attention, dict) and "smooth_q" not in attention:
        return {**data, "attention": {**attention, "smooth_q": True}}
    return data


# MIGRATIONS[v] upgrades a version-v ModeConfig dict to version v + 1 with the same meaning.
MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {1: _v1_to_v2}


def _upgrade(data: dict[str, Any]) -> dict[str, Any]:
    """A copy of a ModeConfig dict at :data:`CONFIG_VERSION` (a bad ``version`` is left for validation to name)."""
    data = dict(data)
    version = data.get("version", CONFIG_VERSION)
    if isinstance(version, int) and not isinstance(version, bool) and 1 <= version < CONFIG_VERSION:
        for v in range(version, CONFIG_VERSION):
            data = MIGRATIONS[v](data)
        data["version"] = CONFIG_VERSION
    return data
