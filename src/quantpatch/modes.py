"""The mode registry: named presets of :class:`~quantpatch.config.ModeConfig`.

| mode | attention | KV cache | linear | paper |
| --- | --- | --- | --- | --- |
| ``off`` | full precision | — | — | — |
| ``sage2-8b`` | Q,K INT8 per-thread, smooth K, P̃/V FP8 (1/448, per-channel), two-level P·V | — | — | SageAttention2 |
| ``sage2-4b`` | as ``sage2-8b`` with Q,K INT4 ([-7, 7]) and smooth Q | — | — | SageAttention2 |
| ``int8-flash`` | Q,K INT8 per-token, V INT8 per-tensor, P = round(127·P̃), l from P | — | — | INT-FlashAttention |
| ``turbo`` | Q,K,V INT8 per block (absmax/119), SAS exp, P INT8 per tile | INT8 → INT4/INT2 | — | TurboAttention |
| ``fireq`` | Q,K per-token FP8, V FP8 per-tensor, P̃ FP8 | INT4 per-token | W4A8-FP8 | FireQ |

``sage2-8b`` is SageAttention2's Hopper 8-bit kernel, which has every technique of the paper's §3
except smooth Q (§4.1, Implementation). ``with_options(smooth_q=True)`` adds it back; config version 1
had it on by default, and version-1 configs and checkpoints still load with it on. ``sage2-4b`` keeps
smooth Q, the paper's remedy for INT4 Q·Kᵀ (§3.1).
Both sage2 modes also smooth V (the paper's optional §3.4 technique): with FP8 P̃ and a
denominator summed from the unquantized P̃, the P̃ rounding error is multiplied by V's channel
bias; subtracting mean(V) removes it (rel-L1 0.0205 → 0.0061 on channel-biased V, neutral on
N(0, 1), 0-3% kernel time).

Every mode takes FP8 linear layers as an option: ``get_mode(name, linear="fp8")`` (or
``patch_model(model, name, linear="fp8")``) swaps the transformer blocks' ``nn.Linear`` layers for
:class:`~quantpatch.fp8_linear.FP8Linear` (e4m3 weights per output channel, e4m3 activations per token).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from quantpatch.config import LINEAR_KINDS, AttentionConfig, KVCacheConfig, LinearConfig, ModeConfig

_SAGE2_8B = AttentionConfig(
    numerics="sage2",
    qk_format="int8",
    qk_granularity="thread",
    qk_qmax=127,
    smooth_k=True,
    smooth_q=False,
    smooth_v=True,
    pv_format="fp8_e4m3",
    v_granularity="channel",
    two_level_accum=True,
)

MODES: dict[str, ModeConfig] = {
    "off": ModeConfig(name="off"),
    "sage2-8b": ModeConfig(name="sage2-8b", attention=_SAGE2_8B),
    "sage2-4b": ModeConfig(name="sage2-4b", attention=_SAGE2_8B.replace(qk_format="int4", qk_qmax=7, smooth_q=True)),
    "int8-flash": ModeConfig(
        name="int8-flash",
        attention=AttentionConfig(
            numerics="int8_flash",
            qk_format="int8",
            qk_granularity="token",
            qk_qmax=127,
            pv_format="int8",
            v_granularity="tensor",
            l_from_quantized_p=True,
            two_level_accum=False,
        ),
    ),
    "turbo": ModeConfig(
        name="turbo",
        attention=AttentionConfig(
            numerics="turbo",
            qk_format="int8",
            qk_granularity="block",
            qk_qmax=119,
            pv_format="int8",
            pv_qmax=119,
            v_granularity="block",
            p_from_block_max=True,
            two_level_accum=False,
            exp="sas",
            sas_threshold=-6.0,
            block_q=64,
            block_k=64,
        ),
        kv_cache=KVCacheConfig(kind="turbo", bits=4, low_bits=2, two_bit_heads=0.5, buffer_tokens=64, int8_qmax=119),
    ),
    "fireq": ModeConfig(
        name="fireq",
        attention=AttentionConfig(
            numerics="fireq",
            qk_format="fp8_e4m3",
            qk_granularity="token",
            pv_format="fp8_e4m3",
            v_granularity="tensor",
            two_level_accum=False,
        ),
        kv_cache=KVCacheConfig(kind="fireq", bits=4, crs_pairs=8),
        linear=LinearConfig(kind="w4a8_fp8", group_size=128, cas=True, pts=True),
    ),
}


def available_modes() -> list[str]:
    """Names of the registered modes."""
    return sorted(MODES)


def linear_config(current: LinearConfig, linear: str | LinearConfig) -> LinearConfig:
    """The linear part that ``linear`` selects: a :class:`LinearConfig` as given, or a kind name, which gives
    ``LinearConfig(kind=linear)`` (``current`` itself where it already has that kind)."""
    if isinstance(linear, LinearConfig):
        return linear
    if not isinstance(linear, str) or linear not in LINEAR_KINDS:
        raise ValueError(f"linear={linear!r} is not valid; choose one of {list(LINEAR_KINDS)} or pass a LinearConfig")
    return current if current.kind == linear else LinearConfig(kind=linear)


def get_mode(mode: str | ModeConfig, *, linear: str | LinearConfig | None = None, **options: Any) -> ModeConfig:
    """Resolve a mode name (or a ready :class:`ModeConfig`) and apply option overrides.

    Args:
        mode: a registered mode name or a ``ModeConfig``.
        linear: the linear layers: a kind (``"none"``, ``"w4a8_fp8"``, ``"fp8"``; see :func:`linear_config`)
            or a :class:`LinearConfig`; ``None`` keeps the mode's. Applied before ``options``.
        options: field overrides by (dotted) name, as :meth:`ModeConfig.with_options`.

    Raises:
        ValueError: the mode is unknown (the message lists the valid ones), or ``linear`` or an option is.
    """
    if isinstance(mode, ModeConfig):
        config = mode
    elif isinstance(mode, str) and mode in MODES:
        config = MODES[mode]
    else:
        raise ValueError(f"unknown quantpatch mode {mode!r}; valid modes are {available_modes()}")
    if linear is not None and linear_config(config.linear, linear) is not config.linear:
        config = dataclasses.replace(config, linear=linear_config(config.linear, linear))
    return config.with_options(**options) if options else config
