"""Every ``@triton.jit`` / ``@gluon.jit`` function reads only globals a GPU compile accepts.

Triton's compiler takes a module-level value into a kernel only if it is a ``constexpr`` (or a module, a jit
function, a Triton type); a plain Python number raises ``NameError`` when the kernel compiles for a GPU. The CPU
interpreter reads such a global without complaint, so an interpreter test cannot catch it: this static check does, on
every kernel module, without a GPU.
"""

import ast
import importlib
import inspect
import pkgutil
import textwrap
import types

import pytest

kernels = pytest.importorskip("quantpatch.kernels", reason="the kernel package needs Triton")
triton = pytest.importorskip("triton")

ACCEPTED = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType)


def _kernel_modules() -> list[types.ModuleType]:
    modules = []
    for info in pkgutil.walk_packages(kernels.__path__, kernels.__name__ + "."):
        try:
            modules.append(importlib.import_module(info.name))
        except ImportError:  # e.g. Gluon missing from this Triton: its modules are not built here
            continue
    return modules


def _jit_functions(module: types.ModuleType) -> list[tuple[str, types.FunctionType]]:
    """``(name, Python function)`` of the jit functions defined in ``module`` (interpreted or compiled)."""
    found = []
    for name, value in vars(module).items():
        fn = getattr(value, "fn", None)
        if isinstance(fn, types.FunctionType) and fn.__module__ == module.__name__:
            found.append((name, fn))
    return found


def _free_names(fn: types.FunctionType) -> set[str]:
    """Names ``fn`` reads that it neither takes nor assigns."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    func = tree.body[0]
    bound = {a.arg for a in func.args.args + func.args.kwonlyargs}
    loaded = set()
    body = ast.Module(body=func.body, type_ignores=[])  # not the decorators: they run in Python, at definition
    for node in ast.walk(body):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
    return loaded - bound


def _accepted(value) -> bool:
    if isinstance(value, ACCEPTED) or isinstance(value, triton.language.constexpr):
        return True
    return hasattr(value, "fn") or type(value).__module__.startswith("triton")  # jit functions, Triton objects


def test_kernels_read_no_plain_python_globals():
    modules = _kernel_modules()
    checked, bad = 0, []
    for module in modules:
        for name, fn in _jit_functions(module):
            checked += 1
            for free in sorted(_free_names(fn)):
                if free in fn.__globals__ and not _accepted(fn.__globals__[free]):
                    bad.append(f"{module.__name__}.{name} reads {free} = {fn.__globals__[free]!r}")
    assert checked > 20, f"found only {checked} jit functions in {len(modules)} kernel modules"
    assert not bad, "globals a GPU compile rejects (make them tl.constexpr / gl.constexpr):\n" + "\n".join(bad)
