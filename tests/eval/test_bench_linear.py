"""Smoke test of ``eval/bench_linear.py`` on the CPU: every output written, every implementation timed and measured."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from quantpatch.cli_commands import load_eval_script


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    pytest.importorskip("matplotlib")
    out = tmp_path_factory.mktemp("bench_linear")
    return load_eval_script("bench_linear.py").main(["--quick", "--device", "cpu", "--stream", "2", "--gelu",
                                                           "--out", str(out)]), out


@pytest.fixture(scope="module")
def fp8_baselines() -> tuple[str, ...]:
    """The ``fp8-*`` baselines whose ``_scaled_mm`` runs on this torch's CPU (2.11 has no row-wise scales there;
    the bench then warns and leaves that baseline out, as ``test_a_baseline_that_cannot_run…`` checks)."""
    module = load_eval_script("bench_linear.py")
    layer = module.Layer(128, 128, torch.device("cpu"), seed=0)
    operands = layer.fp8_operands(torch.randn(16, 128))
    runs = []
    for kind in ("tensor", "rowwise"):
        try:
            layer.scaled_mm(kind, *operands[kind])
        except RuntimeError:
            continue
        runs.append(f"fp8-{kind}")
    return tuple(runs)


def _read_csv(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_outputs_written(quick_run):
    result, out = quick_run
    for name in ("speed.csv", "accuracy.csv", "bench.json", "summary.md", "bench.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    meta = result["meta"]
    assert meta["git_sha"] and meta["torch"] and "Command:" in (out / "summary.md").read_text()


def test_every_implementation_timed_with_ratios(quick_run, fp8_baselines):
    _, out = quick_run
    rows = _read_csv(out / "speed.csv")
    assert {(r["m"], r["impl"], r["mode"]) for r in rows} == {
        (m, i, mode) for m in ("1", "16") for i in ("bf16", *fp8_baselines, "fp8 e2e", "w4a8 e2e")
        for mode in ("eager", "stream")} | {(m, i, "eager") for m in ("1", "16") for i in (
            "w4a8-lut e2e", "bf16 + gelu", "fp8 e2e + gelu", "fp8 e2e, gelu fused")}
    # no graphs on the CPU; streams of 2 layers; the --gelu rows against bf16 + gelu, not against the other baselines
    for r in rows:
        assert float(r["ms"]) > 0 and float(r["vs_bf16"]) > 0
        if r["impl"] in ("bf16", "bf16 + gelu"):
            assert float(r["vs_bf16"]) == 1.0
        if "gelu" in r["impl"]:
            assert r["vs_fp8-rowwise"] == "" and r["vs_fp8-tensor"] == ""


def test_tune_table_picks_the_best_geometric_mean_per_bucket():
    module = load_eval_script("bench_linear.py")
    a, b = '{"kernel": "decode", "programs": 512}', '{"kernel": "decode", "programs": 1024}'
    rows = [dict(k=1, n=1, m=1, config=a, ms=1.0), dict(k=1, n=1, m=1, config=b, ms=2.0),
            dict(k=2, n=2, m=16, config=a, ms=3.0), dict(k=2, n=2, m=16, config=b, ms=1.0)]  # a 3× off at M=16, b 2×: b
    assert module.best_table(rows) == [[16, {"kernel": "decode", "programs": 1024}]]


def test_accuracy_orders_int4_below_fp8_weights(quick_run, fp8_baselines):
    """INT4 groups of 128 (≈ 20 dB SQNR on randn) lose more than FP8 e4m3 weights (≈ 31 dB), both well under 0.2."""
    _, out = quick_run
    acc = {r["impl"]: r for r in _read_csv(out / "accuracy.csv")}
    w4 = float(acc["w4a8 e2e"]["rel_l1_vs_bf16"])
    fp8 = float(acc[fp8_baselines[-1]]["rel_l1_vs_bf16"])  # row-wise where this torch's CPU has it
    assert 0 < fp8 < w4 < 0.2
    assert 0 < float(acc["fp8 e2e"]["rel_l1_vs_bf16"]) < w4  # FP8Linear: per-token x per-channel, as fp8-rowwise
    assert 0.9 * w4 < float(acc["w4a8-lut e2e"]["rel_l1_vs_bf16"]) < 1.1 * w4  # one more e4m3 rounding of ŵ σ
    assert int(acc["w4a8 e2e"]["bf16_weight_bytes"]) / int(acc["w4a8 e2e"]["weight_bytes"]) >= 3.5


def test_a_baseline_that_cannot_run_is_warned_and_left_out(tmp_path, monkeypatch, caplog):
    """A GPU without FP8 GEMMs: ``_scaled_mm`` raises; every mode, the streams included, warns and goes on."""
    pytest.importorskip("matplotlib")
    module = load_eval_script("bench_linear.py")

    def no_fp8(self, kind, x_fp8, x_scale):
        raise RuntimeError("no FP8 GEMM here")

    monkeypatch.setattr(module.Layer, "scaled_mm", no_fp8)
    with caplog.at_level("WARNING"):
        module.main(["--quick", "--device", "cpu", "--stream", "2", "--no-accuracy", "--out", str(tmp_path)])
    rows = _read_csv(tmp_path / "speed.csv")
    assert {(r["impl"], r["mode"]) for r in rows} == {(i, mode) for i in ("bf16", "fp8 e2e", "w4a8 e2e")
                                                      for mode in ("eager", "stream")} | {("w4a8-lut e2e", "eager")}
    assert sum("no FP8 GEMM here" in r.getMessage() for r in caplog.records) == 2 * 2 * 2  # 2 kinds, 2 M, 2 modes
