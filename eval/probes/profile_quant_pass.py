"""GPU time of each kernel of the sage2-8b quantization pass (B=4, H=32, D=128, bf16), by torch.profiler:
``python eval/probes/profile_quant_pass.py 1024 8192`` (``QP_DS=128,64,4,2`` overrides the ΔS GEMM's launch)."""

import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import quantpatch as qp
from quantpatch.kernels import fast_paths, qk_quant_triton
from quantpatch.kernels.qk_quant_triton import quantize_qkv

if "QP_DS" in os.environ:  # block_n,qb_tile,num_warps,num_stages of the ΔS GEMM
    qk_quant_triton.DS_TUNING = dict(zip(("block_n", "qb_tile", "num_warps", "num_stages"),
                                         map(int, os.environ["QP_DS"].split(","))))

cfg = qp.get_mode("sage2-8b").attention
opts = fast_paths.quant_options(cfg)
for n in map(int, sys.argv[1:] or ["1024", "8192"]):
    q, k, v = (torch.randn(4, 32, n, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for _ in range(3):
        quantize_qkv(q, k, v, **opts)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            quantize_qkv(q, k, v, **opts)
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / e.count, e.count) for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(t * c for _, t, c in rows) / 10
    print(f"N={n}: {total / 1000:.3f} ms per call")
    for key, t, c in sorted(rows, key=lambda r: -r[1] * r[2]):
        print(f"  {t / 1000:8.4f} ms x{c // 10}  {key[:90]}")
