"""Boolean key masks that keep a prefix of the keys: the same attention over that prefix, with no mask.

HunyuanVideo masks the padded text tokens at the end of its joint sequence with a ``(B, 1, 1, N)`` boolean mask: True
for the video tokens and the valid text, False after. Where batch row ``b`` keeps its first ``n_b`` keys, every query
row of it (padded ones too) attends over exactly ``keys[b, :n_b]``, so the call is the unmasked one over that prefix,
which the kernels take (they take no mask): one call where every row keeps the same ``n``, one call per row where the
rows' prompts differ in length. :func:`kept_prefixes` reads the ``n_b`` from the mask once per mask tensor (one device
sync): the blocks of a forward pass share the tensor.
"""

from __future__ import annotations

import weakref

import torch

_LAST: list = [None, -1, None]  # weakref to the last mask read, its version, its kept prefixes


def kept_prefixes(mask: torch.Tensor, nk: int) -> tuple[int, ...] | None:
    """``(n_b, ...)`` where row ``b`` of the boolean ``mask (B, 1, 1, nk)`` keeps exactly its first ``n_b ≥ 1`` keys
    (one entry per mask row); None for any other mask (another dtype or shape, holes, a row keeping no key) and where
    the mask cannot be read without a device sync (under ``torch.compile`` or CUDA-graph capture)."""
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1:3] != (1, 1) or mask.shape[3] != nk:
        return None
    if torch.compiler.is_compiling() or (mask.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    ref, version, counts = _LAST
    if ref is not None and ref() is mask and version == mask._version:
        return counts
    rows = mask.reshape(mask.shape[0], nk)
    kept = rows.sum(-1)
    prefixes = torch.arange(nk, device=mask.device) < kept[:, None]
    read = torch.cat([kept, (rows == prefixes).all().long()[None]]).tolist()
    counts = tuple(read[:-1]) if read[-1] and min(read[:-1]) > 0 else None
    _LAST[:] = [weakref.ref(mask), mask._version, counts]
    return counts
