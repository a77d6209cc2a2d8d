"""Compile ``kernels/turbo_decode_gluon.py`` for sm_90 without a GPU (any Triton with Gluon, e.g. 3.6 in a CPU
venv) and print its registers, spills, shared memory, mma / shuffle / barrier / load counts and ptxas
advisories: ``python eval/probes/compile_turbo_decode_gluon.py [GROUP] [SPLITS_PAD] [STAGES]`` (defaults 4 16 3)."""

import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

from quantpatch.kernels.turbo_decode_gluon import _turbo_decode_gluon as kernel

group = int(sys.argv[1]) if len(sys.argv) > 1 else 4
splits_pad = int(sys.argv[2]) if len(sys.argv) > 2 else 16
names = kernel.arg_names
types = dict(Q_ptr="*bf16", KC_ptr="*u8", KS_ptr="*i8", KZ_ptr="*i8", KBS_ptr="*fp32", VC_ptr="*u8", VS_ptr="*i8",
             VZ_ptr="*i8", VBS_ptr="*fp32", KB_ptr="*i8", KBSC_ptr="*fp32", VB_ptr="*i8", VBSC_ptr="*fp32",
             META_ptr="*i64", O_ptr="*bf16", MP_ptr="*fp32", LP_ptr="*fp32", ACC_ptr="*fp32", CNT_ptr="*i32",
             sm_scale="fp32")
stages = int(sys.argv[3]) if len(sys.argv) > 3 else 3
constexprs = dict(GROUP=group, G_PAD=triton.next_power_of_2(group), QMAX=119, PMAX=119, SPLITS_PAD=splits_pad,
                  REGULAR=not os.environ.get("META"),
                  STAGES=stages, EXACT=bool(os.environ.get("EXACT")))
signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
aligned = [n for n in names if n.endswith("_ptr")] + ["stride_kcb", "stride_vcb"]
src = GluonASTSource(fn=kernel, signature=signature,
                     constexprs={(names.index(k),): v for k, v in constexprs.items()},
                     attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
maxnreg = int(os.environ["MAXNREG"]) if os.environ.get("MAXNREG") else None
compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=1, enable_fp_fusion=bool(os.environ.get("FUSION")), maxnreg=maxnreg))
ptx = compiled.asm["ptx"]
bin_dir = triton.__path__[0] + "/backends/nvidia/bin/"
tmp = tempfile.mkdtemp()
cubin, ptx_file = os.path.join(tmp, "k.cubin"), os.path.join(tmp, "k.ptx")
with open(cubin, "wb") as f:
    f.write(compiled.asm["cubin"])
with open(ptx_file, "w") as f:
    f.write(ptx)
if os.environ.get("DUMP"):
    with open(os.environ["DUMP"] + ".ptx", "w") as f:
        f.write(ptx)
usage = subprocess.run([bin_dir + "cuobjdump", "--dump-resource-usage", cubin], capture_output=True, text=True).stdout
ptxas = subprocess.run([bin_dir + "ptxas", "-arch=sm_90a", "-v", ptx_file, "-o", os.path.join(tmp, "x.cubin")],
                       capture_output=True, text=True)
sass = subprocess.run([bin_dir + "cuobjdump", "-sass", cubin], capture_output=True, text=True).stdout
if os.environ.get("DUMP"):
    with open(os.environ["DUMP"] + ".sass", "w") as f:
        f.write(sass)
ops = ("HMMA", "SHFL", "BAR.SYNC", "LDS", "STS", "LDG.E.128", "LDG.E.64", "LDG.E ", "PRMT", "LOP3", "HADD2", "HFMA2",
       "I2F", "F2F", "MUFU", "FMUL", "FFMA", "FADD")
print("SASS:", {op: sass.count(op) for op in ops})
print("registers", re.findall(r"REG:(\d+)", usage), "stack", re.findall(r"STACK:(\d+)", usage),
      "shared", compiled.metadata.shared)
print("ptxas:", "\n".join(line for line in ptxas.stderr.splitlines() if "dvisory" in line or "pill" in line) or "-")
