"""Whether a tensor's device can run a GPU kernel: CUDA (not ROCm) of at least a compute capability."""

from __future__ import annotations

import torch


def cuda_unsupported(t: torch.Tensor, min_capability: tuple[int, int], needs: str) -> str | None:
    """Why ``t``'s device cannot run a kernel whose ``needs`` ask for ``min_capability`` (None if it can)."""
    if not t.is_cuda:
        return "inputs are not CUDA tensors"
    if torch.version.hip is not None:
        return "ROCm is not supported by these kernels"
    cap = torch.cuda.get_device_capability(t.device)
    if cap < min_capability:
        return f"{needs} need compute capability >= {min_capability[0]}.{min_capability[1]}, got {cap[0]}.{cap[1]}"
    return None
