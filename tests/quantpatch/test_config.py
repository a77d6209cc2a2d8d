"""Mode registry and config dataclasses: frozen, validated, JSON round trip, clear errors."""

import dataclasses

import pytest

import quantpatch as qp
from quantpatch.config import CONFIG_VERSION, AttentionConfig, KVCacheConfig, ModeConfig

EXPECTED_MODES = ["fireq", "int8-flash", "off", "sage2-4b", "sage2-8b", "turbo"]


def test_registry_has_the_brief_modes():
    assert qp.available_modes() == EXPECTED_MODES


@pytest.mark.parametrize("name", EXPECTED_MODES)
def test_json_round_trip(name):
    mode = qp.get_mode(name)
    assert ModeConfig.from_json(mode.to_json()) == mode
    assert mode.version == CONFIG_VERSION


def test_mode_numerics_follow_the_papers():
    s4, s8 = qp.get_mode("sage2-4b").attention, qp.get_mode("sage2-8b").attention
    assert (s4.qk_format, s4.qk_qmax, s4.qk_granularity) == ("int4", 7, "thread")
    assert (s8.qk_format, s8.qk_qmax, s8.pv_format, s8.v_granularity) == ("int8", 127, "fp8_e4m3", "channel")
    assert s4.smooth_q and s4.smooth_k and s4.smooth_v and s4.two_level_accum
    flash = qp.get_mode("int8-flash").attention
    assert (flash.qk_granularity, flash.v_granularity, flash.pv_format, flash.l_from_quantized_p) == (
        "token", "tensor", "int8", True,
    )
    turbo = qp.get_mode("turbo")
    assert (turbo.attention.qk_qmax, turbo.attention.exp, turbo.attention.sas_threshold) == (119, "sas", -6.0)
    assert (turbo.kv_cache.buffer_tokens, turbo.kv_cache.bits, turbo.kv_cache.low_bits) == (64, 4, 2)
    fireq = qp.get_mode("fireq")
    assert (fireq.linear.kind, fireq.linear.group_size, fireq.kv_cache.crs_pairs) == ("w4a8_fp8", 128, 8)


def test_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        qp.get_mode("sage2-8b").attention.smooth_q = False


def test_unknown_mode_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown quantpatch mode 'sage3'.*sage2-8b"):
        qp.get_mode("sage3")


def test_options_by_dotted_or_bare_name():
    mode = qp.get_mode("sage2-4b", **{"attention.smooth_q": False, "two_level_accum": False})
    assert not mode.attention.smooth_q and not mode.attention.two_level_accum
    assert qp.get_mode("sage2-4b").attention.smooth_q  # the registry entry is untouched


@pytest.mark.parametrize(
    "options, message",
    [
        ({"smooth_x": True}, "unknown or ambiguous mode option 'smooth_x'.*attention.smooth_q"),
        ({"attention.nope": 1}, "unknown AttentionConfig option"),
        ({"cache.bits": 4}, "unknown option group 'cache'"),
        ({"qk_format": "int3"}, r"qk_format='int3' is not valid; choose one of \['int8'"),
        ({"qk_qmax": 100, "qk_format": "int4"}, "exceeds the INT4 range"),
        ({"emulate_fp22": True, "pv_format": "int8"}, "needs an fp8 pv_format"),
        ({"sas_threshold": 1.0}, "must be negative"),
    ],
)
def test_invalid_options_raise(options, message):
    with pytest.raises(ValueError, match=message):
        qp.get_mode("sage2-4b", **options)


def test_unknown_json_fields_and_newer_versions_are_rejected():
    data = qp.get_mode("turbo").to_dict()
    with pytest.raises(ValueError, match="unknown KVCacheConfig field"):
        ModeConfig.from_dict({**data, "kv_cache": {**data["kv_cache"], "colour": "red"}})
    with pytest.raises(ValueError, match="newer than this quantpatch"):
        ModeConfig.from_dict({**data, "version": CONFIG_VERSION + 1})


def test_direct_construction_validates():
    with pytest.raises(ValueError, match="block_q=100 must be a multiple of warps=3"):
        AttentionConfig(block_q=100, warps=3)
    with pytest.raises(ValueError, match="two_bit_heads"):
        KVCacheConfig(two_bit_heads=1.5)
