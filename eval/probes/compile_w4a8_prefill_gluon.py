"""Compile ``kernels/w4a8_prefill_gluon.py`` for sm_90 without a GPU (Triton 3.6 in a CPU venv) and print its
registers, spills, shared memory, op counts (shared-memory traffic would mean the weight operand left registers)
and ptxas's advisories (C7513/C7514: wgmma serialized):
``python eval/probes/compile_w4a8_prefill_gluon.py [BT] [STAGES] [DUMP|-]``."""

import re
import sys

from sm90_binary import compile_sm90, inspect_binary, resources

from quantpatch.kernels.w4a8_prefill_gluon import _w4a8_prefill_gluon as kernel

bt = int(sys.argv[1]) if len(sys.argv) > 1 else 128
stages = int(sys.argv[2]) if len(sys.argv) > 2 else 4
dump = sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] != "-" else None
desc = (f"tensordesc<fp8e4nv[{bt}, 128],NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2, "
        "transposed=False, fp4_padded=False, cga_layout=[])>")
types = dict(x_desc=desc, W_ptr="*i32", AS_ptr="*bf16", WS_ptr="*fp8e4nv", B_ptr="*bf16", PTS_ptr="*i32",
             Y_ptr="*bf16")
constexprs = dict(BT=bt, STAGES=stages, HAS_BIAS=True)
aligned = [n for n in kernel.arg_names if n.endswith("_ptr")] + ["K", "stride_wn", "stride_ym"]
compiled = compile_sm90(kernel, types, constexprs, aligned, num_warps=4)
ptx, sass, usage, ptxas = inspect_binary(compiled, dump)
print(f"BT {bt} STAGES {stages}")
print(resources(compiled, usage))
ops = ("wgmma.mma_async", "wgmma.wait_group", "bar.sync", "setmaxnreg", "mbarrier.arrive", "st.shared", "ld.shared",
       "ld.global.v4", "prmt", "lop3", "cp.async.bulk.tensor", "mbarrier.try_wait", "fma.rn.f32")
print("PTX op counts:", {op: len(re.findall(re.escape(op), ptx)) for op in ops})
print("SASS:", {op: len(re.findall(op, sass)) for op in (r"\b[HQ]GMMA", r"\bSTS", r"\bLDS", r"\bSTL", r"\bLDL",
                                                          r"\bBAR", r"\bFFMA", r"\bPRMT", r"\bLOP3")})
print("ptxas:", "\n".join(line for line in ptxas.splitlines() if "dvisory" in line or "arning" in line
                          or "registers" in line or "spill" in line) or "-")
