"""How the TurboAttention decode kernels split a call's key blocks
(:mod:`quantpatch.kernels.turbo_kv.turbo_decode_triton`, :mod:`quantpatch.kernels.turbo_kv.turbo_decode_gluon`): one
rule, each kernel with its own programs per SM."""

from __future__ import annotations

import functools

import torch

MIN_BLOCKS_PER_SPLIT = 4  # ≥ 256 keys per split: the partial (m, ℓ, acc) written stays small next to the codes read


@functools.lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_count(batch: int, kv_heads: int, n_blocks: int, device: torch.device, programs_per_sm: int) -> int:
    """Splits of the key blocks: at most ``programs_per_sm`` programs per SM (rounded down: at 255 registers and
    2 warps 4 programs fit an SM, so a grid just over a whole number of waves pays a nearly idle extra wave; the
    H200 measured 0.35 ms at 9 splits against 0.21 ms at 8, B=8 / N=32k), ≥ ``MIN_BLOCKS_PER_SPLIT`` blocks each."""
    sms = _sm_count(device) if device.type == "cuda" else 1
    want = programs_per_sm * sms // max(batch * kv_heads, 1)
    return max(1, min(want, n_blocks // MIN_BLOCKS_PER_SPLIT))
