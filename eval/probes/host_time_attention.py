"""Host time per call of ``quantpatch.attention`` (sage2-8b) and its parts at short prefills, beside SDPA cuDNN:
``python eval/probes/host_time_attention.py [--without-plans]`` (CUDA; B ∈ {1, 4}, H=32, N=1024, D=128, bf16).

Each line: host µs / eager wall µs a call (:func:`host_time.host_and_wall`). ``--without-plans`` empties the
launch plans before every call, so each launch goes through ``JITFunction.run`` as before they existed (plus the
plan's bookkeeping)."""

import sys

import torch
from host_time import host_and_wall
from torch.nn.attention import SDPBackend, sdpa_kernel

import quantpatch as qp
from quantpatch.kernels import fast_paths, qk_quant_triton


def main() -> None:
    without_plans = "--without-plans" in sys.argv
    cfg = qp.get_mode("sage2-8b").attention
    options = fast_paths.quant_options(cfg)

    def call(fn):
        if not without_plans:
            return fn

        def unplanned():
            for plans in fast_paths.PREFILL_PLANS:
                plans.clear()
            fn()

        return unplanned

    def cudnn(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    print(f"host µs / eager wall µs a call{' (launch plans emptied before each call)' * without_plans}")
    for b in (1, 4):
        q, k, v = (torch.randn(b, 32, 1024, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        fns = {
            "quantpatch.attention": call(lambda: qp.attention(q, k, v, mode="sage2-8b")),
            "quantize_qkv": call(lambda: qk_quant_triton.quantize_qkv(q, k, v, **options)),
            "sdpa cudnn": lambda: cudnn(q, k, v),
        }
        print(f"B={b}: " + "  ".join(f"{name} {h:.0f}/{w:.0f}" for name, (h, w) in
                                     ((name, host_and_wall(fn)) for name, fn in fns.items())), flush=True)


if __name__ == "__main__":
    main()
