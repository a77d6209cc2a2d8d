"""A copy of one of the package's kernel modules from another commit, imported beside the current one (the
sweeps' ``--ab``): ``load_kernel_copy(path, "w4a8_gluon")`` is module ``quantpatch.kernels.w4a8_gluon_ab``, so
its relative imports resolve to the current package."""

import importlib.util
from pathlib import Path
from types import ModuleType


def load_kernel_copy(path: Path, module: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"quantpatch.kernels.{module}_ab", path)
    copy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copy)
    return copy
