"""Tile sweep of the Gluon W4A8 prefill GEMM (GPU): per (K → N, M) the GEMM alone on fragment-order x̂ for each
(block_t, stages), next to the Triton tiled GEMM, bf16 ``F.linear`` and ``torch._scaled_mm`` (per-tensor FP8) in the
same process, CUDA-graph replays (``bench_linear``'s harness, L2 flushed). Prints a table and writes
``sweep.csv`` under ``--out``: ``python eval/probes/sweep_w4a8_prefill.py --out DIR [--tokens 128 1024 4096]
[--ab OLD.py ...]``. ``--ab FILE ...``: also time copies of ``kernels/w4a8_prefill_gluon.py`` from other commits
(each at its default tile, named ``ab <file stem>``) and compare their outputs with this one's."""

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_attention import graph_times, write_csv  # noqa: E402
from bench_linear import LLAMA_8B_SHAPES, Layer  # noqa: E402
from kernel_copy import load_kernel_copy, print_ab_check  # noqa: E402

from quantpatch.kernels import w4a8_triton as wt  # noqa: E402
from quantpatch.kernels.w4a8_prefill_gluon import w4a8_gemm_prefill_gluon  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, required=True)
parser.add_argument("--tokens", type=int, nargs="+", default=[128, 1024, 4096])
parser.add_argument("--tiles", nargs="*", default=["128x3", "128x4", "128x6", "64x4"], help="block_t x stages")
parser.add_argument("--quant", nargs="*", default=["4096x4", "16384x16"],
                    help="also time the fragment-order quantization kernel at these BLOCK_K x num_warps")
parser.add_argument("--baselines", action=argparse.BooleanOptionalAction, default=True)
parser.add_argument("--ab", type=Path, nargs="*", default=[],
                    help="other versions of kernels/w4a8_prefill_gluon.py to time and compare")
parser.add_argument("--rep", type=int, default=30)
args = parser.parse_args()
args.out.mkdir(parents=True, exist_ok=True)
olds = {f"ab {path.stem}": load_kernel_copy(path, f"w4a8_prefill_gluon_{i}") for i, path in enumerate(args.ab)}
rows = []
for m, (k, n) in itertools.product(args.tokens, LLAMA_8B_SHAPES):
    layer = Layer(k, n, torch.device("cuda"), seed=k + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to("cuda", torch.bfloat16)
    qw, sc, pe, b = layer.w4a8_args()
    plain = wt.quantize_activation_fp8(x)
    frag = wt.quantize_activation_fp8(x, fragment_order=True)
    fp8 = layer.fp8_operands(x)["tensor"]
    impls = {"bf16": lambda: torch.nn.functional.linear(x, layer.weight),
             "fp8-tensor": lambda: layer.scaled_mm("tensor", *fp8)}
    if args.baselines:
        impls.update({"triton tiled": lambda: wt.w4a8_gemm(*plain, qw, sc, pe, b, torch.bfloat16),
                      "quant plain": lambda: wt.quantize_activation_fp8(x)})
    impls["quant frag"] = lambda: wt.quantize_activation_fp8(x, fragment_order=True)
    for q in args.quant:
        block_k, warps = map(int, q.split("x"))
        impls[f"quant {q}"] = lambda block_k=block_k, warps=warps: wt._w4a8_quantize_activation_kernel[(m,)](
            x, frag[0], frag[1], k, x.stride(0), k, BLOCK_K=block_k, FRAGMENT=True, EMULATE=False, num_warps=warps)
    y_new = w4a8_gemm_prefill_gluon(*frag, qw, sc, pe, b, torch.bfloat16) if olds else None
    for name, old in olds.items():
        impls[name] = lambda old=old: old.w4a8_gemm_prefill_gluon(*frag, qw, sc, pe, b, torch.bfloat16)
        print_ab_check(f"K={k} N={n} M={m} {name}", impls[name](), y_new)
    for tile in args.tiles:
        bt, stages = map(int, tile.split("x"))
        impls[f"gluon {tile}"] = lambda bt=bt, stages=stages: w4a8_gemm_prefill_gluon(
            *frag, qw, sc, pe, b, torch.bfloat16, block_t=bt, stages=stages)
    times = graph_times(impls, f"K={k} N={n} M={m}", args.rep)
    fl = 2.0 * m * n * k
    for name, ms in times.items():
        row = dict(k=k, n=n, m=m, impl=name, ms=ms, tflops=fl / (ms * 1e-3) / 1e12,
                   vs_fp8=times.get("fp8-tensor", float("nan")) / ms, vs_bf16=times.get("bf16", float("nan")) / ms)
        rows.append(row)
        print(f"K={k:5d} N={n:5d} M={m:5d} {name:>14s} {ms:8.4f} ms {row['tflops']:7.1f} TFLOPS "
              f"x{row['vs_fp8']:5.2f} fp8  x{row['vs_bf16']:5.2f} bf16", flush=True)
write_csv(args.out / "sweep.csv", rows)
