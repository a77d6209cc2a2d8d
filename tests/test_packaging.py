"""A built wheel contains every subpackage of the three source roots."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROOTS = {"src/quantpatch": "quantpatch", "kernels": "quantpatch/kernels", "patches": "quantpatch/patches"}


def expected_modules() -> set[str]:
    files = set()
    for root, prefix in ROOTS.items():
        for path in (ROOT / root).rglob("*.py"):
            if "__pycache__" not in path.parts:
                files.add(f"{prefix}/{path.relative_to(ROOT / root).as_posix()}")
    return files


def test_wheel_contains_every_module_and_no_other(tmp_path):
    """Every module of the source roots, and none besides: a module moved or deleted in the tree but left in an
    in-tree ``build/`` would otherwise ship beside its new copy."""
    pip = [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run([*pip, "-w", str(tmp_path)], check=True)
    (wheel,) = tmp_path.glob("quantpatch-*.whl")
    names = {name for name in zipfile.ZipFile(wheel).namelist() if name.endswith(".py")}
    missing = expected_modules() - names
    assert not missing, f"modules missing from the wheel: {sorted(missing)}"
    stale = names - expected_modules()
    assert not stale, f"modules in the wheel that the source roots do not have (a stale build/?): {sorted(stale)}"
