"""Compile ``kernels/w4a8_gluon.py`` for sm_90 without a GPU (Triton 3.6 in a CPU venv) and print its wgmma /
wait sequence, registers, spills, shared memory and ptxas advisories:
``python eval/probes/compile_w4a8_gluon.py [GPS] [BM] [SPLIT_K] [FUSED] [QBLOCK] [GPC]`` (defaults 8 16 4 1 4096 2;
GPS: groups per run, GPC: per chunk)."""

import re
import sys

from sm90_binary import compile_sm90, inspect_binary, resources, wgmma_sequence

from quantpatch.kernels.w4a8_gluon import _w4a8_decode_gluon as kernel
from quantpatch.kernels.w4a8_gluon import run_shape

gps_arg = int(sys.argv[1]) if len(sys.argv) > 1 else 8
gpc_arg = int(sys.argv[6]) if len(sys.argv) > 6 else 2
gpc, chunks = run_shape(gps_arg, gps_arg, gpc_arg)
bm = int(sys.argv[2]) if len(sys.argv) > 2 else 16
split = int(sys.argv[3]) if len(sys.argv) > 3 else 4
fused = int(sys.argv[4]) if len(sys.argv) > 4 else 1
qblock = int(sys.argv[5]) if len(sys.argv) > 5 else 4096
types = dict(X_ptr="*bf16", XQ_ptr="*fp8e4nv", W_ptr="*i32",
             AS_ptr="*bf16", WS_ptr="*fp8e4nv", B_ptr="*bf16", PTS_ptr="*i32", P_ptr="*fp32", C_ptr="*i32",
             Y_ptr="*bf16")
constexprs = dict(BM=bm, GPC=gpc, CHUNKS=chunks, SPLIT_K=split, FUSED=fused, QBLOCK=qblock, HAS_BIAS=True)
aligned = [n for n in kernel.arg_names if n.endswith("_ptr")] + ["K", "stride_wn"]
compiled = compile_sm90(kernel, types, constexprs, aligned, num_warps=4)
ptx, sass, usage, ptxas = inspect_binary(compiled)
mem = {op: len(re.findall(op, ptx)) for op in ("ld.shared.v4", "ld.shared.v2", "ld.shared.b", "st.shared",
                                               "ld.global.v4", "ld.global", "prmt", "lop3", "bar.sync")}
print(f"GPC {gpc} CHUNKS {chunks} BM {bm} SPLIT_K {split} FUSED {fused} QBLOCK {qblock}")
print("wgmma sequence:", wgmma_sequence(ptx))
print("PTX op counts:", mem)
print("SASS: HGMMA", sass.count("HGMMA"), "WARPGROUP.DEPBAR", sass.count("WARPGROUP.DEPBAR"),
      "SHFL", sass.count("SHFL"), "LDS", len(re.findall(r"\bLDS", sass)), "STS", len(re.findall(r"\bSTS", sass)))
print(resources(compiled, usage))
print("ptxas:", "\n".join(line for line in ptxas.splitlines() if "dvisory" in line or "arning" in line) or "-")
