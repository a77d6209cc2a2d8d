"""TurboAttention Triton kernels (compression, decode over the compressed cache) against ``turbo_ref``.

Without CUDA the kernels run in the Triton interpreter (``conftest.py``) on small shapes; the
``gpu``-marked tests run compiled on the device machine (larger shapes, the TurboCache wiring, the
decode speed target).

Bounds, and where they come from:
* compression: every stored tensor (packed codes, ``s^int``, ``z^int``, block scales, the buffer)
  equals ``turbo_compress_kv_ref`` / ``turbo_append_ref`` byte for byte.
* decode, one split (``num_splits=1``): the kernel follows the reference operation for operation
  (IEEE quotients, round-half-even, no FMA contraction, the same 64-key tiles and running max), so
  Q̂, K̂, V̂, P̂ and every dot are the same integers (the dots run on fp16 operands, exact: integers ≤ 2048,
  sums < 2²⁴; P̂'s quotient is one reciprocal per row plus Markstein's FMA correction, which is the IEEE
  quotient itself, so this bound did not move); only float sums run in another order (ℓ over
  64 keys, the rowsums), ≲ 64·2⁻²⁴ ≈ 4e-6 relative in the worst case, measured ≤ 8e-8 rel-L1 in the
  interpreter. SINGLE_SPLIT_REL_L1 = 1e-6: a single P̂ off by one (1/119 of a probability) would
  already move the output by more (≈ 1e-5 at these sizes).
* decode, several splits: each split takes P̃ against its own running max, so P̂ is another draw of
  the same INT8 rounding (finer for rows whose max lies in a later block: the reference quantizes
  their early tiles against a stale head max). The kernel must then be as accurate as the
  reference against float64 attention on the same dequantized cache: err(kernel) ≤ SPLIT_NOISE_FACTOR
  · err(ref); measured ratios 0.83-1.03 (randn and outliers, Nq 1-16, 2-16 splits).
"""

import warnings

import pytest
import torch

from quantpatch.kernels.attention.attention_ref import attention_exact
from quantpatch.kernels.turbo_kv.turbo_compress_triton import (
    turbo_append_buffer,
    turbo_compress_blocks,
    turbo_compress_int8_blocks,
)
from quantpatch.kernels.turbo_kv.turbo_decode_triton import (
    _WORKSPACES,
    GLUON,
    decode_plan,
    decode_unsupported,
    turbo_decode_attention,
)
from quantpatch.kernels.turbo_kv.turbo_ref import (
    decode_attention_config,
    turbo_append_ref,
    turbo_compress_kv_ref,
    turbo_decode_attention_ref,
    turbo_decompress_kv_ref,
)
from quantpatch.metrics import rel_l1
from quantpatch.synthetic import attention_inputs
from tests.gpu import DEVICE, needs_cuda

gpu = pytest.mark.gpu

SINGLE_SPLIT_REL_L1 = 1e-6
SPLIT_NOISE_FACTOR = 1.1


def _assert_same_cache(a, b):
    (ca, ba), (cb, bb) = a, b
    assert ca.bits == cb.bits and len(ca.codes) == len(cb.codes)
    for x, y in zip(ca.codes, cb.codes):
        assert x.dtype == y.dtype == torch.uint8 and torch.equal(x.cpu(), y.cpu())
    for name in ("int_scale", "int_zero", "block_scale"):
        x, y = getattr(ca, name).cpu(), getattr(cb, name).cpu()
        assert x.dtype == y.dtype and torch.equal(x, y), name
    assert torch.equal(ba.values.cpu(), bb.values.cpu()) and torch.equal(ba.scale.cpu(), bb.scale.cpu())


def _cache(kind, *, b, hkv, n, d, k_bits, v_bits, seed, appended=0):
    """K/V of ``n`` prefill tokens compressed by the reference, then ``appended`` decode tokens."""
    _, k, v = attention_inputs(kind, batch=b, heads=hkv, kv_heads=hkv, seq_q=1, seq_k=n + appended, head_dim=d,
                               seed=seed + 100)
    parts = []
    for x, bits in ((k, k_bits), (v, v_bits)):
        blocks, buf = turbo_compress_kv_ref(x[..., :n, :], bits)
        if appended:
            blocks, buf = turbo_append_ref(blocks, buf, x[..., n:, :])
        parts.append((blocks, buf))
    return parts


