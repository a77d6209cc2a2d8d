"""Quantized attention under Diffusers' context parallelism, on the CPU.

The LSE ``quantpatch.attention`` returns is that of its own quantized softmax; ring attention's merge of KV chunks by
that LSE gives full attention back; the router decides the speed policy on the lengths the attention runs at and
hands Diffusers' templated Ulysses / ring attention our forward op; and a tiny Wan run by two gloo processes under
Ulysses and ring matches the same model patched in one process. Bounds measured on seeds 0-2, rounded with a margin.
"""

from types import SimpleNamespace

import pytest
import torch

import quantpatch as qp
from quantpatch.api import resolve_attention_config
from quantpatch.fallback import SDPA_ROUTE
from quantpatch.kernels.attention.attention_ref import attention_exact
from quantpatch.kernels.attention.quant_attention_ref import quant_attention_ref
from quantpatch.metrics import cos_sim
from quantpatch.synthetic import attention_inputs
from tests.multigpu.gloo import run_on_gloo
from tests.tolerances import RANDN_COS_FLOOR

pytestmark = pytest.mark.usefixtures("one_cpu_thread")  # tests/conftest.py

MODES = ("sage2-8b", "int8-flash")
# |LSE - LSE of the float64 reference of the same numerics|, randn, 256 tokens, D=64: measured <= 7.4e-4
# (int8-flash: float32 rounding moves a few P̂ codes; sage2-8b <= 7e-7)
LSE_VS_QUANT_REF = 2e-3
# |LSE - exact float64 LSE| on randn: measured <= 1.6e-2 (quantized scores), merged halves <= 1.1e-2
LSE_VS_EXACT = 0.03
# Tiny Wan (2 blocks, 48 tokens) under two gloo ranks against one process, patched the same (policy="always"):
# measured 0.9999998 (Ulysses: the cross-attention's query blocks are the rank's tokens) and 0.9999992 (ring)
WAN_CP_COS_FLOOR = {"ulysses": 0.99999, "ring": 0.9999}
# quantized calls per rank: 2 blocks x (self-attention: one call under Ulysses, one per ring step; cross-attention
# over the unsplit text, outside the templated attention: one)
WAN_CP_CALLS = {"ulysses": 4, "ring": 6}


def _merge(o1, lse1, o2, lse2):
    """Diffusers' ring merge (``TemplatedRingAttention.forward``), ``o (B, S, H, D)``, ``lse (B, S, H)``."""
    lse1, lse2 = lse1.unsqueeze(-1), lse2.unsqueeze(-1)
    out = o1 - torch.sigmoid(lse2 - lse1) * (o1 - o2)
    return out, (lse1 - torch.nn.functional.logsigmoid(lse1 - lse2)).squeeze(-1)


@pytest.mark.parametrize("mode", MODES)
def test_lse_is_that_of_the_quantized_softmax(mode):
    q, k, v = attention_inputs("randn", heads=4, seq_q=256, head_dim=64, seed=0)
    o, lse = qp.attention(q, k, v, mode=mode, return_lse=True)
    assert lse.shape == (1, 4, 256) and lse.dtype == torch.float32
    _, lse64 = quant_attention_ref(q, k, v, resolve_attention_config(mode), return_lse=True,
                                   compute_dtype=torch.float64)
    _, lse_exact = attention_exact(q, k, v, return_lse=True)
    assert (lse.double() - lse64).abs().max() <= LSE_VS_QUANT_REF
    assert (lse.double() - lse_exact).abs().max() <= LSE_VS_EXACT


@pytest.mark.parametrize("mode", MODES)
def test_ring_merge_of_two_kv_chunks_is_full_attention(mode):
    """Two ring steps (an odd split: 113 + 143 keys), each quantizing its own chunk, merged by their LSE."""
    q, k, v = attention_inputs("randn", heads=4, seq_q=256, head_dim=64, seed=0)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, S, H, D), as Diffusers hands them
    parts = [qp.attention(q, k[:, s], v[:, s], mode=mode, layout="BSHD", return_lse=True)
             for s in (slice(0, 113), slice(113, None))]
    (o1, lse1), (o2, lse2) = ((o.double(), lse.transpose(1, 2).double()) for o, lse in parts)
    merged, merged_lse = _merge(o1, lse1, o2, lse2)
    exact, lse_exact = attention_exact(*(t.transpose(1, 2) for t in (q, k, v)), return_lse=True)
    assert cos_sim(merged, exact.transpose(1, 2)) >= RANDN_COS_FLOOR[mode]
    assert (merged_lse - lse_exact.transpose(1, 2)).abs().max() <= LSE_VS_EXACT


def _parallel_config(ulysses: int, ring: int):
    return SimpleNamespace(context_parallel_config=SimpleNamespace(ulysses_degree=ulysses, ring_degree=ring))


