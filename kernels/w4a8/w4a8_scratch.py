"""Per-stream scratch memory of the W4A8 launches (the Triton kernels of :mod:`quantpatch.kernels.w4a8.w4a8_triton` and
the Gluon ones): x̂ and β of the fused activation quantization, the decode kernels' counters and split-K partials.
"""

from __future__ import annotations

import torch

_SCRATCH: dict[tuple, object] = {}  # (stream key, name) → tensor (or views)
_RETIRED: list[torch.Tensor] = []  # outgrown scratch: kept alive, a captured CUDA graph may still use its address


def _scratch(key: tuple, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Scratch memory of the current stream (``key``), at least ``numel`` long; counters start (and end) at 0.

    One set per (device, stream): launches on one stream run one after the other and can share it;
    launches on two streams may overlap and must not.
    """
    buf = _SCRATCH.get((key, name))
    if buf is None or buf.numel() < numel:
        if buf is not None:
            _RETIRED.append(buf)
        buf = _SCRATCH[(key, name)] = torch.zeros(max(numel, 4096), dtype=dtype, device=device)
    return buf


def _x_hat_scratch(key: tuple, numel: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused quantization's ``x̂`` scratch as e4m3 (written) and as int16 pairs (read), views made once."""
    views = _SCRATCH.get((key, "x_hat_views"))
    if views is None or views[0].numel() < numel:
        raw = _scratch(key, "x_hat", -(-numel // 2) * 2, torch.uint8, device)
        views = _SCRATCH[(key, "x_hat_views")] = (raw.view(torch.float8_e4m3fn), raw.view(torch.int16))
    return views
