"""The Gluon TurboAttention decode kernel (``kernels/turbo_kv/turbo_decode_gluon.py``) against ``turbo_ref``.

Gluon has no interpreter: the kernel's tests run on an sm_90 GPU (``gpu`` marker), with the bounds of
``test_turbo_triton.py`` (same numerics): one split follows the reference operation for operation (the
integer parts exact, IEEE quotients, no FMA contraction; only float sums in another order), several splits are
as accurate as the reference against float64 attention on the same dequantized cache. On the CPU: which calls
the kernel takes, and the Triton kernel serving when the Gluon one does not compile.
"""

import logging

import pytest
import torch

from quantpatch.kernels.attention.attention_ref import attention_exact
from quantpatch.kernels.turbo_kv import turbo_decode_splits
from quantpatch.kernels.turbo_kv import turbo_decode_triton as tdt
from quantpatch.kernels.turbo_kv.turbo_ref import turbo_decode_attention_ref, turbo_decompress_kv_ref
from quantpatch.metrics import rel_l1
from quantpatch.synthetic import attention_inputs
from tests.gpu import DEVICE, needs_cuda
from tests.kernels.test_turbo_triton import SINGLE_SPLIT_REL_L1, SPLIT_NOISE_FACTOR, _cache, _to, _to_cpu

gpu = pytest.mark.gpu
tdg = pytest.importorskip("quantpatch.kernels.turbo_kv.turbo_decode_gluon",
                          reason="triton.experimental.gluon is missing")


def _on_sm90() -> bool:
    return torch.cuda.is_available() and tdt.GLUON.unsupported(torch.device("cuda")) is None


needs_sm90 = pytest.mark.skipif(not _on_sm90(), reason="the Gluon kernel runs on sm_90 GPUs only")


def test_gluon_kernel_takes_decode_steps_of_4bit_d128_caches():
    assert tdg.group_unsupported(4, 1, 128, 4, 4, 1) is None
    assert tdg.group_unsupported(8, 1, 128, 4, 4, 512) is None
    assert "q_len 2" in tdg.group_unsupported(4, 2, 128, 4, 4, 8)
    assert "9 query heads" in tdg.group_unsupported(9, 1, 128, 4, 4, 8)
    assert "head_dim 64" in tdg.group_unsupported(4, 1, 64, 4, 4, 8)
    assert "2-bit K" in tdg.group_unsupported(4, 1, 128, 2, 4, 8)
    assert "no compressed block" in tdg.group_unsupported(4, 1, 128, 4, 4, 0)
    assert not tdt.gluon_takes(torch.device("cpu"), 4, 1, 128, 4, 4, 8)


def test_default_splits_fill_one_wave_of_one_warp_programs(monkeypatch):
    monkeypatch.setattr(turbo_decode_splits, "_sm_count", lambda device: 132)
    dev = torch.device("cuda")
    assert tdg.default_num_splits(8, 8, 512, dev) == 8 * 132 // 64
    assert tdg.default_num_splits(1, 8, 512, dev) == tdg.MAX_SPLITS
    assert tdg.default_num_splits(1, 8, 20, dev) == 20 // turbo_decode_splits.MIN_BLOCKS_PER_SPLIT
    assert tdg.default_num_splits(64, 8, 512, dev) == 2


def test_decode_variant_blocks_are_the_shortest_cache_of_each_variant_a_generation_meets(monkeypatch):
    """What a TurboCache compiles at its prefill: on an H200 (132 SMs, Gluon), a uniform 4-bit cache from the empty
    one meets the Triton kernel over the buffer alone, then the Gluon kernel with one split and with several."""
    monkeypatch.setattr(turbo_decode_splits, "_sm_count", lambda device: 132)
    dev = torch.device("cuda")
    monkeypatch.setitem(tdt.GLUON.reasons, dev, None)
    four = (4,) * 8
    tdt.decode_variant_blocks.cache_clear()
    try:
        assert tdt.decode_variant_blocks(1, 4, four, four, 128, 0, dev) == (0, 1, 8)
        assert tdt.decode_variant_blocks(1, 4, four, four, 128, 5, dev) == (1, 8)
        assert tdt.decode_variant_blocks(8, 4, four, four, 128, 512, dev) == (8,)
        # the Triton kernel (head_dim 64): one split, one split over 16 lanes (one query head a KV head), several
        assert tdt.decode_variant_blocks(1, 1, four, four, 64, 0, dev) == (0, 8, 17)
    finally:
        tdt.decode_variant_blocks.cache_clear()


