"""Compile ``kernels/turbo_decode_gluon.py`` for sm_90 without a GPU (any Triton with Gluon, e.g. 3.6 in a CPU
venv) and print its registers, spills, shared memory, mma / shuffle / barrier / load counts and ptxas
advisories: ``python eval/probes/compile_turbo_decode_gluon.py [GROUP] [SPLITS_PAD] [STAGES]`` (defaults 4 16 3).
Environment: ``EXACT=1`` (one-split numerics), ``FUSION=1`` (FMA contraction, as several splits launch it),
``META=1`` (the offset-table path), ``MAXNREG=n``, ``DUMP=prefix`` (write prefix.ptx / prefix.sass)."""

import os
import sys

import triton
from sm90_binary import compile_sm90, inspect_binary, resources

from quantpatch.kernels.turbo_decode_gluon import _turbo_decode_gluon as kernel

group = int(sys.argv[1]) if len(sys.argv) > 1 else 4
splits_pad = int(sys.argv[2]) if len(sys.argv) > 2 else 16
stages = int(sys.argv[3]) if len(sys.argv) > 3 else 3
types = dict(Q_ptr="*bf16", KC_ptr="*u8", KS_ptr="*i8", KZ_ptr="*i8", KBS_ptr="*fp32", VC_ptr="*u8", VS_ptr="*i8",
             VZ_ptr="*i8", VBS_ptr="*fp32", KB_ptr="*i8", KBSC_ptr="*fp32", VB_ptr="*i8", VBSC_ptr="*fp32",
             META_ptr="*i64", O_ptr="*bf16", MP_ptr="*fp32", LP_ptr="*fp32", ACC_ptr="*fp32", CNT_ptr="*i32",
             sm_scale="fp32")
constexprs = dict(GROUP=group, G_PAD=triton.next_power_of_2(group), QMAX=119, PMAX=119, SPLITS_PAD=splits_pad,
                  STAGES=stages, EXACT=bool(os.environ.get("EXACT")), REGULAR=not os.environ.get("META"))
aligned = [n for n in kernel.arg_names if n.endswith("_ptr")] + ["stride_kcb", "stride_vcb"]
maxnreg = int(os.environ["MAXNREG"]) if os.environ.get("MAXNREG") else None
compiled = compile_sm90(kernel, types, constexprs, aligned, num_warps=1,
                        enable_fp_fusion=bool(os.environ.get("FUSION")), maxnreg=maxnreg)
ptx, sass, usage, ptxas = inspect_binary(compiled, os.environ.get("DUMP"))
ops = ("HMMA", "SHFL", "BAR.SYNC", "LDS", "STS", "LDG.E.128", "LDG.E.64", "LDG.E ", "PRMT", "LOP3", "HADD2", "HFMA2",
       "I2F", "F2F", "MUFU", "FMUL", "FFMA", "FADD")
print("SASS:", {op: sass.count(op) for op in ops})
print(resources(compiled, usage))
print("ptxas:", "\n".join(line for line in ptxas.splitlines() if "dvisory" in line or "pill" in line) or "-")
