"""TurboAttention's per-head KV bit widths as the patched cache reads them.

:class:`HeadPrecision` is plain data (JSON round trip, versioned): the code width of every layer's K and V
heads, with the priorities and absmax they were calibrated from. ``quantpatch.TurboCache(model,
head_bits=...)`` takes it; :func:`head_precision_of` reads the widths a turbo conversion (or a loaded turbo
checkpoint) left on a model. Calibrating them is :mod:`quantpatch.methods.turbo`; this module is kept apart
from it so that patching a model does not import the calibration stack.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from quantpatch.config import KVCacheConfig, ModeConfig
from quantpatch.modes import get_mode

logger = logging.getLogger("quantpatch")

HEAD_PRECISION_VERSION = 2  # 2: the free-text list is ``remarks``
RANKINGS = ("joint", "separate")


def check_ranking(ranking: str) -> None:
    if ranking not in RANKINGS:
        raise ValueError(f"ranking={ranking!r} is not valid; choose one of {list(RANKINGS)}")


def _bits_table(rows: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(b) for b in row) for row in rows)


def _float_table(rows: Sequence[Sequence[float]]) -> tuple[tuple[float, ...], ...]:
    return tuple(tuple(float(p) for p in row) for row in rows)


@dataclass(frozen=True)
class HeadPrecision:
    """Per-layer, per-KV-head code widths of the TurboAttention cache, with the priorities behind them.

    Attributes:
        k_bits / v_bits: ``L`` rows of ``Hkv`` widths (2 or 4; 8 allowed) for the K and the V cache.
        k_priority / v_priority: the eq. 11 priorities the widths were chosen from (empty if chosen otherwise).
        k_absmax / v_absmax: ``L`` rows of ``Hkv`` calibrated ``max |x|`` (empty if not calibrated); the
            cache uses them as a floor of its INT8 buffer's universal scale, so that a short prompt does
            not fix a scale that later tokens overflow.
        n_h: the 2-bit heads per layer that were asked for: a count or a fraction of the ranked pool.
        ranking: ``joint`` (a layer's K and V heads ranked together, ``n_h`` of ``2·Hkv``) or ``separate``
            (K and V ranked each on its own, ``n_h`` of ``Hkv`` for each).
        method: ``"priority"`` (calibrated), ``"random"`` (ablation baseline) or ``"uniform"``.
        tokens: calibration tokens seen.
        version: format version of this record.
    """

    k_bits: tuple[tuple[int, ...], ...]
    v_bits: tuple[tuple[int, ...], ...]
    k_priority: tuple[tuple[float, ...], ...] = ()
    v_priority: tuple[tuple[float, ...], ...] = ()
    k_absmax: tuple[tuple[float, ...], ...] = ()
    v_absmax: tuple[tuple[float, ...], ...] = ()
    n_h: float = 0
    ranking: str = "joint"
    method: str = "priority"
    tokens: int = 0
    version: int = HEAD_PRECISION_VERSION
    remarks: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "k_bits", _bits_table(self.k_bits))
        object.__setattr__(self, "v_bits", _bits_table(self.v_bits))
        object.__setattr__(self, "k_priority", _float_table(self.k_priority))
        object.__setattr__(self, "v_priority", _float_table(self.v_priority))
        object.__setattr__(self, "k_absmax", _float_table(self.k_absmax))
        object.__setattr__(self, "v_absmax", _float_table(self.v_absmax))
        object.__setattr__(self, "remarks", tuple(self.remarks))
        check_ranking(self.ranking)
        if self.version > HEAD_PRECISION_VERSION:
            raise ValueError(f"HeadPrecision version {self.version} is newer than this quantpatch understands "
                             f"({HEAD_PRECISION_VERSION})")
        if len(self.k_bits) != len(self.v_bits):
            raise ValueError(f"HeadPrecision: {len(self.k_bits)} K rows but {len(self.v_bits)} V rows")
        widths = {len(row) for row in self.k_bits + self.v_bits}
        if len(widths) > 1:
            raise ValueError(f"HeadPrecision: rows have different head counts {sorted(widths)}")
        bad = sorted({b for row in self.k_bits + self.v_bits for b in row} - {2, 4, 8})
        if bad:
            raise ValueError(f"HeadPrecision: bit widths {bad} are not valid; choose from [2, 4, 8]")
        tables = ("k_priority", "v_priority", "k_absmax", "v_absmax")
        for name, table in ((t, getattr(self, t)) for t in tables):
            if table and [len(r) for r in table] != [len(r) for r in self.k_bits]:
                raise ValueError(f"HeadPrecision.{name} does not have the shape of k_bits")

    @property
    def num_layers(self) -> int:
        return len(self.k_bits)

    @property
    def kv_heads(self) -> int:
        return len(self.k_bits[0]) if self.k_bits else 0

    def layer_bits(self, layer: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(k_bits, v_bits)`` of one layer."""
        return self.k_bits[layer], self.v_bits[layer]

    def mean_bits(self) -> float:
        """Average code width over every K and V head (the paper's "Bit" column, codes only)."""
        all_bits = [b for row in self.k_bits + self.v_bits for b in row]
        return sum(all_bits) / len(all_bits) if all_bits else 0.0

    # -- plain data -----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "method": self.method,
            "n_h": self.n_h,
            "ranking": self.ranking,
            "tokens": self.tokens,
            "k_bits": [list(r) for r in self.k_bits],
            "v_bits": [list(r) for r in self.v_bits],
            "k_priority": [list(r) for r in self.k_priority],
            "v_priority": [list(r) for r in self.v_priority],
            "k_absmax": [list(r) for r in self.k_absmax],
            "v_absmax": [list(r) for r in self.v_absmax],
            "remarks": list(self.remarks),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HeadPrecision:
        """A record of this version, or an older one: the fields an older version had and this one has not (its
        free-text list, renamed in version 2) are dropped with a warning naming them."""
        valid = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - valid
        version = data.get("version", HEAD_PRECISION_VERSION)
        if unknown and isinstance(version, int) and version < HEAD_PRECISION_VERSION:
            logger.warning("HeadPrecision version %d record: dropping field(s) %s that version %d does not have",
                           version, sorted(unknown), HEAD_PRECISION_VERSION)
            data = {**{key: value for key, value in data.items() if key in valid}, "version": HEAD_PRECISION_VERSION}
        elif unknown:
            raise ValueError(f"unknown HeadPrecision field(s) {sorted(unknown)}; valid fields are {sorted(valid)}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> HeadPrecision:
        return cls.from_dict(json.loads(text))

    # -- report ---------------------------------------------------------------------
    def report(self) -> str:
        """One line per layer: the 2-bit K and V heads and the priorities they were ranked by."""
        lines = [
            f"TurboAttention head-wise KV precision ({self.method}, {self.ranking} ranking, n_h={self.n_h}, "
            f"{self.num_layers} layers × "
            f"{self.kv_heads} KV heads, mean {self.mean_bits():.2f} bits, {self.tokens} calibration tokens)"
        ]
        high = max((b for row in self.k_bits + self.v_bits for b in row), default=0)
        for i in range(self.num_layers):
            parts = []
            for name, bits, prio in (("K", self.k_bits, self.k_priority), ("V", self.v_bits, self.v_priority)):
                low = [h for h, b in enumerate(bits[i]) if b < high]
                pr = " ".join(f"{p:.3g}" for p in prio[i]) if prio else "-"
                parts.append(f"{name} bits {list(bits[i])} (low: {low}; priority {pr})")
            lines.append(f"  layer {i:>2}: " + "; ".join(parts))
        lines.extend(f"  note: {n}" for n in self.remarks)
        return "\n".join(lines)


def kv_config_of(config: KVCacheConfig | ModeConfig | str | None) -> KVCacheConfig:
    """The TurboAttention ``KVCacheConfig`` of a mode name, ``ModeConfig`` or ``KVCacheConfig`` (None: ``turbo``)."""
    if config is None:
        config = "turbo"
    if isinstance(config, str):
        config = get_mode(config)
    if isinstance(config, ModeConfig):
        config = config.kv_cache
    if not isinstance(config, KVCacheConfig):
        raise TypeError(f"expected a KVCacheConfig, ModeConfig or mode name, got {type(config).__name__}")
    if config.kind != "turbo":
        raise ValueError(f"KVCacheConfig.kind={config.kind!r}: TurboAttention head precision needs kind='turbo'")
    return config


def attention_modules(model: Any) -> dict[int, tuple[str, Any]]:
    """``layer_idx → (FQN, module)`` of the attention modules (an int ``layer_idx`` and K/V heads to group)."""
    found: dict[int, tuple[str, Any]] = {}
    for name, module in model.named_modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and hasattr(module, "num_key_value_groups"):
            found.setdefault(idx, (name, module))
    return found


def head_precision_of(model: Any) -> HeadPrecision | None:
    """The head widths a ``convert(mode="turbo")`` (or a loaded turbo checkpoint) left on ``model``, else None.

    Reads the site records of ``model._quantpatch_state.attention`` (``kv = "turbo"``, written by
    :func:`quantpatch.methods.turbo.convert_turbo`)."""
    state = getattr(model, "_quantpatch_state", None)
    entries = sorted((e for e in getattr(state, "attention", {}).values() if e.get("kv") == "turbo"),
                     key=lambda e: e["layer_idx"])
    if not entries:
        return None
    table = {key: [e[key] for e in entries] for key in ("k_bits", "v_bits", "k_priority", "v_priority",
                                                           "k_absmax", "v_absmax")}
    for key in ("k_priority", "v_priority", "k_absmax", "v_absmax"):
        if not all(table[key]):
            table[key] = []
    return HeadPrecision(**table, n_h=entries[0]["n_h"], ranking=entries[0]["ranking"], method="checkpoint")
