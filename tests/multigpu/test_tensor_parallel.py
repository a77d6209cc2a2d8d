"""A patched Llama under Transformers tensor parallelism (``tp_plan="auto"``), on two gloo CPU processes.

Each rank's attention gets its own heads; the TurboCache holds the rank's KV heads with their slice of per-head
widths. Logits of the patched TP model are compared with the unpatched TP model and with the same model patched in
one process (bounds measured, rounded down with a margin).
"""

from types import SimpleNamespace

import pytest
import torch

import quantpatch as qp
from quantpatch.head_precision import HeadPrecision
from quantpatch.metrics import cos_sim
from tests.multigpu.gloo import run_on_gloo

pytestmark = pytest.mark.usefixtures("one_cpu_thread")  # tests/conftest.py

transformers = pytest.importorskip("transformers")

# 4 query heads, 2 KV heads of dim 32: one KV head a rank
CONFIG = dict(vocab_size=128, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=256)
# per layer, the widths of KV heads 0 and 1 (K, V): each rank must keep its own column
K_BITS, V_BITS = [[2, 4], [4, 2]], [[4, 2], [2, 4]]
# sage2-8b, policy="always": last-token logits against unpatched TP (measured 0.99982: the quantization itself, as in
# one process) and against the same model patched in one process (measured 1 - 5e-14: the row-parallel all-reduce
# sums in another order)
COS_VS_UNPATCHED, COS_VS_ONE_PROCESS = 0.9995, 0.99999


def _save_tiny_llama(path: str) -> None:
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval().save_pretrained(path)


class _Mesh:
    """A device mesh's naming and local rank, as Transformers 5.x keeps one on a sharded model."""

    def __init__(self, names, rank):
        self.mesh_dim_names, self.rank = names, rank

    def __getitem__(self, name):
        assert name == "tp"
        return _Mesh(("tp",), self.rank)

    def get_local_rank(self):
        return self.rank


@pytest.mark.parametrize("names", [("pp", "fsdp", "tp"), None])  # a mesh with a "tp" dimension, or the tp mesh
def test_kv_head_range_is_the_ranks_slice(names):
    from quantpatch.patches.transformers.tensor_parallel import kv_head_range

    unsharded = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    assert kv_head_range(unsharded, 8) == range(8)
    sharded = SimpleNamespace(_tp_size=4, _device_mesh=_Mesh(names, 1))
    assert kv_head_range(sharded, 8) == range(2, 4)
    with pytest.raises(ValueError, match="do not split evenly"):
        kv_head_range(sharded, 6)


def test_head_bits_are_sliced_to_the_ranks_heads():
    from quantpatch.config import KVCacheConfig
    from quantpatch.patches.transformers.turbo_cache import ModelKVShape, resolve_head_bits

    shape = ModelKVShape("m", 2, 4, 32, range(2, 4))
    hp = HeadPrecision(k_bits=[[2, 4, 4, 2], [4, 4, 2, 2]], v_bits=[[4, 2, 2, 4], [2, 2, 4, 4]])
    kv = KVCacheConfig(kind="turbo", two_bit_heads=0)
    assert resolve_head_bits(hp, shape, kv) == [((4, 2), (2, 4)), ((2, 2), (4, 4))]
    assert resolve_head_bits(None, shape, kv) == [((4, 4), (4, 4))] * 2
    assert "of which this rank holds [2, 3]" in shape.describe()
    with pytest.raises(ValueError, match="layer 0"):  # per-head entries cover the whole model's heads
        resolve_head_bits([[4, 2], [4, 2]], shape, kv)


