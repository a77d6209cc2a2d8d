"""Smoke test of ``eval/attention_accuracy.py``: tiny sizes, every output written, every ordering evaluated."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

from quantpatch.cli_commands import load_eval_script


@pytest.fixture(scope="module")
def harness():
    return load_eval_script("attention_accuracy.py")


@pytest.fixture(scope="module")
def tiny_run(harness, tmp_path_factory):
    pytest.importorskip("matplotlib")
    out = tmp_path_factory.mktemp("attention_accuracy")
    argv = [
        "--quick", "--seq-lens", "113", "--heads", "1", "--head-dim", "64",
        "--int-flash-seq-lens", "64", "128", "--int-flash-heads", "1", "--int-flash-head-dim", "32",
        "--out", str(out), "--no-progress",
    ]
    return harness.main(argv), out


def _read_csv(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_outputs_written(tiny_run):
    result, out = tiny_run
    for name in ("accuracy.csv", "orderings.csv", "accuracy.png", "run.json", "summary.md"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert (out / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = (out / "summary.md").read_text()
    assert "uname -m" in summary and "Command:" in summary and "torch" in summary


def test_every_variant_measured(harness, tiny_run):
    result, out = tiny_run
    rows = _read_csv(out / "accuracy.csv")
    assert len(rows) == len(result["rows"])
    seen = {(r["table"], r["variant"], r["distribution"]) for r in rows}
    expected_modes = {name for name, _ in harness.mode_variants()}
    assert {"sage2-8b", "sage2-4b", "int8-flash", "turbo", "fireq"} <= expected_modes
    for dist in ("randn", "outliers"):
        for table, items in harness.sage2_ablations().items():
            assert {(table, name, dist) for name, _ in items} <= seen
        assert {("modes", name, dist) for name in expected_modes} <= seen
    for dist in ("randn", "uniform"):
        assert {("int_flash", name, dist) for name, _ in harness.int_flash_variants()} <= seen
    for r in rows:
        values = [float(r[m]) for m in ("cos_sim", "rel_l1", "rmse", "mre")]
        assert all(math.isfinite(x) for x in values), r
        assert 0.0 < values[0] <= 1.0 + 1e-12, r


def test_orderings_evaluated(harness, tiny_run):
    result, out = tiny_run
    checks = _read_csv(out / "orderings.csv")
    assert {c["verdict"] for c in checks} <= {"pass", "fail"}
    for ordering in harness.ORDERINGS:
        rows = [c for c in checks if c["check"] == ordering.name]
        lens = (113,) if ordering.table != "int_flash" else (64, 128)
        assert len(rows) == 1 + len(ordering.distributions) * len(lens), ordering.name  # + the "all" row
        assert ordering.name in (out / "summary.md").read_text()


def test_chain_holds(harness):
    chain = (("a", "b"), ("c",), ("d",))
    assert harness.chain_holds({"a": 1.0, "b": 1.1, "c": 2.0, "d": 3.0}, chain)
    assert not harness.chain_holds({"a": 1.0, "b": 1.5, "c": 2.0, "d": 3.0}, chain)  # a, b not within 20%
    assert not harness.chain_holds({"a": 1.0, "b": 1.1, "c": 3.0, "d": 2.0}, chain)  # c, d swapped
    assert not harness.chain_holds({"a": 1.0, "b": 2.1, "c": 2.0, "d": 3.0}, (("a",), ("b",), ("c",)))
    assert [text for text, _ in harness.chain_links(chain)] == ["a ≈ b", "a > c", "b > c", "c > d"]
    assert harness.error_of("cos_sim", 0.99) == pytest.approx(0.1)
    assert harness.error_of("rel_l1", 0.25) == 0.25


def test_inputs_fixed_and_shaped(harness):
    a = harness.make_inputs("outliers", 1, 2, 40, 64, seed=3)
    b = harness.make_inputs("outliers", 1, 2, 40, 64, seed=3)
    assert all(x.shape == (1, 2, 40, 64) for x in a)
    assert all((x == y).all() for x, y in zip(a, b))
    u = harness.make_inputs("uniform", 1, 1, 40, 64, seed=3)[0]
    assert u.min() >= -0.5 and u.max() < 0.5