def _to_cpu(x):
    """A ``CompressedKV`` / ``Int8Buffer`` on the CPU (the reference's device)."""
    if hasattr(x, "codes"):
        return type(x)(tuple(c.cpu() for c in x.codes), x.int_scale.cpu(), x.int_zero.cpu(), x.block_scale.cpu(),
                       x.bits, x.block)
    return type(x)(x.values.cpu(), x.scale.cpu(), x.qmax)


def _to(parts, device):
    out = []
    for blocks, buf in parts:
        out.append((
            type(blocks)(tuple(c.to(device) for c in blocks.codes), blocks.int_scale.to(device),
                         blocks.int_zero.to(device), blocks.block_scale.to(device), blocks.bits, blocks.block),
            type(buf)(buf.values.to(device), buf.scale.to(device), buf.qmax),
        ))
    return out


# --------------------------------------------------------------------------- compression


@pytest.mark.parametrize("n, d, bits, dtype", [
    (1, 64, (4, 4), torch.float32),
    (63, 128, (2, 4), torch.bfloat16),
    (64, 64, (2, 2), torch.float16),
    (65, 128, (4, 2), torch.bfloat16),
    (200, 64, (4, 2, 2), torch.float32),
])
def test_compression_is_byte_exact(n, d, bits, dtype):
    x = attention_inputs("outliers", batch=2, heads=len(bits), seq_q=n, head_dim=d, seed=n)[1].to(DEVICE, dtype)
    ref = turbo_compress_kv_ref(x.cpu(), bits)
    got = turbo_compress_kv_ref(x, bits, compress_blocks=turbo_compress_blocks)
    _assert_same_cache(ref, got)
    new = attention_inputs("randn", batch=2, heads=len(bits), seq_q=70, head_dim=d, seed=n + 1)[1].to(DEVICE, dtype)
    ref = turbo_append_ref(*ref, new.cpu())
    got = turbo_append_ref(*got, new, compress_int8=turbo_compress_int8_blocks)
    assert ref[0].n_blocks == got[0].n_blocks == (n + 70) // 64
    _assert_same_cache(ref, got)


@pytest.mark.parametrize("m, n, dtype", [(0, 1, torch.float32), (37, 1, torch.bfloat16), (60, 3, torch.float16)])
def test_buffer_append_is_byte_exact_and_counts_the_clamps(m, n, dtype):
    """The one-launch append of decode tokens to a buffer short of a block: ``turbo_append_ref``'s buffer, and the
    count of new values whose ``|rne(x / s)|`` the clamp to ``±qmax`` cuts (the universal scale is made small, so
    the outliers clamp)."""
    x = attention_inputs("outliers", batch=2, heads=3, seq_q=m + n, head_dim=64, seed=m)[1].to(DEVICE, dtype)
    scale = x.float().abs().amax(dim=(-2, -1), keepdim=True) / (2 * 119)
    blocks, buffer = turbo_compress_kv_ref(x[..., :m, :], (4, 2, 4), buffer_scale=scale)
    new = x[..., m:, :]
    clamped = torch.full((1,), 5, dtype=torch.int32, device=DEVICE)  # the count adds to what it holds
    got = turbo_append_buffer(new, buffer, clamped)
    ref_blocks, ref_buffer = turbo_append_ref(blocks, buffer, new)
    assert ref_blocks.n_blocks == blocks.n_blocks == 0 and got.n_tokens == m + n
    assert got.values.dtype == torch.int8 and torch.equal(got.values.cpu(), ref_buffer.values.cpu())
    assert got.scale is buffer.scale and got.qmax == buffer.qmax
    cut = int((torch.round(new.float() / scale).abs() > buffer.qmax).sum())
    assert cut > 0 and int(clamped) == 5 + cut
    with pytest.raises(ValueError, match="short of a block"):
        turbo_append_buffer(torch.zeros(2, 3, 64 - m, 64, device=DEVICE, dtype=dtype), buffer, clamped)