def _llama_under_tp(rank: int, path: str) -> dict:
    from quantpatch.patches.transformers.turbo_cache import TurboCache

    ids = torch.randint(0, CONFIG["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(1))
    single = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad(), qp.patch_model(single, "sage2-8b", policy="always"):
        one_process = single(ids).logits[:, -1]
    model = transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto").eval()
    heads = model.model.layers[0].self_attn.q_proj.weight.to_local().shape[0] // 32
    with torch.no_grad():
        unpatched = model(ids).logits[:, -1]
        with qp.patch_model(model, "sage2-8b", policy="always") as handle:
            patched = model(ids).logits[:, -1]
        routes = {r for site in handle.sites for r in site.routes}
        bits = HeadPrecision(k_bits=K_BITS, v_bits=V_BITS)
        with qp.patch_model(model, "turbo"):
            cache = TurboCache(model, "turbo", head_bits=bits)
            generated = model.generate(ids, max_new_tokens=70, do_sample=False, past_key_values=cache)
    return dict(heads=heads, one_process=one_process, unpatched=unpatched, patched=patched, routes=routes,
                generated=generated.shape, cache_bits=[(layer.k_bits, layer.v_bits) for layer in cache.layers],
                cache_heads=cache.layers[0].k_buffer.values.shape[1])


def test_patched_llama_under_tensor_parallelism(tmp_path):
    _save_tiny_llama(str(tmp_path))
    for rank, result in enumerate(run_on_gloo(_llama_under_tp, str(tmp_path))):
        assert result["heads"] == 2  # the rank's query heads: the model really is sharded
        assert result["routes"] == {"reference"}
        assert cos_sim(result["patched"], result["unpatched"]) >= COS_VS_UNPATCHED
        assert cos_sim(result["patched"], result["one_process"]) >= COS_VS_ONE_PROCESS
        assert result["generated"] == (1, 110)  # 70 tokens decoded over the compressed cache (blocks + buffer)
        assert result["cache_heads"] == 1
        assert result["cache_bits"] == [((K_BITS[i][rank],), (V_BITS[i][rank],)) for i in range(2)]


def _crs_logits(model, factors: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, list[tuple]]:
    """Last-token logits of ``model`` patched ``fireq`` with the CRS factors ``(Hkv, D)`` a fireq checkpoint stores
    on every attention module (whole, on every rank: TP does not shard buffers), and the KV heads its sites take
    (``(start, stop)`` of each site's slice)."""
    from quantpatch.crs import add_crs_buffers, crs_buffers
    from quantpatch.patches.transformers.turbo_cache import SITE_ATTR

    for layer in model.model.layers:
        add_crs_buffers(layer.self_attn, factors.shape[0], factors.shape[1], 1)
        crs_buffers(layer.self_attn)[0].copy_(factors)
    with torch.no_grad(), qp.patch_model(model, "fireq", policy="always"):
        sites = [getattr(layer.self_attn, SITE_ATTR).kv_heads for layer in model.model.layers]
        return model(ids).logits[:, -1], [(s.start, s.stop) for s in sites]


def _fireq_crs_under_tp(rank: int, path: str) -> dict:
    ids = torch.randint(0, CONFIG["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(1))
    factors = torch.linspace(0.5, 2.0, 2 * 32).reshape(2, 32)  # KV head 0 and 1 scaled differently
    single = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        exact = single(ids).logits[:, -1]  # CRS cancels in q·k: the unpatched logits are the exact ones
    one_process, all_heads = _crs_logits(single, factors, ids)
    sharded, rank_heads = _crs_logits(transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto").eval(),
                                      factors, ids)
    return dict(exact=exact, one_process=one_process, sharded=sharded, all_heads=all_heads, rank_heads=rank_heads)


def test_fireq_crs_factors_follow_the_ranks_kv_heads(tmp_path):
    """Each rank applies the CRS factors of its own KV heads (a checkpoint stores them for all heads). CRS cancels in
    q·k, so the logits show only quantization error: fireq's per-tensor V scale now spans a rank's heads, and TP
    comes out as close to exact as one process (measured 0.99970 and 0.99971; bound with a margin)."""
    _save_tiny_llama(str(tmp_path))
    for rank, result in enumerate(run_on_gloo(_fireq_crs_under_tp, str(tmp_path))):
        assert result["all_heads"] == [(None, None)] * 2 and result["rank_heads"] == [(rank, rank + 1)] * 2
        assert cos_sim(result["sharded"], result["exact"]) >= cos_sim(result["one_process"], result["exact"]) - 1e-4


def test_crs_factors_of_other_heads_are_refused():
    from quantpatch.crs import apply_online_crs

    q, k = torch.randn(1, 4, 8, 32), torch.randn(1, 1, 8, 32)
    with pytest.raises(ValueError, match="CRS factors of 2 KV heads for a call over 1 KV heads"):
        apply_online_crs(q, k, torch.ones(2, 32))


def _fp8_linears_under_tp(rank: int, path: str) -> dict:
    import warnings

    from quantpatch.fp8_linear import FP8Linear

    ids = torch.randint(0, CONFIG["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(1))
    model = transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto").eval()
    with torch.no_grad():
        unpatched = model(ids).logits[:, -1]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with qp.patch_model(model, "off", linear="fp8", policy="always"):
                swapped = sum(isinstance(m, FP8Linear) for m in model.modules())
                patched = model(ids).logits[:, -1]
    return dict(unpatched=unpatched, patched=patched, swapped=swapped, messages=[str(w.message) for w in caught])


def test_fp8_linears_keep_tensor_parallel_layers_with_a_warning(tmp_path):
    """Sharded linears (DTensor weights, redistribution hooks) keep their modules, each with a fallback warning;
    the model's output is the unpatched one."""
    _save_tiny_llama(str(tmp_path))
    for result in run_on_gloo(_fp8_linears_under_tp, str(tmp_path)):
        assert result["swapped"] == 0 and torch.equal(result["patched"], result["unpatched"])
        assert any("model.layers.0.self_attn.o_proj: weights sharded by tensor parallelism" in m
                   for m in result["messages"]), result["messages"]
