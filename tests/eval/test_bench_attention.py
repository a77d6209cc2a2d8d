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