def test_a_gluon_kernel_that_does_not_compile_warns_once_and_triton_serves(monkeypatch, caplog):
    """A Triton whose Gluon API differs: the first call logs a warning, the Triton kernel serves that call and
    every later one (Gluon has no interpreter: its launcher is replaced by one that raises)."""
    import triton

    calls = []

    def launch(*args):
        calls.append(1)
        raise triton.CompilationError("def kernel(): ...", None, "no attribute 'thread_barrier'")

    device = torch.device(DEVICE)
    monkeypatch.setattr(tdt.GLUON, "reasons", {device: None})  # as on an sm_90 device
    monkeypatch.setattr(tdg, "launch", launch)
    (kc, kb), (vc, vb) = _to(_cache("randn", b=1, hkv=2, n=64 * 3 + 5, d=128, k_bits=(4, 4), v_bits=(4, 4), seed=3),
                             DEVICE)
    q = torch.randn(1, 8, 1, 128, device=DEVICE)
    with caplog.at_level(logging.WARNING, logger="quantpatch"):
        first, second = (tdt.turbo_decode_attention(q, kc, vc, kb, vb, num_splits=2) for _ in range(2))
    assert calls == [1]
    assert len([r for r in caplog.records if "does not compile with Triton" in r.getMessage()]) == 1
    want = tdt.turbo_decode_attention(q, kc, vc, kb, vb, num_splits=2, kernel="triton")
    assert torch.equal(first, want) and torch.equal(second, want)


def test_regular_head_layout_is_recognised():
    """Consecutive heads whose codes are evenly spaced by 16-byte multiples (one tensor per width, as
    ``turbo_compress_blocks`` stores them) skip the per-head offset table."""
    base = torch.zeros(8 * 4096, dtype=torch.uint8)
    views = [base[i * 4096:(i + 1) * 4096] for i in range(8)]
    def steps(heads, k_codes, v_codes):
        return tdt._regular_steps(tdt._group_offsets(heads, k_codes, v_codes))

    assert steps(tuple(range(8)), views, views) == (1024, 1024)
    assert steps((5,), views, views) == (0, 0)
    assert steps((0, 2, 4), views, views) is None  # not consecutive
    uneven = [base[i * 4100:i * 4100 + 16] for i in range(3)]
    assert steps((0, 1, 2), uneven, views[:3]) is None  # 4100 bytes apart: not a 16-byte multiple


def test_kernel_option_is_checked():
    (kc, kb), (vc, vb) = _to(_cache("randn", b=1, hkv=1, n=64, d=64, k_bits=(4,), v_bits=(4,), seed=1), DEVICE)
    with pytest.raises(ValueError, match="kernel='gluon'"):
        tdt.turbo_decode_attention(torch.randn(1, 1, 1, 64, device=DEVICE), kc, vc, kb, vb, kernel="gluon")


# --------------------------------------------------------------------------- GPU

GPU_CASES = [  # (context, appended decode tokens, KV heads, query heads per KV head, input kind)
    (64, 0, 1, 1, "randn"),  # one block, empty buffer, MHA
    (64 * 5 + 37, 0, 2, 4, "outliers"),  # buffer of 37
    (1000, 24, 8, 4, "randn"),  # appended block (universal scale), buffer of 0 after the flush
    (64 * 40 + 63, 0, 2, 8, "outliers"),  # GQA 8, buffer of 63
    (130, 0, 3, 3, "randn"),  # GQA 3 (rows padded to 8)
]


