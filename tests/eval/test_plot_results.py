"""``eval/plot_results.py`` on the committed results (CPU, no model)."""

import pytest

from quantpatch.cli_commands import load_eval_script


def test_figures_from_committed_results(tmp_path):
    pytest.importorskip("matplotlib")
    script = load_eval_script("plot_results.py")
    runs = script.perplexity_runs(script.RESULTS / "perplexity")
    assert {"cpu float32", "H200 bfloat16"} <= set(runs)
    assert runs["cpu float32"]["sage2-8b"] == pytest.approx(-0.0097, abs=1e-3)  # 51.860 vs 51.865
    written = script.main(["--out", str(tmp_path)])
    assert [p.name for p in written] == ["perplexity.png", "accuracy_h200.png"]
    assert all(p.stat().st_size > 10_000 for p in written)
