"""The sweeps' ``--ab``: a copy of one of the package's kernel modules from another commit, imported beside the
current one (``load_kernel_copy(path, "w4a8_gluon")`` is module ``quantpatch.kernels.w4a8_gluon_ab``, so its
relative imports resolve to the current package), and the check that both give the same outputs."""

import importlib.util
from pathlib import Path
from types import ModuleType

import torch


def load_kernel_copy(path: Path, module: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"quantpatch.kernels.{module}_ab", path)
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)
    return copy


def print_ab_check(label: str, y_old: torch.Tensor, y_new: torch.Tensor) -> None:
    """Whether the copy's output ``y_old`` equals the current one's ``y_new`` bit for bit, and their largest
    difference relative to ``max |y_new|``."""
    y_old, y_new = y_old.float(), y_new.float()
    print(f"{label}: --ab's output {'equal' if torch.equal(y_old, y_new) else 'differs'}, max |Δ| / max |y| = "
          f"{((y_old - y_new).abs().max() / y_new.abs().max()).item():.2e}", flush=True)
