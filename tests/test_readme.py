"""Every ```python block of README.md runs as written, on the CPU, in a fresh namespace."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(encoding="utf-8"), flags=re.S | re.M)
# optional packages a block imports: the block is skipped (saying which) when one is missing
OPTIONAL = ("transformers", "diffusers")


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 4


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_block_runs(code, monkeypatch):
    for name in OPTIONAL:
        if re.search(rf"^(from|import) {name}\b", code, flags=re.M):
            pytest.importorskip(name, reason=f"README block needs {name}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the CPU path, as a reader without a GPU runs it
    exec(compile(code, f"{README.name} block", "exec"), {"__name__": "__main__"})