@gpu
@needs_cuda
@needs_sm90
@pytest.mark.parametrize("n, appended, hkv, group, kind", GPU_CASES)
def test_gpu_gluon_decode_one_split_follows_the_reference(n, appended, hkv, group, kind):
    (kc, kb), (vc, vb) = _cache(kind, b=2, hkv=hkv, n=n, d=128, k_bits=(4,) * hkv, v_bits=(4,) * hkv, seed=n,
                                appended=appended)
    q = attention_inputs(kind, batch=2, heads=hkv * group, kv_heads=hkv, seq_q=1, head_dim=128, seed=n)[0]
    ref = turbo_decode_attention_ref(q, kc, vc, k_buffer=kb, v_buffer=vb)
    (kc, kb), (vc, vb) = _to([(kc, kb), (vc, vb)], "cuda")
    assert tdt.gluon_takes(torch.device("cuda"), group, 1, 128, 4, 4, kc.n_blocks)
    out = tdt.turbo_decode_attention(q.cuda(), kc, vc, kb, vb, num_splits=1, out_dtype=torch.float32).cpu()
    assert torch.isfinite(out).all()
    assert rel_l1(out, ref) <= SINGLE_SPLIT_REL_L1


@gpu
@needs_cuda
@needs_sm90
@pytest.mark.parametrize("n, splits, k_bits, v_bits", [
    (64 * 37 + 11, 0, (4,) * 8, (4,) * 8),  # the default splits
    (64 * 37 + 11, 5, (4,) * 8, (4,) * 8),  # uneven splits
    (4096, 64, (4,) * 8, (4,) * 8),  # the most splits, one merge chunk after another
    (64 * 21, 3, (4, 2) * 4, (4, 4) * 4),  # mixed: 4-bit heads on Gluon, the others on Triton, one call
])
def test_gpu_gluon_decode_splits_are_as_accurate_as_the_reference(n, splits, k_bits, v_bits):
    (kc, kb), (vc, vb) = _cache("outliers", b=2, hkv=8, n=n, d=128, k_bits=k_bits, v_bits=v_bits, seed=9)
    q = attention_inputs("outliers", batch=2, heads=32, kv_heads=8, seq_q=1, head_dim=128, seed=9)[0]
    (kv, ks), (vv, vs) = turbo_decompress_kv_ref(kc, kb), turbo_decompress_kv_ref(vc, vb)
    exact = attention_exact(q, kv * ks, vv * vs)
    ref = turbo_decode_attention_ref(q, kc, vc, k_buffer=kb, v_buffer=vb)
    (kc, kb), (vc, vb) = _to([(kc, kb), (vc, vb)], "cuda")
    out = tdt.turbo_decode_attention(q.cuda(), kc, vc, kb, vb, num_splits=splits or None,
                                     out_dtype=torch.float32).cpu()
    assert torch.isfinite(out).all()
    assert rel_l1(out, exact) <= SPLIT_NOISE_FACTOR * rel_l1(ref, exact)
    again = tdt.turbo_decode_attention(q.cuda(), kc, vc, kb, vb, num_splits=splits or None,
                                       out_dtype=torch.float32).cpu()
    assert torch.equal(out, again)  # the merge runs in split order: deterministic
    assert all(int(ws[-1].abs().sum()) == 0 for ws in tdt._WORKSPACES.values())  # tickets back at zero


