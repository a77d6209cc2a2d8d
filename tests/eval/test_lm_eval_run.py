"""``quantpatch eval lm`` (``eval/lm_eval_run.py``) on pydoc-llama-21m: the local lm-eval perplexity task agrees
with ``eval/perplexity.py --lm-eval-windows`` within 0.1 % (fp and sage2-4b), the multiple-choice task is
well above chance, and a standard task without offline data is skipped with its reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantpatch.cli import main as cli_main
from quantpatch.cli_commands import load_eval_script

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared"
MODEL = SHARED / "models" / "pydoc-llama-21m"
DATA = SHARED / "data" / "pydoc-val.jsonl"

pytestmark = [
    pytest.mark.skipif(not (MODEL.is_dir() and DATA.is_file()), reason=f"needs {MODEL} and {DATA} (../shared)"),
    pytest.mark.usefixtures("one_cpu_thread"),  # tests/conftest.py
]


@pytest.fixture(scope="module")
def small_data(tmp_path_factory) -> Path:
    """The 5 documents of pydoc-val shorter than 3300 characters (2631 tokens): a few 256-token windows each."""
    docs = [line for line in DATA.read_text().splitlines() if line.strip() and len(json.loads(line)["text"]) < 3300]
    path = tmp_path_factory.mktemp("lm_eval") / "pydoc-small.jsonl"
    path.write_text("\n".join(docs) + "\n")
    return path


def _eval_lm(out: Path, *argv: str) -> dict:
    pytest.importorskip("lm_eval")
    cli_main(["eval", "lm", "--model", str(MODEL), "--device", "cpu", "--out", str(out), *argv])
    return json.loads(out.read_text())


def test_local_perplexity_task_matches_perplexity_py(small_data, tmp_path):
    report = _eval_lm(tmp_path / "lm.json", "--data", str(small_data), "--tasks", "pydoc_perplexity",
                      "--modes", "sage2-4b", "--max-length", "256")
    lm_eval_ppl = {row: r["tasks"]["pydoc_perplexity"]["token_perplexity"] for row, r in report["results"].items()}
    reference = load_eval_script("perplexity.py").main([
        "--model", str(MODEL), "--data", str(small_data), "--device", "cpu", "--lm-eval-windows", "--window", "256",
        "--modes", "off", "sage2-4b"])
    ours = {"fp": reference["results"]["off"]["ppl"], "sage2-4b": reference["results"]["sage2-4b"]["ppl"]}
    assert reference["tokens"] == report["results"]["fp"]["tasks"]["pydoc_perplexity"]["tokens"]
    for row in ("fp", "sage2-4b"):
        assert abs(lm_eval_ppl[row] / ours[row] - 1) < 1e-3, (row, lm_eval_ppl[row], ours[row])
    # the quantized row really ran patched: it differs from fp by more than the tolerance above
    assert lm_eval_ppl["sage2-4b"] / lm_eval_ppl["fp"] - 1 > 1e-3
    assert report["results"]["sage2-4b"]["fallbacks"] == {}
    assert report["environment"]["git_sha"] and report["lm_eval"]


def test_choice_task_above_chance_and_missing_data_skipped(tmp_path):
    report = _eval_lm(tmp_path / "lm.json", "--data", str(DATA), "--tasks", "pydoc_choice", "hellaswag",
                      "--modes", "--limit", "40")
    assert report["tasks_run"] == ["pydoc_choice"]
    assert "not available offline" in report["tasks_skipped"]["hellaswag"]
    choice = report["results"]["fp"]["tasks"]["pydoc_choice"]
    chance = 1 / load_eval_script("lm_eval_tasks/utils.py").CHOICES
    assert 0.0 <= choice["acc"] <= 1.0
    assert choice["acc"] - 3 * choice["acc_stderr"] > chance, choice


def test_choice_items_are_deterministic_and_well_formed():
    utils = load_eval_script("lm_eval_tasks/utils.py")
    texts = [json.loads(line)["text"] for line in DATA.read_text().splitlines() if line.strip()]
    items = utils.build_items(texts)
    assert items == utils.build_items(texts) and len(items) > 100
    assert [item["label"] for item in items] == [j % utils.CHOICES for j in range(len(items))]
    for item in items:
        assert len(item["choices"]) == len(set(item["choices"])) == utils.CHOICES
        truth = item["choices"][item["label"]]
        assert item["context"] + truth in texts[item["doc"]]  # the true continuation follows the context
        for k, wrong in enumerate(item["choices"]):
            if k != item["label"]:  # distractors are continuations from other documents
                assert any(wrong in t for i, t in enumerate(texts) if i != item["doc"])


def test_task_templates_render_with_the_data_path(tmp_path):
    module = load_eval_script("lm_eval_run.py")
    names = module.render_tasks(DATA, tmp_path)
    assert names == ["pydoc_choice", "pydoc_perplexity"]
    for name in names:
        assert json.dumps(str(DATA.resolve())) in (tmp_path / f"{name}.yaml").read_text()
    assert (tmp_path / "utils.py").is_file()
    with pytest.raises(FileNotFoundError):
        module.render_tasks(tmp_path / "missing.jsonl", tmp_path)


def test_calibrated_checkpoint_is_a_row(small_data, tmp_path):
    ckpt = tmp_path / "ckpt-fireq"
    cli_main(["calibrate", str(MODEL), "--mode", "fireq", "--data", str(SHARED / "data" / "pydoc-calib.jsonl"),
              "--samples", "2", "--seq-len", "64", "--out", str(ckpt)])
    report = _eval_lm(tmp_path / "lm.json", "--data", str(small_data), "--tasks", "pydoc_perplexity",
                      "--modes", "--checkpoint", str(ckpt), "--max-length", "256", "--limit", "2")
    fp = report["results"]["fp"]["tasks"]["pydoc_perplexity"]
    row = report["results"]["ckpt:ckpt-fireq"]
    assert row["mode"]["name"] == "fireq" and row["tasks"]["pydoc_perplexity"]["tokens"] == fp["tokens"]
    # W4A8 linears + INT4 KV: worse than fp, but a working model (not a broken load)
    assert fp["token_perplexity"] < row["tasks"]["pydoc_perplexity"]["token_perplexity"] < 2 * fp["token_perplexity"]
