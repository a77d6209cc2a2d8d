"""Reference quantizers: hand-computed examples and the documented groupings, matched exactly."""

import pytest
import torch

from quantpatch.kernels.attention.sas_ref import sas_exp, sas_lut
from quantpatch.kernels.quant_ref import (
    cast_fp8,
    dequantize_asymmetric_int,
    quantize_asymmetric_int,
    quantize_channels,
    quantize_tokens,
    token_group_index,
    truncate_fp22,
)


def groups_as_sets(index: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(index == g).flatten().tolist()) for g in range(int(index.max()) + 1)]


def test_per_thread_query_groups_match_sageattention2_appendix_a6():
    # b_q = 128, c_w = 4 warps: query rows i, 8+i, 16+i, 24+i of each warp share one scale.
    index = token_group_index(256, "thread", role="q", block=128, warps=4)
    groups = groups_as_sets(index)
    assert len(groups) == 64  # 32 groups per 128-row block
    assert groups[0] == {0, 8, 16, 24}
    assert groups[7] == {7, 15, 23, 31}
    assert groups[8] == {32, 40, 48, 56}
    assert groups[31] == {103, 111, 119, 127}
    assert groups[32] == {128, 136, 144, 152}


def test_per_thread_key_groups_match_sageattention2_appendix_a6():
    # b_k = 64: key rows 8k+2i and 8k+2i+1 share one scale, 4 groups per block.
    index = token_group_index(128, "thread", role="k", block=64)
    groups = groups_as_sets(index)
    assert len(groups) == 8
    assert groups[0] == {8 * j + d for j in range(8) for d in (0, 1)}
    assert groups[3] == {8 * j + d for j in range(8) for d in (6, 7)}
    assert groups[4] == {64 + 8 * j + d for j in range(8) for d in (0, 1)}


@pytest.mark.parametrize(
    "granularity, role, expected",
    [
        ("tensor", "q", [0] * 10),
        ("token", "q", list(range(10))),
        ("block", "q", [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]),
        ("warp", "q", [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]),
        ("warp", "k", [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]),  # warps share the K block
    ],
)
def test_coarse_groupings(granularity, role, expected):
    assert token_group_index(10, granularity, role=role, block=4, warps=2).tolist() == expected


def test_int8_per_token_hand_example():
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0]])
    q, scale = quantize_tokens(x, "token", role="q", qmax=127, block=128)
    # row 0: scale 2/127; 1/(2/127) = 63.5 rounds half-to-even to 64, 0.5 → 31.75 → 32
    assert q.tolist() == [[64.0, -127.0, 32.0], [0.0, 0.0, 0.0]]
    assert scale.flatten().tolist() == [pytest.approx(2 / 127), 1.0]  # an all-zero row gets scale 1


def test_int4_per_token_rounds_half_to_even():
    x = torch.tensor([[1.0, -3.5, 0.25, 0.75]])
    q, scale = quantize_tokens(x, "token", role="q", qmax=7, block=128)
    assert scale.item() == 0.5
    assert q.tolist() == [[2.0, -7.0, 0.0, 2.0]]  # 0.5 → 0 and 1.5 → 2 (half to even)


def test_per_block_scale_is_shared_by_the_block():
    x = torch.tensor([[1.0], [4.0], [2.0], [-8.0], [0.5]])
    q, scale = quantize_tokens(x, "block", role="k", qmax=7, block=2)
    assert torch.equal(scale.flatten(), torch.tensor([4.0, 4.0, 8.0, 8.0, 0.5]) / 7)
    assert q.flatten().tolist() == [2.0, 7.0, 2.0, -7.0, 7.0]


def test_per_thread_quantization_uses_each_groups_absmax():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 200, 16)
    q, scale = quantize_tokens(x, "thread", role="q", qmax=127, block=128, warps=4)
    index = token_group_index(200, "thread", role="q", block=128, warps=4)
    for g in range(int(index.max()) + 1):
        rows = index == g
        expected = x[:, :, rows].abs().amax(dim=(-2, -1)) / 127
        torch.testing.assert_close(scale[:, :, rows, 0], expected[..., None].expand(-1, -1, int(rows.sum())))
    assert q.abs().max() == 127 and torch.equal(q, torch.round(q))


def test_per_channel_quantization():
    x = torch.tensor([[1.0, -4.0], [-2.0, 1.0]])
    q, scale = quantize_channels(x, qmax=127)
    assert torch.equal(scale, torch.tensor([[2.0, 4.0]]) / 127)
    assert q.tolist() == [[64.0, -127.0], [-127.0, 32.0]]  # 63.5 → 64, 31.75 → 32


def test_fp8_casts_saturate_and_round_to_nearest_even():
    x = torch.tensor([500.0, -1000.0, 1.0625, 1.1875, 3e-4])
    # E4M3: max 448, spacing 1/8 in [1, 2) (ties to even), smallest subnormal 2^-9 ≈ 1.95e-3
    assert cast_fp8(x, "fp8_e4m3").tolist() == [448.0, -448.0, 1.0, 1.25, 0.0]
    assert cast_fp8(torch.tensor([1e6, 1.125]), "fp8_e5m2").tolist() == [57344.0, 1.0]


def test_fp22_truncation_keeps_13_mantissa_bits():
    x = torch.tensor([1 + 2**-13, 1 + 2**-14, 1 + 2**-23, -(1 + 2**-12 + 2**-20)], dtype=torch.float32)
    assert truncate_fp22(x).tolist() == [1 + 2**-13, 1.0, 1.0, -(1 + 2**-12)]
    with pytest.raises(TypeError):
        truncate_fp22(x.double())


def test_asymmetric_int4_hand_example():
    x = torch.tensor([[-119.0], [-50.0], [0.0], [119.0]])
    q, s, z = quantize_asymmetric_int(x, bits=4, dim=0)
    # s = round(238 / 15) = 16, z = round(-119 / 16) = -7, q = round(x/16 + 7) clamped to [0, 15]
    assert (s.item(), z.item()) == (16.0, -7.0)
    assert q.flatten().tolist() == [0.0, 4.0, 7.0, 14.0]
    assert dequantize_asymmetric_int(q, s, z).flatten().tolist() == [-112.0, -48.0, 0.0, 112.0]


def test_asymmetric_int2_range_and_constant_channel():
    x = torch.tensor([[3.0, 5.0], [3.0, -5.0], [3.0, 0.0]])
    q, s, z = quantize_asymmetric_int(x, bits=2, dim=0)
    assert q.min() >= 0 and q.max() <= 3
    assert s[0, 0] == 1  # a constant channel keeps the minimum integer scale 1 and is exact
    assert torch.equal(dequantize_asymmetric_int(q, s, z)[:, 0], x[:, 0])


def test_sas_hand_values():
    x = torch.tensor([0.0, -1.5, -6.0, -6.01, float("-inf")])
    poly_half = -0.1025 * 0.125 + 0.4626 * 0.25 - 0.9922 * 0.5 + 0.9996
    expected = [0.9996, torch.e**-1 * poly_half, torch.e**-6 * 0.9996, 0.0, 0.0]
    torch.testing.assert_close(sas_exp(x), torch.tensor(expected), rtol=1e-6, atol=0)
    assert len(sas_lut(-6.0)) == 7


def test_sas_tracks_exp_above_threshold():
    x = torch.linspace(-6, 0, 10001, dtype=torch.float64)
    assert (sas_exp(x) - torch.exp(x)).abs().max() < 1e-3