@gpu
@needs_cuda
@needs_sm90
@pytest.mark.parametrize("splits", [1, 0])
def test_gpu_gluon_decode_on_the_compression_kernels_layout(splits):
    """Codes stored as ``turbo_compress_blocks`` stores them (one tensor per width: the regular-head path, no
    offset table): one split follows the reference, the default splits are as accurate as it."""
    from quantpatch.kernels.turbo_kv.turbo_compress_triton import turbo_compress_blocks
    from quantpatch.kernels.turbo_kv.turbo_ref import turbo_compress_kv_ref

    _, k, v = attention_inputs("outliers", batch=2, heads=8, kv_heads=8, seq_q=1, seq_k=64 * 30 + 9, head_dim=128,
                               seed=21)
    kc, kb = turbo_compress_kv_ref(k.cuda(), 4, compress_blocks=turbo_compress_blocks)
    vc, vb = turbo_compress_kv_ref(v.cuda(), 4, compress_blocks=turbo_compress_blocks)
    assert tdt._regular_steps(tdt._group_offsets(tuple(range(8)), kc.codes, vc.codes)) is not None
    q = attention_inputs("outliers", batch=2, heads=32, kv_heads=8, seq_q=1, head_dim=128, seed=21)[0]
    (kv, ks), (vv, vs) = turbo_decompress_kv_ref(kc, kb), turbo_decompress_kv_ref(vc, vb)
    exact = attention_exact(q, (kv * ks).cpu(), (vv * vs).cpu())
    ref = turbo_decode_attention_ref(q, *(_to_cpu(x) for x in (kc, vc)), k_buffer=_to_cpu(kb), v_buffer=_to_cpu(vb))
    out = tdt.turbo_decode_attention(q.cuda(), kc, vc, kb, vb, num_splits=splits or None,
                                     out_dtype=torch.float32).cpu()
    if splits == 1:
        assert rel_l1(out, ref) <= SINGLE_SPLIT_REL_L1
    else:
        assert rel_l1(out, exact) <= SPLIT_NOISE_FACTOR * rel_l1(ref, exact)


@gpu
@needs_cuda
@needs_sm90
def test_gpu_gluon_decode_bf16_output_is_the_float32_output_rounded():
    (kc, kb), (vc, vb) = _to(_cache("randn", b=3, hkv=8, n=64 * 50 + 3, d=128, k_bits=(4,) * 8, v_bits=(4,) * 8,
                                    seed=4), "cuda")
    q = torch.randn(3, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    out32 = tdt.turbo_decode_attention(q, kc, vc, kb, vb, out_dtype=torch.float32)
    out16 = tdt.turbo_decode_attention(q, kc, vc, kb, vb)
    assert out16.dtype == torch.bfloat16 and torch.equal(out16, out32.to(torch.bfloat16))


@gpu
@needs_cuda
@needs_sm90
def test_gpu_gluon_decode_launch_plan_reruns_the_compiled_kernel():
    """A plan's first call goes through ``JITFunction.run``, later ones to the compiled kernel's launcher: the
    same call again gives the same bits on the same plan, and caches of other lengths (whose keys reuse a plan
    or make another, as the heads' code offsets fall) follow the reference."""
    tdg._PLANS.clear()
    for n in (64 * 12 + 5, 64 * 33 + 17, 64 * 7):
        (kc, kb), (vc, vb) = _cache("outliers", b=2, hkv=4, n=n, d=128, k_bits=(4,) * 4, v_bits=(4,) * 4, seed=n)
        q = attention_inputs("outliers", batch=2, heads=16, kv_heads=4, seq_q=1, head_dim=128, seed=n)[0]
        ref = turbo_decode_attention_ref(q, kc, vc, k_buffer=kb, v_buffer=vb)
        (kc, kb), (vc, vb) = _to([(kc, kb), (vc, vb)], "cuda")
        outs, plans = [], []
        for _ in range(2):
            outs.append(tdt.turbo_decode_attention(q.cuda(), kc, vc, kb, vb, num_splits=1,
                                                   out_dtype=torch.float32).cpu())
            plans.append(len(tdg._PLANS))
        assert plans[0] == plans[1] >= 1
        assert torch.equal(outs[0], outs[1])
        assert rel_l1(outs[0], ref) <= SINGLE_SPLIT_REL_L1


def test_no_decode_step_compiles_a_new_variant():
    """What grows with the generation (blocks, buffered tokens, the splits) is neither specialized nor a constexpr:
    one compiled kernel serves every decode step of a generation (per split mode)."""
    params = {p.name: p.do_not_specialize for p in tdg._turbo_decode_gluon.params}
    assert all(params[name] for name in tdg.GROWING_ARGS)
    assert tdg.SPLITS_PAD >= tdg.MAX_SPLITS and tdg.SPLITS_PAD & (tdg.SPLITS_PAD - 1) == 0
