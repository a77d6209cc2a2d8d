"""``eval/bench_attention.py``'s mode names with options (CPU, no kernel)."""

import pytest

from quantpatch import get_mode
from quantpatch.cli_commands import load_eval_script


def test_mode_names_switch_boolean_options():
    mode_config = load_eval_script("bench_attention.py").mode_config
    base = get_mode("sage2-8b").attention
    assert mode_config("sage2-8b") == base
    assert mode_config("sage2-8b+smooth_q=0") == base.replace(smooth_q=False)
    assert mode_config("sage2-8b+smooth_q=0+smooth_v=1") == base.replace(smooth_q=False, smooth_v=True)
    assert mode_config("int8-flash+smooth_k") == get_mode("int8-flash").attention.replace(smooth_k=True)
    for bad in ("sage2-8b+smooth_q=off", "sage2-8b+qk_qmax=1"):  # not 0 / 1; not a boolean option
        with pytest.raises(ValueError, match="boolean"):
            mode_config(bad)
    with pytest.raises(ValueError, match="unknown"):
        mode_config("sage2-8b+smoothq=0")


def test_baselines_include_sdpa_as_pytorch_picks_it_and_the_peer_says_why_it_is_missing(monkeypatch):
    import sys

    import torch

    bench = load_eval_script("bench_attention.py")
    assert bench.BASELINES[0] == "sdpa-default"
    q, k, v = (torch.randn(1, 2, 16, 32) for _ in range(3))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(bench.sdpa_fn("sdpa-default", True)(q, k, v), expected)
    monkeypatch.setitem(sys.modules, "sageattention", None)  # an import of it raises ImportError
    fn, why = bench.peer_fn(False)
    assert fn is None and "sageattention not importable" in why
    fn, why = bench.peer_kernel_fn([(q, k, v)], False)
    assert fn is None and "sm_90 kernel not importable" in why


def test_peer_kernel_row_quantizes_once_as_upstream_and_launches_its_sm90_kernel(monkeypatch):
    """The upstream kernel-alone row, against stand-ins of the ``sageattention`` functions it calls: K smoothed by
    its mean, per-thread groups of 64 query / 128 key rows, V padded to 128 keys, HND layout, per-thread granularity,
    no LSE."""
    import sys
    import types

    import torch

    bench = load_eval_script("bench_attention.py")
    calls = {}

    def per_thread_int8(q, k, km, **kw):
        calls["int8"] = (km, kw)
        return q.to(torch.int8), torch.ones(1), k.to(torch.int8), torch.ones(1)

    def per_channel_fp8(v, **kw):
        calls["fp8"] = (v.shape, kw)
        return v, torch.ones(1), None

    def launch(*args):
        calls.setdefault("launch", []).append(args[7:])
        args[3].fill_(1.0)

    pkg = types.ModuleType("sageattention")
    modules = {"sageattention": pkg, "sageattention.sm90_compile": types.SimpleNamespace(
        qk_int8_sv_f8_accum_f32_fuse_v_scale_attn_inst_buf=launch),
               "sageattention.quant": types.SimpleNamespace(per_channel_fp8=per_channel_fp8),
               "sageattention.triton": types.ModuleType("sageattention.triton"),
               "sageattention.triton.quant_per_thread": types.SimpleNamespace(per_thread_int8=per_thread_int8)}
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    pkg.sm90_compile = modules["sageattention.sm90_compile"]
    q, k, v = (torch.randn(1, 2, 200, 64) for _ in range(3))
    fn, why = bench.peer_kernel_fn([(q, k, v)], True)
    assert why == "" and "launch" not in calls  # quantized up front, launched by the timed call only
    assert torch.equal(calls["int8"][0], k.mean(dim=2, keepdim=True))
    assert calls["int8"][1] == dict(tensor_layout="HND", BLKQ=64, WARPQ=16, BLKK=128, WARPK=128)
    assert calls["fp8"] == ((1, 2, 256, 64), dict(tensor_layout="HND", smooth_v=False))
    out = fn(0)
    assert out.shape == q.shape and bool((out == 1).all())
    assert calls["launch"] == [(1, 1, 3, 64 ** -0.5, 0)]
