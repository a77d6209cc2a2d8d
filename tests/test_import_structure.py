"""The package's import structure, read from the source with ``ast``: kernels never import the API layer, the
module-level import graph has no cycle, and the patched attention does not pull the conversion stack in.

Modules are named as installed (``setup.py``): ``src/quantpatch/x.py`` is ``quantpatch.x``, ``kernels/a/b.py``
``quantpatch.kernels.a.b``, ``patches/a/b.py`` ``quantpatch.patches.a.b``. An edge ``a → b`` is an ``import`` in
``a`` of ``b`` (or of a name ``b`` defines); the parent packages Python imports on the way are not edges (every
module would otherwise import ``quantpatch/__init__.py``, which imports the public API).
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE_ROOTS = {"quantpatch": ROOT / "src" / "quantpatch", "quantpatch.kernels": ROOT / "kernels",
                "quantpatch.patches": ROOT / "patches"}
KERNELS = "quantpatch.kernels"
KERNELS_MAY_IMPORT = {"quantpatch.config"}
# (kernel module, API module) imports that stay, with why
KERNEL_IMPORTS_ALLOWED = {
    ("quantpatch.kernels.turbo_kv.turbo_ref", "quantpatch.modes"):
        "the decode reference defaults to the turbo mode's preset",
    ("quantpatch.kernels.fireq_kv.fireq_ref", "quantpatch.modes"):
        "the decode reference defaults to the fireq mode's preset",
}


@cache
def modules() -> dict[str, tuple[Path, bool]]:
    """Module name → (file, is a package ``__init__``)."""
    found = {}
    for package, root in SOURCE_ROOTS.items():
        for path in root.rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            found[".".join([package, *(parts[:-1] if is_package else parts)])] = (path, is_package)
    return found


def _known(name: str) -> str:
    """The longest prefix of dotted ``name`` that is one of our modules."""
    while name not in modules():
        name = name.rpartition(".")[0]
    return name


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    """Our modules that the import statement ``node`` in ``module`` imports."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: from the module's package, one level up per extra dot
            package = module.split(".") if is_package else module.split(".")[:-1]
            package = package[: len(package) - node.level + 1]
            base = ".".join(package + ([node.module] if node.module else []))
        # ``from package import name``: the submodule ``name`` if there is one, else the package's attribute
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules() else base for alias in node.names]
    return list(dict.fromkeys(_known(name) for name in names if name == "quantpatch" or name.startswith("quantpatch.")))


def _module_level(tree: ast.Module) -> set[int]:
    """ids of the import statements that run when the module is imported (not inside a function)."""
    found, stack = set(), list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.add(id(node))
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(node))
    return found


@cache
def imports() -> dict[str, list[tuple[str, int, bool]]]:
    """Module → every import of one of our modules in it: ``(target, line, module level)``."""
    graph = {}
    for module, (path, is_package) in modules().items():
        tree = ast.parse(path.read_text(), filename=str(path))
        top = _module_level(tree)
        graph[module] = [(target, node.lineno, id(node) in top)
                         for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                         for target in _targets(module, is_package, node) if target != module]
    return graph


def _module_level_graph() -> dict[str, set[str]]:
    return {module: {t for t, _, top in edges if top} for module, edges in imports().items()}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt, path)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [])) is not None:
            return cycle
    return None


def test_the_source_roots_are_read():
    """The walk finds the modules the checks below rely on, and resolves relative imports."""
    found = modules()
    for name in ("quantpatch", "quantpatch.dispatch", "quantpatch.kernels.attention.fast_paths",
                 "quantpatch.patches.transformers.attention", "quantpatch.patches.transformers"):
        assert name in found, name
    fast_paths = {(t, top) for t, _, top in imports()["quantpatch.kernels.attention.fast_paths"]}
    assert ("quantpatch.kernels.attention.quant_attn_triton", True) in fast_paths  # from . import
    assert ("quantpatch.kernels.device", True) in fast_paths  # from ..device import


