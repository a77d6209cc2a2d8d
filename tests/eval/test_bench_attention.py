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
