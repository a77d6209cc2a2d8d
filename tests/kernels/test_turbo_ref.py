"""TurboAttention KV-cache reference (kernels/turbo_kv/turbo_ref.py): BPQ, packing, buffer, memory, priority, decode."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from quantpatch.kernels.attention.attention_ref import attention_exact
from quantpatch.kernels.attention.sas_ref import sas_exp
from quantpatch.kernels.quant_ref import quantize_tokens
from quantpatch.kernels.turbo_kv.turbo_ref import (
    TURBO_QMAX,
    CompressedKV,
    Int8Buffer,
    compress_int8_blocks,
    decode_attention_config,
    head_bits,
    head_priority,
    map_width_codes,
    pack_codes,
    pack_int2,
    pack_int4,
    select_two_bit_heads,
    turbo_append_ref,
    turbo_compress_kv_ref,
    turbo_decode_attention_ref,
    turbo_decompress_kv_ref,
    turbo_kv_bytes,
    unpack_codes,
    unpack_int2,
    unpack_int4,
)
from quantpatch.metrics import cos_sim, rel_l1
from quantpatch.synthetic import attention_inputs
from tests.tolerances import TURBO_DECODE_COS_FLOOR


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- packing


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("shape", [(3, 5, 8), (1, 64), (2, 1, 7, 128)])
def test_pack_unpack_round_trip(bits, shape):
    gen = torch.Generator().manual_seed(bits)
    q = torch.randint(0, 2**bits, shape, generator=gen)
    packed = pack_codes(q, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (*shape[:-1], shape[-1] * bits // 8)
    assert torch.equal(unpack_codes(packed, bits), q.to(torch.uint8))


def test_pack_layout_and_errors():
    # INT4: low nibble = even channel; INT2: channel 4i + j at bits 2j.
    assert pack_int4(torch.tensor([1, 2, 15, 0])).tolist() == [0x21, 0x0F]
    assert pack_int2(torch.tensor([1, 2, 3, 0])).tolist() == [1 | 2 << 2 | 3 << 4]
    assert unpack_int4(torch.tensor([0x21], dtype=torch.uint8)).tolist() == [1, 2]
    assert unpack_int2(torch.tensor([0b11100100], dtype=torch.uint8)).tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="divisible"):
        pack_int2(torch.zeros(6))
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        pack_int4(torch.tensor([16, 0]))


# --------------------------------------------------------------------------- BPQ


def test_progressive_step_hand_example():
    # One block of 4 tokens × 4 channels with absmax 119, so the INT8 step is exact (s = 1).
    # Head 0 stored in INT4, head 1 (same data) in INT2.
    block = torch.tensor(
        [
            [-20.0, 7.0, 119.0, -1.0],
            [-3.0, 7.0, -119.0, 2.0],
            [10.0, 7.0, 0.0, -3.0],
            [40.0, 7.0, 1.0, 5.0],
        ]
    )
    x = torch.stack([block, block]).unsqueeze(0)  # (1, 2, 4, 4)
    ckv, buf = turbo_compress_kv_ref(x, (4, 2), block=4)
    assert buf.n_tokens == 0 and ckv.n_blocks == 1
    assert ckv.block_scale.tolist() == [[[1.0], [1.0]]]
    # INT4, L = 15, per channel:  s = max(1, round((max − min)/15)),  z = round(min/s)
    #   ch0: s = round(60/15) = 4,  z = −5, q = round(x/4 + 5) = [0, 4.25→4, 7.5→8 (half even), 15]
    #   ch1: constant → s = 1, z = 7, q = 0
    #   ch2: s = round(238/15 = 15.87) = 16, z = round(−7.44) = −7, q = [14.44→14, −0.44→0, 7, 7.06→7]
    #   ch3: s = round(8/15) = 1, z = −3, q = x + 3 = [2, 5, 0, 8]
    assert ckv.int_scale[0, 0, 0].tolist() == [4, 1, 16, 1]
    assert ckv.int_zero[0, 0, 0].tolist() == [-5, 7, -7, -3]
    assert unpack_int4(ckv.codes[0][0]).tolist() == [[0, 0, 14, 2], [4, 0, 0, 5], [8, 0, 7, 0], [15, 0, 7, 8]]
    # INT2, L = 3:
    #   ch0: s = 20, z = −1, q = round(x/20 + 1) = [0, 0.85→1, 1.5→2, 3]
    #   ch2: s = round(79.33) = 79, z = round(−1.51) = −2, q = [3.51→3 (clamped), 0.49→0, 2, 2]
    #   ch3: s = round(2.67) = 3, z = −1, q = round(x/3 + 1) = [0.67→1, 1.67→2, 0, 2.67→3]
    assert ckv.int_scale[0, 1, 0].tolist() == [20, 1, 79, 3]
    assert ckv.int_zero[0, 1, 0].tolist() == [-1, 7, -2, -1]
    assert unpack_int2(ckv.codes[1][0]).tolist() == [[0, 0, 3, 1], [1, 0, 0, 2], [2, 0, 2, 0], [3, 0, 2, 3]]
    values, scale = turbo_decompress_kv_ref(ckv)
    assert torch.equal(scale, torch.ones(1, 2, 4, 1))
    # (q + z)·s; the INT2 ch2 code 0 decodes to (0 − 2)·79 = −158 and saturates to −127.
    assert values[0, 0].tolist() == [[-20, 7, 112, -1], [-4, 7, -112, 2], [12, 7, 0, -3], [40, 7, 0, 5]]
    assert values[0, 1].tolist() == [[-20, 7, 79, 0], [0, 7, -127, 3], [20, 7, 0, -3], [40, 7, 0, 6]]


@pytest.mark.parametrize("n_tokens", [1, 64, 203, 256])
def test_decompress_error_bounds(n_tokens):
    b, h, d = 2, 3, 64
    x = _randn(b, h, n_tokens, d, seed=n_tokens)
    x[..., 5] *= 20.0  # an outlier channel, as real K caches have
    bits = (4, 2, 8)
    ckv, buf = turbo_compress_kv_ref(x, bits)
    n_full = (n_tokens // 64) * 64
    assert (ckv.n_tokens, buf.n_tokens) == (n_full, n_tokens - n_full)
    values, scale = turbo_decompress_kv_ref(ckv, buf)
    assert values.shape == x.shape and scale.shape == (b, h, n_tokens, 1)
    assert values.abs().max() <= 127 and torch.equal(values, values.round())

    # Step 1 is quant_ref's per-block symmetric INT8 with absmax / 119.
    q1, s1 = quantize_tokens(x[..., :n_full, :], "block", role="k", qmax=TURBO_QMAX, block=64)
    assert torch.equal(scale[..., :n_full, :], s1)
    s_int = ckv.int_scale.float().repeat_interleave(64, dim=2)  # (B, H, n_full, D)
    err = (values[..., :n_full, :] - q1).abs()
    for head, nbits in enumerate(bits):
        levels = 2**nbits - 1
        # Half a step inside the grid; at most (s^int + L)/2 where round(range / L) fell short of the top.
        assert torch.all(err[:, head] <= (s_int[:, head] + levels) / 2)
    assert torch.equal(err[:, 2], torch.zeros_like(err[:, 2]))  # 8-bit: s^int = 1, z^int = min → lossless
    # 4-bit never needs the INT8 saturation: |(q + z)·s| ≤ 119 + 16/2 = 127 before clamping.
    codes = unpack_int4(ckv.codes[0]).float().unflatten(-2, (-1, 64))  # (B, T, 64, D)
    raw = (codes + ckv.int_zero[:, 0, :, None].float()) * ckv.int_scale[:, 0, :, None].float()
    assert torch.all(raw.abs() <= 127)

    # The tail stays INT8 on the universal scale absmax(head) / 119.
    universal = x.abs().amax(dim=(-2, -1), keepdim=True) / TURBO_QMAX
    assert torch.allclose(buf.scale, universal)
    assert torch.equal(values[..., n_full:, :], torch.round(x[..., n_full:, :] / universal))

    # Float error: INT8 rounding plus the INT4/INT2 step above.
    x_hat = values * scale
    tol = scale * (0.5 + torch.cat([(s_int + 15) / 2, torch.zeros(b, h, n_tokens - n_full, d)], dim=2))
    assert torch.all((x_hat - x)[:, 0].abs() <= tol[:, 0] * (1 + 1e-6))


def test_four_bit_dequantization_stays_in_int8():
    # Adversarial block: every channel spans the full ±119, the case that maximizes s^int.
    x = torch.zeros(1, 1, 64, 128)
    x[..., 0::2, :] = 119.0
    x[..., 1::2, :] = -119.0
    x[..., 2, :] = torch.linspace(-119, 119, 128)
    ckv, _ = turbo_compress_kv_ref(x, 4)
    assert int(ckv.int_scale.max()) == 16
    values, _ = turbo_decompress_kv_ref(ckv)
    assert values.abs().max() <= 127
    ckv2, _ = turbo_compress_kv_ref(x, 2)
    assert int(ckv2.int_scale.max()) == 79  # 2-bit: decodes to −158 before saturation
    assert turbo_decompress_kv_ref(ckv2)[0].min() == -127


def test_buffer_append_and_flush():
    b, h, d = 1, 2, 32
    prompt = _randn(b, h, 100, d, seed=1)
    new = _randn(b, h, 60, d, seed=2)
    new[0, 0, 3, 7] = 1000.0  # far beyond the universal scale: clamped, buffer not re-quantized
    ckv, buf = turbo_compress_kv_ref(prompt, (4, 2))
    assert (ckv.n_blocks, buf.n_tokens) == (1, 36)

    one_by_one = (ckv, buf)
    for i in range(new.shape[-2]):
        one_by_one = turbo_append_ref(*one_by_one, new[..., i : i + 1, :])
    at_once = turbo_append_ref(ckv, buf, new)
    for got in (one_by_one, at_once):
        c, bf = got
        assert (c.n_blocks, bf.n_tokens) == (2, 32)
        assert torch.equal(bf.scale, buf.scale)
    assert all(torch.equal(a, b_) for a, b_ in zip(one_by_one[0].codes, at_once[0].codes))
    assert torch.equal(one_by_one[1].values, at_once[1].values)

    # The flushed block = step 2 of the INT8 buffer contents, with block scale = the universal scale.
    int8 = torch.cat([buf.values.float(), torch.clamp(torch.round(new / buf.scale), -119, 119)], dim=-2)
    assert int8[0, 0, 36 + 3, 7] == 119
    expected = compress_int8_blocks(int8[..., :64, :], buf.scale[..., 0], (4, 2))
    c = at_once[0]
    assert torch.equal(c.int_scale[:, :, 1:], expected.int_scale)
    assert torch.equal(c.int_zero[:, :, 1:], expected.int_zero)
    assert torch.equal(c.block_scale[:, :, 1:], expected.block_scale)
    assert all(torch.equal(a[:, 64:], e) for a, e in zip(c.codes, expected.codes))
    assert torch.equal(at_once[1].values.float(), int8[..., 64:, :])
    values, scale = turbo_decompress_kv_ref(*at_once)
    assert values.shape[-2] == 160 and torch.equal(scale[..., 64:, :], buf.scale.expand(b, h, 96, 1))


def test_container_validation():
    ckv, buf = turbo_compress_kv_ref(_randn(1, 2, 64, 16, seed=0), 4)
    with pytest.raises(ValueError, match="codes"):
        CompressedKV(ckv.codes, ckv.int_scale, ckv.int_zero, ckv.block_scale, bits=(4, 2))
    with pytest.raises(ValueError, match="int8"):
        Int8Buffer(values=buf.values.float(), scale=buf.scale)
    with pytest.raises(ValueError, match="per-head bit widths"):
        turbo_compress_kv_ref(_randn(1, 2, 64, 16, seed=0), (4, 4, 4))
    with pytest.raises(ValueError, match="not valid"):
        turbo_compress_kv_ref(_randn(1, 2, 64, 16, seed=0), 3)


def _storages(ckv: CompressedKV, heads: list[int]) -> set[int]:
    return {ckv.codes[h].untyped_storage().data_ptr() for h in heads}


def test_each_widths_codes_are_views_of_one_tensor_through_maps():
    """The reference stores a width's heads as views of one (B, H_w, N, ·) tensor, as the kernel does; a map of the
    codes gets that tensor itself (no copy) and leaves its result so; heads held apart are stacked first."""
    bits = (4, 2, 4, 4)
    ckv, _ = turbo_compress_kv_ref(_randn(3, 4, 128, 32, seed=0), bits)
    assert _storages(ckv, [0, 2, 3]) != _storages(ckv, [1]) and len(_storages(ckv, [0, 2, 3])) == 1
    assert all(a.data_ptr() == c.data_ptr() for a, c in zip(map_width_codes(lambda g: g, ckv), ckv.codes))
    idx = torch.tensor([2, 0])
    for held in (ckv, dataclasses.replace(ckv, codes=tuple(c.clone() for c in ckv.codes))):
        picked = map_width_codes(lambda g: g.index_select(0, idx), held)
        assert all(torch.equal(p, c[idx]) for p, c in zip(picked, ckv.codes))
        assert len({picked[h].untyped_storage().data_ptr() for h in (0, 2, 3)}) == 1
        assert [p.data_ptr() - picked[0].data_ptr() for p in (picked[2], picked[3])] == [128 * 16, 2 * 128 * 16]


# --------------------------------------------------------------------------- memory


def test_memory_ratios_d128(capsys):
    kv_heads, d = 8, 128
    half = (4, 2) * (kv_heads // 2)
    rows = []
    for n in (1024, 4096 + 17, 32768):
        bf16 = 2 * kv_heads * n * d
        r4 = bf16 / turbo_kv_bytes(n, d, 4, kv_heads=kv_heads)
        r_mixed = bf16 / turbo_kv_bytes(n, d, half)
        rows.append((n, r4, r_mixed))
        assert r4 >= 3.5 and r_mixed >= 4.4
    with capsys.disabled():
        for n, r4, r_mixed in rows:
            print(f"\nturbo KV bytes vs bf16, D=128, N={n}: 4-bit {r4:.3f}x, half heads 2-bit {r_mixed:.3f}x")
    # 1k tokens: 16 blocks × (4096 code + 256 s/z + 2 scale) bytes + 2 (universal scale) per head.
    assert turbo_kv_bytes(1024, d, 4) == 16 * (4096 + 256 + 2) + 2
    assert rows[0][1] == pytest.approx(262144 / 69666) and rows[0][2] == pytest.approx(2 * 262144 / (69666 + 36898))


def test_memory_formula_matches_storage():
    x = _randn(2, 4, 203, 128, seed=3)
    bits = (4, 2, 2, 4)
    ckv, buf = turbo_compress_kv_ref(x, bits)
    # The reference keeps float32 block scales; the formula's default counts FP16 (the paper's).
    assert ckv.nbytes() + buf.nbytes() == turbo_kv_bytes(203, 128, bits, batch=2, scale_bytes=4)


# --------------------------------------------------------------------------- head priority


def test_priority_hand_example():
    x = torch.tensor([[[[0.0, 1.0, 2.0], [4.0, 1.0, 0.0]], [[1.0, 1.0, 1.0], [3.0, 3.0, 3.0]]]])  # (1, 2, 2, 3)
    # head 0: gap = 4 − 0, channel gaps [4, 0, 2] → std = sqrt(8/3); head 1: equal channel gaps → std 0.
    assert head_priority(x).tolist() == pytest.approx([4 * math.sqrt(8 / 3), 0.0])


def test_priority_outlier_head_ranks_higher():
    x = _randn(2, 4, 256, 64, seed=4)
    x[:, 1, :, [3, 40]] *= 10.0  # head 1: two outlier channels
    x[:, 3] *= 1.5  # head 3: larger but flat
    p = head_priority(x)
    assert p[1] > 10 * p[3] and p.argmax() == 1
    assert select_two_bit_heads(p, 3).tolist() == [0, 2, 3]
    assert head_bits(p, 0.5) == (2, 4, 2, 4)


def test_select_two_bit_heads_counts_and_ties():
    p = torch.tensor([3.0, 1.0, 1.0, 2.0, 5.0, 0.5])
    assert select_two_bit_heads(p, 2).tolist() == [1, 5]  # tie between heads 1 and 2 → lower index
    assert select_two_bit_heads(p, 0.5).tolist() == [1, 2, 5]
    assert select_two_bit_heads(p, 0.25).tolist() == [1, 5]  # 1.5 heads rounds half up to 2
    assert select_two_bit_heads(p, 0).tolist() == [] and select_two_bit_heads(p, 1.0).numel() == 6
    assert head_bits(p, 2, bits=4, low_bits=2) == (4, 2, 4, 4, 4, 2)
    with pytest.raises(ValueError):
        select_two_bit_heads(p, 7)


def _heads_that_differ(seed: int, kv_heads: int = 8, n: int = 256, d: int = 128):
    """randn Q/K/V where a random half of the KV heads has 4 K and 4 V channels 8× larger."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, kv_heads, 1, d, generator=gen)
    k = torch.randn(1, kv_heads, n, d, generator=gen)
    v = torch.randn(1, kv_heads, n, d, generator=gen)
    for head in torch.randperm(kv_heads, generator=gen)[: kv_heads // 2].tolist():
        k[:, head, :, torch.randperm(d, generator=gen)[:4]] *= 8.0
        v[:, head, :, torch.randperm(d, generator=gen)[:4]] *= 8.0
    return q, k, v, gen


def _decode_error(q, k, v, bits_k, bits_v) -> float:
    k_cache, k_buf = turbo_compress_kv_ref(k, bits_k)
    v_cache, v_buf = turbo_compress_kv_ref(v, bits_v)
    o = turbo_decode_attention_ref(q, k_cache, v_cache, k_buffer=k_buf, v_buffer=v_buf)
    return rel_l1(o, attention_exact(q, k, v))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_priority_mixed_precision_beats_random(seed):
    q, k, v, gen = _heads_that_differ(seed)
    bits_k, bits_v = head_bits(head_priority(k), 0.5), head_bits(head_priority(v), 0.5)
    chosen = _decode_error(q, k, v, bits_k, bits_v)
    random_errors = []
    for _ in range(3):
        low_k = set(torch.randperm(8, generator=gen)[:4].tolist())
        low_v = set(torch.randperm(8, generator=gen)[:4].tolist())
        rand_k = tuple(2 if h in low_k else 4 for h in range(8))
        rand_v = tuple(2 if h in low_v else 4 for h in range(8))
        random_errors.append(_decode_error(q, k, v, rand_k, rand_v))
    assert chosen < sum(random_errors) / len(random_errors), (chosen, random_errors)
    # Bracketed by all-4-bit and all-2-bit.
    assert _decode_error(q, k, v, 4, 4) < chosen < _decode_error(q, k, v, 2, 2)


# --------------------------------------------------------------------------- decode attention


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("kind", ["randn", "outliers"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decode_cos_sim_d128(kind, bits, seed):
    q, k, v = attention_inputs(kind, heads=8, kv_heads=4, seq_q=1, seq_k=1024, head_dim=128, seed=seed)
    k_cache, k_buf = turbo_compress_kv_ref(k, bits)
    v_cache, v_buf = turbo_compress_kv_ref(v, bits)
    o = turbo_decode_attention_ref(q, k_cache, v_cache, k_buffer=k_buf, v_buffer=v_buf)
    assert cos_sim(o, attention_exact(q, k, v)) >= TURBO_DECODE_COS_FLOOR[kind][bits]


def test_decode_chunk_causal_with_buffer():
    # 4 new query tokens at the end of a 1000-token cache (15 blocks + 40 buffered), GQA, causal.
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 4, 64, generator=gen)
    k = torch.randn(2, 2, 1000, 64, generator=gen)
    v = torch.randn(2, 2, 1000, 64, generator=gen)
    k_cache, k_buf = turbo_compress_kv_ref(k, 8)
    v_cache, v_buf = turbo_compress_kv_ref(v, 8)
    o, lse = turbo_decode_attention_ref(q, k_cache, v_cache, k_buffer=k_buf, v_buffer=v_buf, return_lse=True)
    ref, ref_lse = attention_exact(q, k, v, is_causal=True, return_lse=True)
    assert cos_sim(o, ref) >= TURBO_DECODE_COS_FLOOR["randn"][8]
    assert torch.allclose(lse.double(), ref_lse, atol=2e-2)
    with pytest.raises(ValueError, match="block_k"):
        turbo_decode_attention_ref(q, k_cache, v_cache, cfg=decode_attention_config().replace(block_k=128))


def _algorithm2(q, k_q, v_q, sm_scale, block=64, qmax=119):
    """TurboAttention Algorithm 2 written out for one query token and Hkv = H (no engine)."""
    s_q = q.abs().amax(dim=-1, keepdim=True) / qmax
    q1 = torch.round(q / s_q)
    (k1, s_k), (v1, s_v) = k_q, v_q
    m = torch.full_like(q[..., :1], float("-inf"))
    ell = torch.zeros_like(m)
    o = torch.zeros_like(q)
    for j0 in range(0, k1.shape[-2], block):
        kj, vj = k1[..., j0 : j0 + block, :], v1[..., j0 : j0 + block, :]
        s = s_q * s_k[..., j0 : j0 + block, :].transpose(-1, -2) * (q1 @ kj.transpose(-1, -2)) * sm_scale
        m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
        p = sas_exp(s - m_new)
        alpha = sas_exp(m - m_new)
        ell = alpha * ell + p.sum(dim=-1, keepdim=True)
        s_p = p.amax(dim=-1, keepdim=True) / qmax
        # One V scale per block: the block's s_V (the first token's, all tokens of a block share it).
        o = alpha * o + s_p * s_v[..., j0 : j0 + 1, :] * (torch.round(p / s_p) @ vj)
        m = m_new
    return o / ell


def test_decode_matches_algorithm2():
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(2, 3, 1, 128, generator=gen)
    k = torch.randn(2, 3, 300, 128, generator=gen)
    v = torch.randn(2, 3, 300, 128, generator=gen)
    k_cache, k_buf = turbo_compress_kv_ref(k, (4, 2, 4))
    v_cache, v_buf = turbo_compress_kv_ref(v, (2, 4, 4))
    o = turbo_decode_attention_ref(q, k_cache, v_cache, k_buffer=k_buf, v_buffer=v_buf)
    expected = _algorithm2(
        q, turbo_decompress_kv_ref(k_cache, k_buf), turbo_decompress_kv_ref(v_cache, v_buf), 128**-0.5
    )
    assert torch.allclose(o, expected, rtol=1e-5, atol=1e-6)
