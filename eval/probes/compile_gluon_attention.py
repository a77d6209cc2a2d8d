"""Compile ``kernels/attn_gluon.py`` for sm_90 without a GPU (Triton 3.6 in a CPU venv) and print its wgmma /
wait sequence, registers, spills, shared memory, barrier count and ptxas advisories:
``python eval/probes/compile_gluon_attention.py [BLOCK_N] [STAGES] [DUMP] [--causal] [--int8-flash] [--serial]``
(defaults 128 4; DUMP: also write DUMP.ptx and DUMP.sass; ``--int8-flash``: per-token scales, INT8 P̂·V, no
smoothing; ``--serial``: the three-warpgroup schedule)."""

import sys

import triton.experimental.gluon.language as gl
from sm90_binary import compile_sm90, inspect_binary, resources, wgmma_sequence

from quantpatch.kernels.attn_gluon import _attn_qk_int8_fwd_gluon as kernel

causal = "--causal" in sys.argv
int8_flash = "--int8-flash" in sys.argv
warpgroups = 3 if "--serial" in sys.argv else 2
args = [a for a in sys.argv[1:] if not a.startswith("--")]
block_n = int(args[0]) if len(args) > 0 else 128
stages = int(args[1]) if len(args) > 1 else 4
k_layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
v_layout = gl.NVMMASharedLayout(swizzle_byte_width=min(128, block_n), element_bitwidth=8, rank=2)
vec_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
types = dict(Q_ptr="*i8", QS_ptr="*fp32", KS_ptr="*fp32", QM_ptr="*fp32", KM_ptr="*fp32", VS_ptr="*fp32",
             VM_ptr="*fp32", O_ptr="*bf16", LSE_ptr="*fp32", stride_ob="i64", stride_oh="i64", stride_om="i64",
             qk_scale="fp32",
             k_desc=f"tensordesc<i8[{block_n}, 128],{k_layout!r}>",
             vt_desc=f"tensordesc<{'i8' if int8_flash else 'fp8e4nv'}[128, {block_n}],{v_layout!r}>",
             ds_desc=f"tensordesc<fp32[{block_n}],{vec_layout!r}>",
             ks_desc=f"tensordesc<fp32[{block_n}],{vec_layout!r}>")
smooth = not int8_flash
constexprs = dict(HEAD_DIM=128, BLOCK_N=block_n, Q_BLOCK=128, SMOOTH_Q=smooth, SMOOTH_K=smooth, SMOOTH_V=smooth,
                  RETURN_LSE=True, STAGES=stages, TOKEN_SCALES=int8_flash, PV_INT8=int8_flash, CAUSAL=causal,
                  WARPGROUPS=warpgroups)
aligned = [n for n in kernel.arg_names if n.endswith("_ptr")] + ["stride_ob", "stride_oh", "stride_om", "NK_PAD"]
compiled = compile_sm90(kernel, types, constexprs, aligned, num_warps=4)
ptx, sass, usage, ptxas = inspect_binary(compiled, args[2] if len(args) > 2 else None)
print("wgmma sequence:", wgmma_sequence(ptx))
print(resources(compiled, usage), "BAR.SYNC", sass.count("BAR.SYNC"))
print("ptxas:", "\n".join(line for line in ptxas.splitlines() if "dvisory" in line or "arning" in line) or "-")
