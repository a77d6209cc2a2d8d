"""Smoke test of ``eval/bench_host_overhead.py`` on the CPU: the attention rows timed against their baseline, every
output written; component rows (no baseline) left without an overhead."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from quantpatch.cli_commands import load_eval_script


def test_cpu_run_times_the_patched_calls_against_transformers_sdpa(tmp_path):
    rows = load_eval_script("bench_host_overhead.py").main(
        ["--device", "cpu", "--calls", "3", "--repeats", "1", "--heads", "8", "--seq", "4", "--out", str(tmp_path)])
    assert [r["row"] for r in rows] == ["sdpa", "patched-speed", "patched-always"]
    for r in rows:
        assert r["us"] > 0 and r["baseline"] == "sdpa"
        # the overhead is taken from the unrounded times, then it and both times are rounded to 0.01 µs
        assert r["overhead_us"] == pytest.approx(r["us"] - rows[0]["us"], abs=0.016)
    with (tmp_path / "host_overhead.csv").open() as f:
        assert [r["row"] for r in csv.DictReader(f)] == [r["row"] for r in rows]
    assert json.loads((tmp_path / "bench.json").read_text())["rows"] == rows
    assert "| patched-always |" in (tmp_path / "summary.md").read_text()


def test_a_row_without_baseline_has_no_overhead():
    module = load_eval_script("bench_host_overhead.py")
    rows = module.with_overheads([dict(row="sdpa-short", us=17.123, baseline="sdpa-short"),
                                  dict(row="attention-short", us=45.456, baseline="sdpa-short"),
                                  dict(row="sm90-attention-launch", us=14.2, baseline=None)])
    assert [r["overhead_us"] for r in rows] == [0.0, 28.33, None]


def test_sm90_route_rows_are_left_out_where_the_call_takes_another_route(monkeypatch):
    """Off sm_90 (here: the CPU, the route stubbed to none) the sm90 parts are not timed."""
    module = load_eval_script("bench_host_overhead.py")
    from quantpatch.kernels.attention import fast_paths

    monkeypatch.setattr(fast_paths, "_sm90_prefill", lambda *args: None)
    args = module.parse_args(["--out", "unused", "--short-heads", "1", "--mode", "sage2-8b"])
    assert module.sm90_route_rows(args, torch.device("cpu")) == []
