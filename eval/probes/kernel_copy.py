"""Copies of the package's kernel modules imported beside the originals: the sweeps' ``--ab`` (a copy from another
commit: ``load_kernel_copy(path, "w4a8_gluon")`` is module ``quantpatch.kernels.w4a8_gluon_ab``, so its relative
imports resolve to the current package) with the check that both give the same outputs, and the probes' edited
copies (:func:`edited_copy`: clock or timer reads spliced in at anchors of the current source)."""

import atexit
import importlib.util
import os
import tempfile
from pathlib import Path
from types import ModuleType

import torch


def load_kernel_copy(path: Path, module: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"quantpatch.kernels.{module}_ab", path)
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)
    return copy


def edited_copy(module: str, edits: list[tuple]) -> ModuleType:
    """``kernels/<module>.py`` with ``edits`` applied, imported as ``quantpatch.kernels.<module>_edited_ab``: each
    edit is ``(anchor, replacement[, times])`` and its anchor must occur ``times`` times (once unless said), so a
    probe stops with the anchor it lacks when the kernel changes. The copy's file is removed at exit."""
    src = (Path(__file__).resolve().parents[2] / "kernels" / f"{module}.py").read_text()
    for anchor, new, *times in edits:
        n = src.count(anchor)
        if n != (times or [1])[0]:
            raise SystemExit(f"anchor found {n} times in {module}.py (update the probe): {anchor!r}")
        src = src.replace(anchor, new)
    fd, path = tempfile.mkstemp(prefix=f"{module}_edited_", suffix=".py")
    with os.fdopen(fd, "w") as f:
        f.write(src)
    atexit.register(os.remove, path)
    return load_kernel_copy(Path(path), f"{module}_edited")


def print_ab_check(label: str, y_old: torch.Tensor, y_new: torch.Tensor) -> None:
    """Whether the copy's output ``y_old`` equals the current one's ``y_new`` bit for bit, and their largest
    difference relative to ``max |y_new|``."""
    y_old, y_new = y_old.float(), y_new.float()
    print(f"{label}: --ab's output {'equal' if torch.equal(y_old, y_new) else 'differs'}, max |Δ| / max |y| = "
          f"{((y_old - y_new).abs().max() / y_new.abs().max()).item():.2e}", flush=True)
