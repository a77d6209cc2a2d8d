"""What the compile probes share: a Gluon kernel compiled for sm_90 without a GPU (Triton's own ptxas and
cuobjdump), and what its binary says (PTX, SASS, registers, stack, shared memory, ptxas advisories)."""

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource


def compile_sm90(kernel, types: dict, constexprs: dict, aligned: list, **options):
    """``kernel`` (a ``gluon.jit`` function) compiled for sm_90: arguments typed by ``types`` (default ``i32``) or
    fixed by ``constexprs``; ``aligned`` ones marked divisible by 16 (as Triton specializes aligned pointers)."""
    names = kernel.arg_names
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    src = GluonASTSource(fn=kernel, signature=signature,
                         constexprs={(names.index(k),): v for k, v in constexprs.items()},
                         attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def inspect_binary(compiled, dump: str | None = None) -> tuple[str, str, str, str]:
    """``(ptx, sass, resource usage, ptxas -v stderr)`` of ``compiled``; ``dump``: also write ``dump.ptx`` and
    ``dump.sass``."""
    ptx = compiled.asm["ptx"]
    bin_dir = triton.__path__[0] + "/backends/nvidia/bin/"
    tmp = tempfile.mkdtemp()
    cubin, ptx_file = os.path.join(tmp, "k.cubin"), os.path.join(tmp, "k.ptx")
    with open(cubin, "wb") as f:
        f.write(compiled.asm["cubin"])
    with open(ptx_file, "w") as f:
        f.write(ptx)
    usage = subprocess.run([bin_dir + "cuobjdump", "--dump-resource-usage", cubin], capture_output=True,
                           text=True).stdout
    ptxas = subprocess.run([bin_dir + "ptxas", "-arch=sm_90a", "-v", ptx_file, "-o", os.path.join(tmp, "x.cubin")],
                           capture_output=True, text=True).stderr
    sass = subprocess.run([bin_dir + "cuobjdump", "-sass", cubin], capture_output=True, text=True).stdout
    if dump:
        for suffix, text in ((".ptx", ptx), (".sass", sass)):
            with open(dump + suffix, "w") as f:
                f.write(text)
    return ptx, sass, usage, ptxas


def resources(compiled, usage: str) -> str:
    """Registers, stack bytes and shared memory, one line."""
    regs, stack = re.findall(r"REG:(\d+)", usage), re.findall(r"STACK:(\d+)", usage)
    return f"registers {regs} stack {stack} shared {compiled.metadata.shared}"


def wgmma_sequence(ptx: str) -> str:
    """The PTX's wgmma issues and waits in order, runs folded: e.g. ``MMA-s8x4 wait1 MMA-e4m3x4 wait0``."""
    steps = []
    for line in ptx.splitlines():
        if "wgmma.mma_async" in line:
            kind = re.search(r"\.(s8|u8|e4m3|e5m2|f16|bf16|tf32)\.", line)
            step = "MMA-" + (kind.group(1) if kind else "?")
        elif "wgmma.wait_group" in line:
            step = "wait" + line.strip().rstrip(";")[-1]
        else:
            continue
        if steps and steps[-1][0] == step:
            steps[-1][1] += 1
        else:
            steps.append([step, 1])
    return " ".join(f"{s}x{n}" if n > 1 else s for s, n in steps)
