"""A/B of copies of the Gluon sage2 attention module (``kernels/attn_gluon.py`` edited), kernel only, on the same
operands, beside SDPA cuDNN in the same process (needs an sm_90 GPU; B=4, H=32, D=128, bf16; non-causal unless
``--causal``; sage2-8b operands unless ``--mode int8-flash``):

    python eval/probes/ab_gluon_attention.py --out DIR base=COPY.py new=quantpatch.kernels.attn_gluon \
        [--seq-lens 4096 8192 16384]

Each NAME=PATH is a copy of ``kernels/attn_gluon.py`` (imported as ``quantpatch.kernels.attn_gluon_NAME_ab`` by
``kernel_copy.load_kernel_copy``, so its relative imports resolve to the current package) or an importable module
name, with ``attn_qk_int8_gluon``; the first is the baseline. Two rounds, the second in reverse order; a variant's
time is
the better of its two medians (``triton.testing.do_bench``). Prints and writes ``DIR/ab.json``: per N and variant
ms, TFLOPS, × cuDNN, × the baseline, and the output's relative L1 against the Triton kernel's (equal across
variants with equal numerics). Session 18's variants are diffs in
``eval/results/bench_attention/session18_h200/variants/``.
"""

import argparse
import importlib
import json
from pathlib import Path

import torch
from kernel_copy import load_kernel_copy
from sweep_gluon_attention import flops, ms, operands
from torch.nn.attention import SDPBackend, sdpa_kernel

import quantpatch as qp
from quantpatch.kernels import fast_paths
from quantpatch.kernels.attn_qk_int8_pv_fp8_triton import attn_qk_int8_pv_fp8
from quantpatch.metrics import rel_l1


def load(name: str, path: str):
    """Build ``name``'s module: a copy's file path or a module name."""
    if not path.endswith(".py"):
        return importlib.import_module(path)
    return load_kernel_copy(Path(path), f"attn_gluon_{name}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--causal", action="store_true", help="causal (bottom-right aligned); TFLOPS halved")
    ap.add_argument("--mode", default="sage2-8b", choices=["sage2-8b", "int8-flash"])
    ap.add_argument("variants", nargs="+", help="NAME=PATH, the baseline first")
    args = ap.parse_args()
    modules = {name: load(name, path) for name, path in (v.split("=", 1) for v in args.variants)}
    base = next(iter(modules))
    cfg = qp.get_mode(args.mode).attention
    blocks = fast_paths.kernel_blocks(cfg, 128)
    rows = []
    for n in args.seq_lens:
        q, k, v, x, vt = operands(cfg, n)
        work = flops(n, args.causal)
        call = dict(is_causal=args.causal, block_q=cfg.block_q)
        ref, _ = attn_qk_int8_pv_fp8(x, n, **call, **blocks, l_from_quantized_p=cfg.l_from_quantized_p)
        call["qk_granularity"] = cfg.qk_granularity
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            t_cudnn = ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=args.causal),
                         100)
        best, err = {}, {}
        for order in (list(modules), list(reversed(modules))):
            for name in order:
                fn = modules[name].attn_qk_int8_gluon
                out, _ = fn(x, n, **call, v_keys_permuted=vt)
                err[name] = rel_l1(out.float(), ref.float())
                best[name] = min(best.get(name, float("inf")),
                                 ms(lambda: fn(x, n, **call, v_keys_permuted=vt), 100))
        for name, t in best.items():
            row = dict(n=n, causal=args.causal, mode=args.mode, impl=name, ms=t, tflops=work / t * 1e-9,
                       vs_cudnn=t_cudnn / t, vs_base=best[base] / t, rel_l1_vs_triton=err[name])
            rows.append(row)
            print(f"N={n:6d} {name:10s} {t:8.3f} ms  x{row['vs_cudnn']:.3f} cuDNN  x{row['vs_base']:.3f} {base}  "
                  f"rel-L1 vs triton {err[name]:.3g}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ab.json").write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), rows=rows), indent=1))


if __name__ == "__main__":
    main()
