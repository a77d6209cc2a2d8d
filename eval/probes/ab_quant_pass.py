"""A/B of the quantization pass (``qk_quant_triton.quantize_qkv`` with a mode's options as the attention route calls
it, in a CUDA graph) across copies of the module (needs a GPU; B=4, H=32, D=128, bf16):

    python eval/probes/ab_quant_pass.py base=COPY.py [new=COPY2.py ...] [--mode int8-flash] [--causal]
        [--seq-lens 1024 2048 4096 8192 16384 32768]

Each NAME=PATH is a copy of ``kernels/qk_quant_triton.py`` (imported by ``kernel_copy.load_kernel_copy``); the
current module runs last, as ``current``. Three rounds, alternating the order; a variant's time is its best median
(``triton.testing.do_bench_cudagraph``). Every variant's outputs are compared with the current module's bit for bit
(ΔS where a causal call writes it). Prints µs, × the first variant, and the bytes the pass must move (Q, K, V read
once, the operands and ΔS written) over its time. Session 22's fused launch was measured with it
(``eval/results/bench_attention/session22_h200/``).
"""

import argparse
from pathlib import Path

import torch
import triton.testing
from kernel_copy import load_kernel_copy

import quantpatch as qp
from quantpatch.kernels import fast_paths, qk_quant_triton


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int8) if t.element_size() == 1 else t


def _same(a, b, written: torch.Tensor) -> list[str]:
    """Fields of two ``QuantizedQKV`` that differ (ΔS compared where written)."""
    bad = []
    for name, x, y in zip(a._fields, a, b):
        if name == "delta_s" and x.numel():
            x, y = x[..., written], y[..., written]
        if not torch.equal(_bits(x), _bits(y)):
            bad.append(name)
    return bad


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("copies", nargs="*", help="NAME=PATH of a copy of kernels/qk_quant_triton.py")
    ap.add_argument("--mode", default="sage2-8b")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    args = ap.parse_args()
    cfg = qp.get_mode(args.mode).attention
    options = fast_paths.quant_options(cfg) | dict(v_key_order=cfg.numerics == "sage2", is_causal=args.causal)
    variants = {}
    for spec in args.copies:
        name, path = spec.split("=", 1)
        variants[name] = load_kernel_copy(Path(path), f"qk_quant_triton_{name}")
    variants["current"] = qk_quant_triton

    for n in args.seq_lens:
        gen = torch.Generator(device="cuda").manual_seed(n)
        q, k, v = (torch.randn(4, 32, n, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
        written = qk_quant_triton.delta_s_written(n, n, block_q=options["block_q"], pad_to=options["pad_to"],
                                                  is_causal=args.causal, device="cuda")
        ref = qk_quant_triton.quantize_qkv(q, k, v, **options)
        for name, module in variants.items():
            bad = _same(module.quantize_qkv(q, k, v, **options), ref, written)
            print(f"N={n} {name}: outputs {'equal' if not bad else 'DIFFER in ' + ', '.join(bad)}", flush=True)
        times = {name: [] for name in variants}
        names = list(variants)
        for rnd in range(3):
            for name in names if rnd % 2 == 0 else names[::-1]:
                fn = variants[name].quantize_qkv
                times[name].append(float(triton.testing.do_bench_cudagraph(
                    lambda: fn(q, k, v, **options), rep=100, return_mode="median")))
        moved = 3 * q.numel() * 2 + ref.q_hat.numel() + ref.k_hat.numel() + ref.v_hat_t.numel()
        moved += written.sum().item() * 4 * q.shape[0] * q.shape[1] if ref.delta_s.numel() else 0
        base = min(times[names[0]])
        for name in names:
            t = min(times[name])
            print(f"N={n:6d} {name:>16}: {t * 1e3:8.1f} µs  x{base / t:5.3f}  {moved / t / 1e9:5.2f} TB/s moved",
                  flush=True)


if __name__ == "__main__":
    main()