def test_every_kernel_module_imports():
    """Every module under ``kernels/`` imports here (without CUDA: Triton's CPU build and Gluon's Python API
    suffice), and the package walk reaches every one of them (a folder without ``__init__.py`` is not reached).
    Where ``triton.experimental.gluon`` does not import, only the Gluon modules may fail, on that import."""
    pytest.importorskip("triton", reason="Triton is not installed")
    try:
        importlib.import_module("triton.experimental.gluon")
        gluon_missing = False
    except ImportError:
        gluon_missing = True
    kernels = importlib.import_module(KERNELS)
    walked = {info.name for info in pkgutil.walk_packages(kernels.__path__, KERNELS + ".")}
    on_disk = {name for name in modules() if name.startswith(KERNELS + ".")}
    assert walked == on_disk, f"not reached: {sorted(on_disk - walked)}; not on disk: {sorted(walked - on_disk)}"
    failed = []
    for name in sorted(walked):
        try:
            importlib.import_module(name)
        except ImportError as err:
            if not (gluon_missing and "gluon" in str(err)):
                failed.append(f"{name}: {err!r}")
    assert not failed, "kernel modules that do not import:\n" + "\n".join(failed)


def test_kernels_import_no_api_module():
    """A kernel module imports other kernel modules and :mod:`quantpatch.config` only (function-level imports
    included); the API layer imports kernels and registers them."""
    bad = [f"{module}:{line} imports {target}"
           for module, edges in imports().items() if module == KERNELS or module.startswith(KERNELS + ".")
           for target, line, _ in edges
           if not (target == KERNELS or target.startswith(KERNELS + ".")) and target not in KERNELS_MAY_IMPORT
           and (module, target) not in KERNEL_IMPORTS_ALLOWED]
    assert not bad, "kernels import the API layer:\n" + "\n".join(bad)


def test_the_allowed_kernel_imports_still_exist():
    """Each allowed exception names an import that is really there (a removed one leaves the list)."""
    present = {(module, target) for module, edges in imports().items() for target, _, _ in edges}
    assert set(KERNEL_IMPORTS_ALLOWED) <= present, set(KERNEL_IMPORTS_ALLOWED) - present


def test_loading_kernel_modules_registers_them_with_the_api_layer(monkeypatch):
    """The kernels import nothing of the dispatcher: ``dispatch.load_kernels`` imports them and registers the
    attention kernels for each numerics family they compute, and the W4A8 and TurboCache kernels with their ops."""
    pytest.importorskip("triton", reason="Triton is not installed")
    pytest.importorskip("transformers", reason="the TurboCache needs Transformers")
    from quantpatch import dispatch
    from quantpatch.patches.transformers import turbo_cache  # noqa: F401  (registers the TurboCache's references)

    monkeypatch.setattr(dispatch, "_kernels_tried", set())
    monkeypatch.setattr(dispatch, "_REGISTRY", {op: {key: [i for i in impls if i.name == dispatch.REFERENCE]
                                                     for key, impls in keys.items()}
                                                for op, keys in dispatch._REGISTRY.items()})
    for module in dispatch.KERNEL_MODULES.values():
        dispatch.load_kernels(module)
    fast_paths = sys.modules[dispatch.FAST_PATHS_MODULE]
    for numerics in fast_paths.NUMERICS:
        best = dispatch.implementations("attention", numerics)[0]
        assert (best.name, best.unsupported, best.run) == ("triton", fast_paths.call_unsupported, fast_paths.run)
    for op, key, kernels in (("w4a8_linear", "w4a8_fp8", ["scaled_mm (lut)", "triton"]),
                             ("turbo_compress", "turbo", ["triton"]), ("turbo_decode", "turbo", ["triton"])):
        assert [i.name for i in dispatch.implementations(op, key)] == [*kernels, dispatch.REFERENCE], op


def test_module_level_imports_have_no_cycle():
    cycle = _find_cycle(_module_level_graph())
    assert cycle is None, "module-level import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_reports_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "d": {"a", "c"}}) is None


def test_patched_attention_does_not_import_the_conversion_stack():
    """Importing the Transformers attention (what ``patch_model`` on a Llama runs) reaches no calibration method
    (``quantpatch.methods``) through a module-level import: CRS comes from :mod:`quantpatch.crs`, TurboAttention's
    head widths from :mod:`quantpatch.head_precision`. Parent packages count, except the root
    ``quantpatch/__init__.py`` (the public API, which exports ``convert``)."""
    graph = _module_level_graph()
    seen, todo = set(), ["quantpatch.patches.transformers.attention"]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        parents = [module.rsplit(".", i)[0] for i in range(1, module.count("."))]
        todo.extend([*graph[module], *parents])
    assert {"quantpatch.crs", "quantpatch.head_precision"} <= seen
    assert not [m for m in seen if m == "quantpatch.methods" or m.startswith("quantpatch.methods.")]
