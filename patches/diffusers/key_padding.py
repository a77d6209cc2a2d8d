"""Boolean key masks that keep a prefix of the keys: the same attention over that prefix, with no mask.

HunyuanVideo masks the padded text tokens at the end of its joint sequence with a ``(B, 1, 1, N)`` boolean mask: True
for the video tokens and the valid text, False after. Where every batch row keeps the same first ``n`` keys, every
query row (padded ones too) attends over exactly ``keys[:n]``, so the call is the unmasked one over that prefix,
which the kernels take (they take no mask). :func:`kept_prefix` reads ``n`` from the mask once per mask tensor (one
device sync): the blocks of a forward pass the same tensor.
"""

from __future__ import annotations

import weakref

import torch

_LAST: list = [None, -1, None]  # weakref to the last mask read, its version, its kept prefix


def kept_prefix(mask: torch.Tensor, nk: int) -> int | None:
    """``n`` where the boolean ``mask (B, 1, 1, nk)`` keeps exactly the first ``n ≥ 1`` keys of every row; None for
    any other mask (another dtype or shape, holes, rows keeping different counts, no key kept) and where the mask
    cannot be read without a device sync (under ``torch.compile`` or CUDA-graph capture)."""
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1:3] != (1, 1) or mask.shape[3] != nk:
        return None
    if torch.compiler.is_compiling() or (mask.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    ref, version, n = _LAST
    if ref is not None and ref() is mask and version == mask._version:
        return n
    counts = mask.sum(-1).flatten()
    prefix = torch.arange(nk, device=mask.device) < counts[0]
    low, high, exact = torch.stack([counts.min(), counts.max(), (mask == prefix).all().long()]).tolist()
    n = low if low == high and exact and low > 0 else None
    _LAST[:] = [weakref.ref(mask), mask._version, n]
    return n
