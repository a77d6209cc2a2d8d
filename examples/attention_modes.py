"""Run every quantpatch mode on the same attention inputs and compare with float64.

    python examples/attention_modes.py
"""

import torch

import quantpatch
from quantpatch.kernels.attention.attention_ref import attention_exact
from quantpatch.synthetic import attention_inputs

device = "cuda" if torch.cuda.is_available() else "cpu"
q, k, v = attention_inputs("outliers", heads=8, kv_heads=2, seq_q=1024, dtype=torch.bfloat16, device=device)
reference = attention_exact(q, k, v, is_causal=True)
for mode in ["sage2-8b", "sage2-4b", "int8-flash", "turbo", "fireq"]:
    out = quantpatch.attention(q, k, v, mode=mode, is_causal=True)
    print(f"{mode:<11} CosSim {quantpatch.cos_sim(out, reference):.6f}  rel-L1 {quantpatch.rel_l1(out, reference):.4f}")
