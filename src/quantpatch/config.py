"""Frozen, versioned configuration dataclasses for every quantpatch mode.

A mode is a :class:`ModeConfig`: an attention numerics preset (:class:`AttentionConfig`),
a KV-cache preset (:class:`KVCacheConfig`) and a linear-layer preset
(:class:`LinearConfig`). Every field is a knob one of the seed papers varies; each class
validates itself in ``__post_init__`` and round-trips through JSON. Unknown fields or
values raise ``ValueError`` naming the valid ones.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

CONFIG_VERSION = 1

# Value sets shared by validation and by error messages.
NUMERICS = ("none", "sage2", "int8_flash", "turbo", "fireq")
QK_FORMATS = ("int8", "int4", "fp8_e4m3", "fp16", "none")
GRANULARITIES = ("tensor", "block", "warp", "thread", "token")
PV_FORMATS = ("fp8_e4m3", "fp8_e5m2", "int8", "fp16", "none")
V_GRANULARITIES = ("tensor", "block", "channel")
EXP_KINDS = ("exact", "sas")
KV_KINDS = ("none", "turbo", "fireq")
LINEAR_KINDS = ("none", "w4a8_fp8")


def _check_choice(owner: str, name: str, value: Any, valid: tuple) -> None:
    if value not in valid:
        raise ValueError(f"{owner}.{name}={value!r} is not valid; choose one of {list(valid)}")


def _check_positive(owner: str, name: str, value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{owner}.{name} must be a positive int, got {value!r}")


class _JsonConfig:
    """JSON round trip and validated ``replace`` shared by the config dataclasses."""

    KIND: ClassVar[str] = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        valid = {f.name for f in fields(cls)}
        unknown = set(data) - valid
        if unknown:
            raise ValueError(f"unknown {cls.__name__} field(s) {sorted(unknown)}; valid fields are {sorted(valid)}")
        return cls(**data)

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

    numerics: str = "none"
    qk_format: str = "fp16"
    qk_granularity: str = "token"
    qk_qmax: int = 127
    smooth_k: bool = False
    smooth_q: bool = False
    smooth_v: bool = False
    pv_format: str = "fp16"
    pv_qmax: int = 127
    v_granularity: str = "channel"
    p_from_block_max: bool = False
    l_from_quantized_p: bool = False
    two_level_accum: bool = True
    emulate_fp22: bool = False
    exp: str = "exact"
    sas_threshold: float = -6.0
    block_q: int = 128
    block_k: int = 64
    warps: int = 4

    def __post_init__(self) -> None:
        owner = "AttentionConfig"
        _check_choice(owner, "numerics", self.numerics, NUMERICS)
        _check_choice(owner, "qk_format", self.qk_format, QK_FORMATS)
        _check_choice(owner, "qk_granularity", self.qk_granularity, GRANULARITIES)
        _check_choice(owner, "pv_format", self.pv_format, PV_FORMATS)
        _check_choice(owner, "v_granularity", self.v_granularity, V_GRANULARITIES)
        _check_choice(owner, "exp", self.exp, EXP_KINDS)
        for name in ("block_q", "block_k", "warps", "qk_qmax", "pv_qmax"):
            _check_positive(owner, name, getattr(self, name))
        if self.qk_format == "int4" and self.qk_qmax > 7:
            raise ValueError(f"{owner}.qk_qmax={self.qk_qmax} exceeds the INT4 range [-7, 7]")
        if self.qk_format == "int8" and self.qk_qmax > 127:
            raise ValueError(f"{owner}.qk_qmax={self.qk_qmax} exceeds the INT8 range [-127, 127]")
        if self.block_q % self.warps:
            raise ValueError(f"{owner}.block_q={self.block_q} must be a multiple of warps={self.warps}")
        if self.qk_granularity == "thread" and ((self.block_q // self.warps) % 8 or self.block_k % 8):
            raise ValueError(f"{owner}: per-thread groups need block_q/warps and block_k to be multiples of 8")
        if self.emulate_fp22 and not self.pv_format.startswith("fp8"):
            raise ValueError(f"{owner}.emulate_fp22 models the FP8 MMA accumulator; it needs an fp8 pv_format")
        if self.emulate_fp22 and not self.two_level_accum and (self.p_from_block_max or self.v_granularity == "block"):
            raise ValueError(f"{owner}: a single-level FP22 accumulator needs static P and V scales")
        if self.sas_threshold >= 0:
            raise ValueError(f"{owner}.sas_threshold must be negative, got {self.sas_threshold}")

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

    kind: str = "none"
    bits: int = 4
    low_bits: int = 2
    two_bit_heads: float = 0
    buffer_tokens: int = 64
    int8_qmax: int = 119
    crs_pairs: int = 8

    def __post_init__(self) -> None:
        owner = "KVCacheConfig"
        _check_choice(owner, "kind", self.kind, KV_KINDS)
        _check_choice(owner, "bits", self.bits, (2, 4, 8))
        _check_choice(owner, "low_bits", self.low_bits, (2, 4))
        _check_positive(owner, "buffer_tokens", self.buffer_tokens)
        if self.two_bit_heads < 0 or (isinstance(self.two_bit_heads, float) and self.two_bit_heads > 1):
            raise ValueError(f"{owner}.two_bit_heads must be an int >= 0 or a fraction in [0, 1]")


@dataclass(frozen=True)
class LinearConfig(_JsonConfig):
    """Quantized linear layers (FireQ W4A8-FP).

    Attributes:
        kind: ``none`` or ``w4a8_fp8`` (INT4 weights with FP8 group scales, FP8 activations).
        group_size: input-dimension group sharing one weight scale (128).
        cas: merge channel-wise absmean scaling into the weights offline.
        pts: apply the per-tensor 2^n scaling that prevents FP8-scale underflow.
        include: module-name substrings to quantize (empty: every ``nn.Linear`` but the LM head).
    """

    kind: str = "none"
    group_size: int = 128
    cas: bool = True
    pts: bool = True
    include: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        owner = "LinearConfig"
        _check_choice(owner, "kind", self.kind, LINEAR_KINDS)
        _check_positive(owner, "group_size", self.group_size)
        object.__setattr__(self, "include", tuple(self.include))


@dataclass(frozen=True)
class ModeConfig(_JsonConfig):
    """A named preset of attention, KV-cache and linear settings, versioned for checkpoints."""

    name: str
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)
    linear: LinearConfig = field(default_factory=LinearConfig)
    version: int = CONFIG_VERSION

    _PARTS: ClassVar[dict[str, type]] = {
        "attention": AttentionConfig,
        "kv_cache": KVCacheConfig,
        "linear": LinearConfig,
    }

    def __post_init__(self) -> None:
        if self.version > CONFIG_VERSION:
            raise ValueError(
                f"ModeConfig version {self.version} is newer than this quantpatch understands ({CONFIG_VERSION}); "
                "upgrade quantpatch to load it"
            )
        for part, cls in self._PARTS.items():
            if not isinstance(getattr(self, part), cls):
                raise ValueError(f"ModeConfig.{part} must be a {cls.__name__}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModeConfig:
        data = dict(data)
        valid = {f.name for f in fields(cls)}
        unknown = set(data) - valid
        if unknown:
            raise ValueError(f"unknown ModeConfig field(s) {sorted(unknown)}; valid fields are {sorted(valid)}")
        for part, part_cls in cls._PARTS.items():
            if part in data:
                data[part] = part_cls.from_dict(data[part])
        return cls(**data)

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
