"""The KV heads one rank holds under Transformers tensor parallelism.

``from_pretrained(..., tp_plan="auto")`` (or ``distributed_config=DistributedConfig(tp_size=N)``) under ``torchrun``
shards the attention projections column-wise: rank ``r`` of ``N`` computes query heads ``[r·H/N, (r+1)·H/N)`` and
KV heads ``[r·Hkv/N, (r+1)·Hkv/N)``, and its attention function gets those alone (``(B, H/N, S, D)``). The patched
attention takes its head counts from its inputs; what is kept per KV head of the whole model (TurboAttention's head
bit widths and calibrated absmax) is sliced to the rank's heads with :func:`kv_head_range`, as Transformers sizes
its own static cache (``num_key_value_heads // tp_size``).
"""

from __future__ import annotations

from typing import Any


def tp_degree(model: Any) -> int:
    """The tensor-parallel degree Transformers sharded ``model`` with (1: not sharded)."""
    return getattr(model, "_tp_size", None) or 1


def _tp_rank(model: Any) -> int:
    mesh = model._device_mesh  # the model's mesh: one "tp" dimension among others, or the tp mesh itself
    names = mesh.mesh_dim_names or ()
    return (mesh["tp"] if "tp" in names else mesh).get_local_rank()


def kv_head_range(model: Any, kv_heads: int) -> range:
    """The model-wide indices of the KV heads this rank's attention holds (all ``kv_heads`` without TP)."""
    degree = tp_degree(model)
    if degree == 1:
        return range(kv_heads)
    if kv_heads % degree:
        raise ValueError(f"{kv_heads} KV heads do not split evenly over tensor-parallel degree {degree}")
    per_rank = kv_heads // degree
    rank = _tp_rank(model)
    return range(rank * per_rank, (rank + 1) * per_rank)


def kv_head_count(text_config: Any) -> int:
    """The KV heads of a (text) model config: ``num_key_value_heads``, else one per attention head."""
    return getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads


def rank_kv_heads(model: Any) -> slice:
    """The slice of per-KV-head data (e.g. FireQ's CRS factors) this rank's attention calls hold: all without TP."""
    if tp_degree(model) == 1:
        return slice(None)
    heads = kv_head_range(model, kv_head_count(model.config.get_text_config(decoder=True)))
    return slice(heads.start, heads.stop)