@pytest.mark.parametrize("ulysses, ring, expected", [(2, 1, (96, 96)), (1, 2, (48, 48)), (2, 2, (96, 96))])
def test_speed_policy_decides_on_the_lengths_attention_runs_at(monkeypatch, ulysses, ring, expected):
    pytest.importorskip("diffusers")
    from quantpatch.patches.diffusers import processors

    seen, calls = [], []
    monkeypatch.setattr(processors, "speed_reason", lambda cfg, device, d, nq, nk, causal: seen.append((nq, nk))
                        or "shorter than the crossover")
    router = processors._Router(resolve_attention_config("sage2-8b"), qp.fallback.SiteRecord("s", "attention", ""),
                                False, lambda *a, **kw: calls.append(kw["parallel_config"]) or a[0], "speed")
    q = torch.randn(1, 48, 2, 32)  # (B, S_local, H, D)
    config = _parallel_config(ulysses, ring)
    assert router.dispatch(q, q, q, parallel_config=config) is q  # the original dispatch, with its parallel config
    assert seen == [expected] and calls == [config]
    assert list(router.record.routes) == [SDPA_ROUTE + "shorter than the crossover"]


def test_context_parallel_call_runs_the_templated_attention_with_our_op(monkeypatch):
    """policy="always": the call goes to Diffusers' templated context-parallel attention with our forward op; that
    op returns (out, lse) in Diffusers' (B, S, H, D) / (B, S, H) layout."""
    pytest.importorskip("diffusers")
    from quantpatch.patches.diffusers import context_parallel, processors

    record = qp.fallback.SiteRecord("s", "attention", "")
    handed = {}

    def templated(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, *, forward_op,
                  backward_op, _parallel_config):
        handed.update(op=forward_op, config=_parallel_config, return_lse=return_lse)
        return forward_op(None, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, True,
                          _parallel_config=_parallel_config)

    monkeypatch.setattr(context_parallel, "_templated", lambda: templated)
    router = processors._Router(resolve_attention_config("sage2-8b"), record, False, None, "always")
    q, k, v = (t.transpose(1, 2) for t in attention_inputs("randn", heads=2, seq_q=64, head_dim=32, seed=0))
    config = _parallel_config(2, 1)
    out, lse = router.dispatch(q, k, v, parallel_config=config)
    assert handed == {"op": router.context_parallel_op, "config": config, "return_lse": False}
    ref, ref_lse = qp.attention(q, k, v, mode="sage2-8b", layout="BSHD", return_lse=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse.transpose(1, 2))
    assert record.routes == {"reference": 1}
    with pytest.raises(NotImplementedError, match="inference-only"):
        context_parallel.backward_op(None, out)


def test_diffusers_attributes_reach_the_wrapped_processor():
    """enable_parallelism sets ``processor._parallel_config``; set/reset_attention_backend ``_attention_backend``:
    on a patched model they must land on the processor that reads them."""
    pytest.importorskip("diffusers")
    from quantpatch.testing.diffusers_tiny import tiny_transformer

    model, _ = tiny_transformer("WanTransformer3DModel")
    handle = qp.patch_model(model, "sage2-8b")
    wrapper = model.blocks[0].attn1.processor
    wrapper._parallel_config = "config"
    model.set_attention_backend("native")
    assert wrapper.original._parallel_config == "config" and wrapper.original._attention_backend == "native"
    model.reset_attention_backend()
    assert wrapper.original._attention_backend is None and wrapper._attention_backend is None
    handle.remove()
    assert model.blocks[0].attn1.processor is wrapper.original


def _wan_under_context_parallelism(rank: int, mode: str) -> dict:
    """One gloo rank: the tiny Wan patched in one process, then under Ulysses (patched before
    ``enable_parallelism``) and ring (patched after). Returns outputs and each run's routes."""
    # Diffusers derives a rank's device as ``rank % torch.accelerator.device_count()``; this CPU has no accelerator
    torch.accelerator.device_count = lambda: 1
    from diffusers.models._modeling_parallel import ContextParallelConfig

    from quantpatch.testing.diffusers_tiny import tiny_transformer

    def routes(handle):
        merged = {}
        for site in handle.sites:
            for route, n in site.routes.items():
                merged[route] = merged.get(route, 0) + n
        return merged

    model, call = tiny_transformer("WanTransformer3DModel")
    with qp.patch_model(model, mode, policy="always"):
        results = {"single": call()}
    for name, config, patch_first in (("ulysses", dict(ulysses_degree=2), True), ("ring", dict(ring_degree=2), False)):
        model, call = tiny_transformer("WanTransformer3DModel")
        handle = qp.patch_model(model, mode, policy="always") if patch_first else None
        model.enable_parallelism(config=ContextParallelConfig(**config))
        handle = handle or qp.patch_model(model, mode, policy="always")
        results[name] = (call(), routes(handle))
    return results


def test_tiny_wan_under_ulysses_and_ring_matches_one_process():
    pytest.importorskip("diffusers")
    for rank_result in run_on_gloo(_wan_under_context_parallelism, "sage2-8b"):
        single = rank_result["single"]
        for name, floor in WAN_CP_COS_FLOOR.items():
            out, routes = rank_result[name]
            assert out.shape == single.shape
            assert cos_sim(out, single) >= floor, name
            assert routes == {"reference": WAN_CP_CALLS[name]}, name


def test_lazy_all_gather_views_reach_the_kernels_as_plain_tensors():
    """Ring attention hands the forward op views of a lazy all-gather (``AsyncCollectiveTensor``): a GPU kernel reads
    its data pointer directly, so the op waits on it first (on the GPU such a view failed at the kernel launch)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    from quantpatch.patches.diffusers.context_parallel import materialized

    plain = torch.randn(2, 3)
    lazy = AsyncCollectiveTensor(plain)
    waited = materialized(lazy)
    assert type(waited) is torch.Tensor and torch.equal(waited, plain)
    assert materialized(plain) is plain
