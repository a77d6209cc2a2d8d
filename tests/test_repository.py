"""The repository is the product: no development log, probes or variant diffs in tracked files."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# development-log wording: sessions, references to tickets, log files, trial rounds and versions, what was "not
# kept". The bracketed letters keep `git grep` for these words from finding this line.
DEV_LOG = re.compile(r"\bsessions?\b|session[0-9]|th[e] issue|n[o]tes|not kept|\bround [0-9]|\bv[0-9]+ trials?\b", re.I)


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout (git ls-files failed): the tracked-file checks need one")
    return [ROOT / name for name in out.decode().split("\0") if name and (ROOT / name).is_file()]


def test_no_development_log_wording_in_tracked_files():
    hits = []
    for path in tracked_files():
        if path == Path(__file__).resolve():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary (images, videos)
        for lineno, line in enumerate(text.splitlines(), 1):
            if DEV_LOG.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()[:120]}")
    assert not hits, "development-log wording:\n" + "\n".join(hits)


def test_eval_holds_no_probes_or_diffs():
    eval_dir = ROOT / "eval"
    assert not (eval_dir / "probes").exists()
    leftovers = [p.relative_to(ROOT) for p in eval_dir.rglob("*") if p.suffix in (".diff", ".patch") or
                 DEV_LOG.search(p.name)]
    assert not leftovers, f"variant diffs or logs under eval/: {leftovers}"


def test_no_variant_diffs_or_log_files_tracked():
    names = [p.relative_to(ROOT) for p in tracked_files() if p.suffix in (".diff", ".patch") or DEV_LOG.search(p.name)]
    assert not names, f"tracked variant diffs or logs: {names}"