def _one_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` are views of one tensor, ``b`` one head further (``(B, H_w, N, ·)``, dim 1)."""
    return (a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.stride() == b.stride()
            and b.data_ptr() - a.data_ptr() == a.shape[-2] * a.shape[-1])


def test_compressed_codes_are_views_of_one_tensor_per_width():
    """As the compression kernel stores them, and so do appends of blocks (the decode kernels' code offsets, part
    of their compiled variant, keep one pattern from one block to the next)."""
    x = torch.randn(1, 3, 128, 64, device=DEVICE)
    blocks = turbo_compress_blocks(x, (4, 2, 4))
    assert blocks.codes[0].shape == (1, 128, 32) and blocks.codes[1].shape == (1, 128, 16)
    assert _one_tensor(blocks.codes[0], blocks.codes[2])
    buffer = turbo_compress_kv_ref(x[..., :0, :], (4, 2, 4), buffer_scale=torch.ones(1, 3, 1, 1, device=DEVICE))[1]
    assert _one_tensor(*turbo_compress_kv_ref(x.cpu(), (4, 2, 4))[0].codes[::2])  # and so does the reference
    for compress_int8 in (turbo_compress_int8_blocks, None):  # the kernel, the reference
        kwargs = {} if compress_int8 is None else dict(compress_int8=compress_int8)
        grown = turbo_append_ref(blocks, buffer, torch.randn(1, 3, 64, 64, device=DEVICE), **kwargs)[0]
        assert grown.n_blocks == 3 and _one_tensor(grown.codes[0], grown.codes[2])
    with pytest.raises(ValueError, match="whole blocks"):
        turbo_compress_blocks(x[..., :100, :], 4)
    with pytest.raises(ValueError, match="code widths"):
        turbo_compress_blocks(x, 8)


# --------------------------------------------------------------------------- decode


DECODE_CASES = [  # (context, appended decode tokens, q_len, D, K bits, V bits, KV heads, query heads per KV head)
    (1, 0, 1, 64, (4, 4), (4, 4), 2, 2),  # buffer only
    (63, 0, 1, 128, (4, 2), (2, 4), 2, 3),  # buffer of 63, mixed bits, GQA 3
    (64, 0, 1, 64, (2, 2), (4, 4), 2, 4),  # one block, empty buffer
    (65, 0, 3, 128, (4,), (4,), 1, 4),  # one block + 1 buffered, causal q_len 3, MQA-like 4 heads per KV head
    (200, 0, 1, 64, (4, 2), (4, 2), 2, 2),  # 3 blocks + 8 buffered
    (100, 40, 16, 64, (2, 4), (4, 4), 2, 2),  # appended block (universal scale), buffer of 12, q_len 16
]


@pytest.mark.parametrize("n, appended, nq, d, k_bits, v_bits, hkv, group", DECODE_CASES)
def test_decode_one_split_follows_the_reference(n, appended, nq, d, k_bits, v_bits, hkv, group):
    (kc, kb), (vc, vb) = _cache("randn", b=2, hkv=hkv, n=n, d=d, k_bits=k_bits, v_bits=v_bits, seed=n,
                                appended=appended)
    q = attention_inputs("randn", batch=2, heads=hkv * group, kv_heads=hkv, seq_q=nq, head_dim=d, seed=n)[0]
    ref = turbo_decode_attention_ref(q, kc, vc, k_buffer=kb, v_buffer=vb)
    (kc, kb), (vc, vb) = _to([(kc, kb), (vc, vb)], DEVICE)
    out = turbo_decode_attention(q.to(DEVICE), kc, vc, kb, vb, num_splits=1, out_dtype=torch.float32)
    assert torch.isfinite(out).all()
    assert rel_l1(out.cpu(), ref) <= SINGLE_SPLIT_REL_L1


@pytest.mark.parametrize("kind, n, nq, splits", [("randn", 1000, 1, 4), ("randn", 256, 16, 2),
                                                 ("outliers", 1000, 5, 3)])
def test_decode_splits_are_as_accurate_as_the_reference(kind, n, nq, splits):
    hkv, group, d = 2, 2, 128
    (kc, kb), (vc, vb) = _cache(kind, b=1, hkv=hkv, n=n, d=d, k_bits=(4, 2), v_bits=(2, 4), seed=7)
    q = attention_inputs(kind, batch=1, heads=hkv * group, kv_heads=hkv, seq_q=nq, head_dim=d, seed=7)[0]
    (kv, ks), (vv, vs) = turbo_decompress_kv_ref(kc, kb), turbo_decompress_kv_ref(vc, vb)
    exact = attention_exact(q, kv * ks, vv * vs, is_causal=True)
    ref = turbo_decode_attention_ref(q, kc, vc, k_buffer=kb, v_buffer=vb)
    (kc, kb), (vc, vb) = _to([(kc, kb), (vc, vb)], DEVICE)
    out = turbo_decode_attention(q.to(DEVICE), kc, vc, kb, vb, num_splits=splits, out_dtype=torch.float32).cpu()
    assert rel_l1(out, exact) <= SPLIT_NOISE_FACTOR * rel_l1(ref, exact)


@pytest.mark.parametrize("group, nq, lanes, n, splits", [(4, 1, 0, 64 * 7 + 5, 2), (4, 1, 2, 64 * 9, 3),
                                                        (2, 2, 0, 64 * 6 + 63, 2), (4, 1, 4, 64 * 4, 1)])
def test_decode_lanes_on_code_views_are_as_accurate_as_the_reference(group, nq, lanes, n, splits):
    """Lanes (key blocks stacked in one 16-row tile, each row its own running state, merged like splits) on
    the stored layout of ``turbo_compress_blocks`` (each head's codes a view of one tensor per width)."""
    hkv, d = 2, 128
    _, k, v = attention_inputs("outliers", batch=2, heads=hkv, kv_heads=hkv, seq_q=1, seq_k=n, head_dim=d, seed=n)
    kc, kb = turbo_compress_kv_ref(k.to(DEVICE), (4, 4), compress_blocks=turbo_compress_blocks)
    vc, vb = turbo_compress_kv_ref(v.to(DEVICE), (2, 4), compress_blocks=turbo_compress_blocks)
    assert not kc.codes[1].is_contiguous()
    q = attention_inputs("outliers", batch=2, heads=hkv * group, kv_heads=hkv, seq_q=nq, head_dim=d, seed=n)[0]
    (kv, ks), (vv, vs) = turbo_decompress_kv_ref(kc, kb), turbo_decompress_kv_ref(vc, vb)
    exact = attention_exact(q, (kv * ks).cpu(), (vv * vs).cpu(), is_causal=True)
    ref = turbo_decode_attention_ref(q, *(_to_cpu(x) for x in (kc, vc)), k_buffer=_to_cpu(kb), v_buffer=_to_cpu(vb))
    if splits == 1:
        with pytest.raises(ValueError, match="lanes=1"):
            turbo_decode_attention(q.to(DEVICE), kc, vc, kb, vb, num_splits=1, lanes=lanes)
        return
    out = turbo_decode_attention(q.to(DEVICE), kc, vc, kb, vb, num_splits=splits, lanes=lanes,
                                 out_dtype=torch.float32).cpu()
    assert torch.isfinite(out).all()
    assert rel_l1(out, exact) <= SPLIT_NOISE_FACTOR * rel_l1(ref, exact)


def test_decode_split_merge_in_the_launch_is_deterministic_and_resets_its_counters():
    """The last split of each (batch, KV head) merges the partials in split order: the same call twice gives the
    same bits, and every ticket counter is back at zero for the next call (mixed widths: two launches)."""
    (kc, kb), (vc, vb) = _to(_cache("randn", b=2, hkv=2, n=64 * 6 + 5, d=64, k_bits=(4, 2), v_bits=(4, 4), seed=5),
                             DEVICE)
    q = torch.randn(2, 8, 1, 64, device=DEVICE)
    first, second = (turbo_decode_attention(q, kc, vc, kb, vb, num_splits=3, out_dtype=torch.float32)
                     for _ in range(2))
    assert torch.equal(first, second)
    assert _WORKSPACES and all(int(ws[-1].abs().sum()) == 0 for ws in _WORKSPACES.values())


def test_decode_plan_gives_the_full_calls_bits_on_new_queries_and_buffers():
    """A plan made once for a layout and these blocks (two launches: mixed widths) serves later decode steps, whose
    queries and buffers are new tensors: the bits of the full call on each."""
    (kc, kb), (vc, vb) = _to(_cache("randn", b=2, hkv=2, n=64 * 3 + 5, d=64, k_bits=(4, 2), v_bits=(4, 4), seed=9),
                             DEVICE)
    cfg = decode_attention_config()
    q = torch.randn(2, 8, 1, 64, device=DEVICE)
    planned = decode_plan(q, kc, vc, cfg=cfg, is_causal=False)
    for step in range(3):
        q = torch.randn(2, 8, 1, 64, device=DEVICE)
        kb, vb = (type(buf)(torch.cat([buf.values, buf.values[..., :1, :]], dim=-2), buf.scale, buf.qmax)
                  for buf in (kb, vb))
        assert torch.equal(planned(q, kb, vb), turbo_decode_attention(q, kc, vc, kb, vb, cfg=cfg, is_causal=False))


def test_decode_bf16_output_is_the_float32_output_rounded():
    (kc, kb), (vc, vb) = _to(_cache("randn", b=1, hkv=2, n=130, d=64, k_bits=4, v_bits=4, seed=3), DEVICE)
    q = torch.randn(1, 4, 1, 64, device=DEVICE).to(torch.bfloat16)
    out32 = turbo_decode_attention(q, kc, vc, kb, vb, num_splits=2, out_dtype=torch.float32)
    out16 = turbo_decode_attention(q, kc, vc, kb, vb, num_splits=2)
    assert out16.dtype == torch.bfloat16
    # bf16 keeps 8 significant bits: |rounding| ≤ 2⁻⁸ relative (2⁻⁷ where the interpreter's cast truncates)
    assert ((out16.float() - out32).abs() <= out32.abs() * 2**-7).all()


def test_decode_declines_what_it_does_not_take():
    parts = [p for pair in _cache("randn", b=1, hkv=2, n=70, d=64, k_bits=4, v_bits=4, seed=0) for p in pair]
    kc, kb, vc, vb = parts
    q = torch.randn(1, 4, 1, 64)
    assert decode_unsupported(q, kc, vc, kb, vb) is None
    assert "head_dim" in decode_unsupported(torch.randn(1, 4, 1, 96), kc, vc, kb, vb)
    assert "q_len" in decode_unsupported(torch.randn(1, 4, 17, 64), kc, vc, kb, vb)
    assert "multiple" in decode_unsupported(torch.randn(1, 3, 1, 64), kc, vc, kb, vb)
    cfg = decode_attention_config()
    assert "numerics" in decode_unsupported(q, kc, vc, kb, vb, cfg.replace(exp="exact"))
    assert "numerics" in decode_unsupported(q, kc, vc, kb, vb, cfg.replace(sas_threshold=-4.0))
    eight = turbo_compress_kv_ref(torch.randn(1, 2, 70, 64), 8)[0]
    assert "code widths" in decode_unsupported(q, eight, vc, kb, vb)
    with pytest.raises(ValueError, match="head_dim"):
        turbo_decode_attention(torch.randn(1, 4, 1, 96), kc, vc, kb, vb)


# --------------------------------------------------------------------------- GPU


@gpu
@needs_cuda
def test_gpu_decode_at_llama_shape_matches_the_reference():
    torch.manual_seed(0)
    (kc, kb), (vc, vb) = _cache("outliers", b=2, hkv=8, n=4096 + 37, d=128, k_bits=(4, 2) * 4, v_bits=(4,) * 8,
                                seed=11)
    q = attention_inputs("outliers", batch=2, heads=32, kv_heads=8, seq_q=1, head_dim=128, seed=11)[0]
    ref = turbo_decode_attention_ref(q, kc, vc, k_buffer=kb, v_buffer=vb)
    (kv, ks), (vv, vs) = turbo_decompress_kv_ref(kc, kb), turbo_decompress_kv_ref(vc, vb)
    exact = attention_exact(q, kv * ks, vv * vs)
    (kc, kb), (vc, vb) = _to([(kc, kb), (vc, vb)], "cuda")
    one = turbo_decode_attention(q.cuda(), kc, vc, kb, vb, num_splits=1, out_dtype=torch.float32).cpu()
    assert rel_l1(one, ref) <= SINGLE_SPLIT_REL_L1
    split = turbo_decode_attention(q.cuda(), kc, vc, kb, vb, out_dtype=torch.float32).cpu()
    assert rel_l1(split, exact) <= SPLIT_NOISE_FACTOR * rel_l1(ref, exact)


@gpu
@needs_cuda
def test_gpu_turbo_layer_uses_the_kernels_and_falls_back_once():
    from quantpatch.fallback import QuantpatchFallbackWarning, reset_fallback_warnings
    from quantpatch.patches.transformers.turbo_cache import TurboLayer, turbo_cache_attention

    k, v = torch.randn(2, 2, 8, 150, 128).to(torch.bfloat16)
    layers = {}
    for device in ("cpu", "cuda"):
        layer = TurboLayer(8, 128, (4, 2) * 4, (2, 4) * 4)
        layer.update(k[..., :130, :].to(device), v[..., :130, :].to(device))
        for i in range(130, 150):  # 20 decode steps: the buffer fills and is compressed once
            layer.update(k[..., i:i + 1, :].to(device), v[..., i:i + 1, :].to(device), direct=True)
        layers[device] = layer
    cpu, gpu_layer = layers["cpu"], layers["cuda"]
    _assert_same_cache((cpu.k_blocks, cpu.k_buffer), (gpu_layer.k_blocks, gpu_layer.k_buffer))
    _assert_same_cache((cpu.v_blocks, cpu.v_buffer), (gpu_layer.v_blocks, gpu_layer.v_buffer))
    q = torch.randn(2, 32, 1, 128).to(torch.bfloat16)
    ref = turbo_cache_attention(q, cpu).float()
    out = turbo_cache_attention(q.cuda(), gpu_layer).float().cpu()
    assert rel_l1(out, ref) <= 1e-2  # bf16 output rounding: ≈ 1.4e-3 rel-L1 (tests/kernels/test_attention_triton)
    reset_fallback_warnings()
    odd = TurboLayer(2, 96, 4)
    odd.update(torch.randn(1, 2, 70, 96, device="cuda"), torch.randn(1, 2, 70, 96, device="cuda"))
    odd.update(torch.randn(1, 2, 1, 96, device="cuda"), torch.randn(1, 2, 1, 96, device="cuda"), direct=True)
    qo = torch.randn(1, 4, 1, 96, device="cuda")
    with pytest.warns(QuantpatchFallbackWarning, match="decode kernel: head_dim 96"):
        first = turbo_cache_attention(qo, odd)
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        second = turbo_cache_attention(qo, odd)
    assert not [w for w in again if issubclass(w.category, QuantpatchFallbackWarning)]
    assert torch.equal(first, second) and torch.equal(first, turbo_cache_attention(qo, odd, use_kernel=False))


@gpu
@needs_cuda
def test_gpu_turbo_cache_attention_plans_once_per_block_count_with_the_same_bits():
    """A layer's decode steps run its planned call, made at the first step after each block is compressed: the full
    kernel call's bits at every step (80 steps, the buffer filling twice)."""
    from quantpatch.patches.transformers.turbo_cache import TurboLayer, cache_attention_config, turbo_cache_attention

    torch.manual_seed(0)
    k, v = torch.randn(2, 2, 4, 200, 128, device="cuda").to(torch.bfloat16)
    layer = TurboLayer(4, 128, 4)
    layer.update(k[..., :120, :], v[..., :120, :])
    plans = []  # held, so that no two of them share an id
    for i in range(120, 200):
        layer.update(k[..., i:i + 1, :], v[..., i:i + 1, :], direct=True)
        q = torch.randn(2, 16, 1, 128, device="cuda").to(torch.bfloat16)
        out = turbo_cache_attention(q, layer)
        plans.append(layer.planned_decode[3])
        full = turbo_decode_attention(q, layer.k_blocks, layer.v_blocks, layer.k_buffer, layer.v_buffer,
                                      cfg=cache_attention_config(None, 64))
        assert torch.equal(out, full)
    assert layer.k_blocks.n_blocks == 3 and len({id(plan) for plan in plans}) == 3
    if torch.cuda.get_device_capability()[0] == 9:  # the Gluon kernel served them (bf16, one split and several)
        assert GLUON.unsupported(q.device) is None
