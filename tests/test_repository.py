"""The repository is the product: no development log, probes or variant diffs in tracked files."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# development-log wording: sessions, "the issue", trial rounds and versions, what was "not kept"
DEV_LOG = re.compile(r"\bsessions?\b|session[0-9]|the issue|not kept|\bround [0-9]|\bv[0-9]+ trials?\b", re.I)
LOG_FILES = re.compile(r"NOTES")  # the log files' name, upper case: ``handle.notes`` is an API attribute


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
            if DEV_LOG.search(line) or LOG_FILES.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()[:120]}")
    assert not hits, "development-log wording:\n" + "\n".join(hits)


def test_eval_holds_no_probes_or_diffs():
    eval_dir = ROOT / "eval"
    assert not (eval_dir / "probes").exists()
    leftovers = [p.relative_to(ROOT) for p in eval_dir.rglob("*") if p.suffix in (".diff", ".patch") or
                 p.name == "NOTES.md"]
    assert not leftovers, f"variant diffs or logs under eval/: {leftovers}"


def test_no_diffs_or_notes_tracked():
    names = [p.relative_to(ROOT) for p in tracked_files() if p.suffix in (".diff", ".patch") or p.name == "NOTES.md"]
    assert not names, f"tracked variant diffs or logs: {names}"
