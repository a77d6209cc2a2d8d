"""Calls whose smooth-Q ΔS would pass its memory budget (or overflow 32-bit TMA coordinates) run in batch / GQA-group
slices."""

import math

import pytest
import torch

import quantpatch as qp
from tests.gpu import needs_cuda

fast_paths = pytest.importorskip("quantpatch.kernels.attention.fast_paths", reason="Triton is not installed")

SAGE4 = qp.get_mode("sage2-4b").attention


def delta_s_size(cfg, b, h, nq, nk) -> int:
    return b * h * math.ceil(nq / cfg.block_q) * math.ceil(nk / fast_paths.KEY_BLOCK) * fast_paths.KEY_BLOCK


@pytest.mark.parametrize("b, h, hkv, n", [(8, 32, 8, 32768), (1, 32, 8, 131072), (1, 64, 1, 65536), (4, 32, 32, 1024),
                                         (2, 40, 8, 100000), (4, 32, 32, 32768), (1, 2, 1, 262144)])
def test_chunks_cover_every_head_once_and_fit(b, h, hkv, n):
    chunks = fast_paths.head_chunks(SAGE4, b, h, hkv, n, n)
    covered = torch.zeros(b, h, dtype=torch.int64)
    rep = h // hkv
    for b0, b1, h0, h1 in chunks:
        covered[b0:b1, h0:h1] += 1
        size = delta_s_size(SAGE4, b1 - b0, h1 - h0, n, n)
        assert size < fast_paths.DELTA_S_LIMIT
        assert size <= fast_paths.DELTA_S_BUDGET or (b1 - b0, h1 - h0) == (1, 1)  # a head over the budget alone
        assert (h0 % rep == 0 and h1 % rep == 0) or h0 // rep == (h1 - 1) // rep  # whole groups, or within one
    assert bool((covered == 1).all())
    assert (len(chunks) == 1) == (delta_s_size(SAGE4, b, h, n, n) <= fast_paths.DELTA_S_BUDGET)


def test_the_memory_acceptance_shape_keeps_delta_s_within_a_gib():
    """B=4, H=32, 32k tokens, sage2-4b: ΔS alone would take 4 GiB in one piece; slices hold at most 1 GiB."""
    chunks = fast_paths.head_chunks(SAGE4, 4, 32, 32, 32768, 32768)
    assert len(chunks) > 1
    assert max(delta_s_size(SAGE4, b1 - b0, h1 - h0, 32768, 32768) for b0, b1, h0, h1 in chunks) * 4 <= 2**30


def test_without_smooth_q_one_chunk_serves_any_size():
    assert fast_paths.head_chunks(qp.get_mode("sage2-8b").attention, 8, 32, 8, 32768, 32768) == [(0, 8, 0, 32)]


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_sliced_call_equals_the_whole_call(monkeypatch, causal):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(3, 8, 1000, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(3, 2, 1000, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    whole, whole_lse = qp.attention(q, k, v, mode=SAGE4, is_causal=causal, return_lse=True, strict=True)
    monkeypatch.setattr(fast_paths, "DELTA_S_BUDGET", delta_s_size(SAGE4, 1, 4, 1000, 1000))
    assert len(fast_paths.head_chunks(SAGE4, 3, 8, 2, 1000, 1000)) == 6  # four query heads (one group) a slice
    sliced, sliced_lse = qp.attention(q, k, v, mode=SAGE4, is_causal=causal, return_lse=True, strict=True)
    # the K statistics are summed by atomics whose order follows the grid: equal up to float rounding, not bitwise
    assert qp.cos_sim(sliced, whole) > 0.99999
    torch.testing.assert_close(sliced_lse, whole_lse, rtol=0, atol=1e-3)


def test_a_head_too_large_for_any_slice_is_a_clear_error():
    with pytest.raises(ValueError, match="use a mode without smooth Q"):
        fast_paths.head_chunks(SAGE4, 1, 1, 1, 2**20, 2**20)
