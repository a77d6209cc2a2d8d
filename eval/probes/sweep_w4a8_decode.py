"""Run sweep of the Gluon W4A8 decode kernel (GPU): per (K → N, M ≤ 16) the layer, quantization included (and
with ``--gemm`` the GEMM alone), for each ``GPSxGPC`` (groups per split-K run, per chunk; 0 = the default), next to
bf16 ``F.linear`` and ``torch._scaled_mm`` (per-tensor FP8) in the same process, CUDA-graph replays
(``bench_linear``'s harness, L2 flushed). ``--ab FILE``: also time a copy of ``kernels/w4a8_gluon.py`` from another
commit (its default run) and compare its outputs with this one's; ``--prefill``: the prefill GEMM at small tiles.
Prints a table and writes ``sweep.csv`` under ``--out``:
``python eval/probes/sweep_w4a8_decode.py --out DIR [--tokens 16] [--runs 0x0 28x2 ...] [--ab OLD.py [--ab-plain]]
[--prefill 16x4] [--gemm]``."""

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_attention import graph_times, write_csv  # noqa: E402
from bench_linear import LLAMA_8B_SHAPES, Layer  # noqa: E402
from kernel_copy import load_kernel_copy, print_ab_check  # noqa: E402

from quantpatch.kernels import w4a8_gluon as wg  # noqa: E402
from quantpatch.kernels import w4a8_prefill_gluon as wp  # noqa: E402
from quantpatch.kernels import w4a8_triton as wt  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, required=True)
parser.add_argument("--tokens", type=int, nargs="+", default=[16])
parser.add_argument("--runs", nargs="*", default=["0x0", "16x2", "32x4"], help="GPS x GPC (0: the default)")
parser.add_argument("--ab", type=Path, help="another version of kernels/w4a8_gluon.py to time and compare")
parser.add_argument("--ab-plain", action="store_true", help="--ab's GEMM takes x̂ in channel order (before version 12)")
parser.add_argument("--prefill", nargs="*", default=[], help="also the prefill GEMM at these BTxSTAGES (GEMM alone "
                    "on fragment-order x̂ with --gemm; the layer: its quantization, then the GEMM)")
parser.add_argument("--gemm", action="store_true", help="also time the GEMM alone on pre-quantized x̂")
parser.add_argument("--rep", type=int, default=30)
args = parser.parse_args()
args.out.mkdir(parents=True, exist_ok=True)
old = None
if args.ab:
    old = load_kernel_copy(args.ab, "w4a8_gluon")
rows = []
for m, (k, n) in itertools.product(args.tokens, LLAMA_8B_SHAPES):
    layer = Layer(k, n, torch.device("cuda"), seed=k + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to("cuda", torch.bfloat16)
    qw, sc, pe, b = layer.w4a8_args()
    frag = wt.quantize_activation_fp8(x, fragment_order=True)
    fp8 = layer.fp8_operands(x)["tensor"]
    impls = {"bf16": lambda: torch.nn.functional.linear(x, layer.weight),
             "fp8-tensor": lambda: layer.scaled_mm("tensor", *fp8)}
    if old is not None:
        impls["ab layer"] = lambda: old.w4a8_linear_gluon(x, qw, sc, pe, b)
        if args.gemm:
            old_x = wt.quantize_activation_fp8(x, fragment_order=not args.ab_plain)
            impls["ab gemm"] = lambda: old.w4a8_gemm_gluon(*old_x, qw, sc, pe, b, torch.bfloat16)
        print_ab_check(f"K={k} N={n} M={m}", old.w4a8_linear_gluon(x, qw, sc, pe, b),
                       wg.w4a8_linear_gluon(x, qw, sc, pe, b))
    for run in args.runs:
        gps, gpc = (int(v) or None for v in run.split("x"))
        kw = dict(gps=gps, gpc=gpc)
        impls[f"layer {run}"] = lambda kw=kw: wg.w4a8_linear_gluon(x, qw, sc, pe, b, **kw)
        if args.gemm:
            impls[f"gemm {run}"] = lambda kw=kw: wg.w4a8_gemm_gluon(*frag, qw, sc, pe, b, torch.bfloat16,
                                                                    **kw)
    for tile in args.prefill:
        bt, stages = map(int, tile.split("x"))
        kw = dict(block_t=bt, stages=stages)
        impls[f"prefill layer {tile}"] = lambda kw=kw: wp.w4a8_gemm_prefill_gluon(
            *wt.quantize_activation_fp8(x, fragment_order=True), qw, sc, pe, b, torch.bfloat16, **kw)
        if args.gemm:
            impls[f"prefill gemm {tile}"] = lambda kw=kw: wp.w4a8_gemm_prefill_gluon(*frag, qw, sc, pe, b,
                                                                                     torch.bfloat16, **kw)
    times = graph_times(impls, f"K={k} N={n} M={m}", args.rep)
    for name, ms in times.items():
        row = dict(k=k, n=n, m=m, impl=name, us=ms * 1e3, vs_bf16=times.get("bf16", float("nan")) / ms,
                   vs_fp8=times.get("fp8-tensor", float("nan")) / ms)
        rows.append(row)
        print(f"K={k:5d} N={n:5d} M={m:2d} {name:>16s} {row['us']:7.2f} us x{row['vs_bf16']:5.2f} bf16 "
              f"x{row['vs_fp8']:5.2f} fp8", flush=True)
write_csv(args.out / "sweep.csv", rows)
