"""Linear-layer speed and accuracy: FireQ W4A8 (INT4 weights × FP8 activations) next to bf16 and FP8 GEMMs, one run.

Llama-3-8B projection shapes (K → N: 4096 → 4096, 4096 → 14336, 14336 → 4096) at M ∈ {1, 16, 128,
1024, 4096} tokens, bf16 activations, no bias:

* ``w4a8 e2e``: ``W4A8Linear(x)`` from bf16, i.e. one ``quantpatch::w4a8_linear`` op: the module's CUDA
  path (M ≤ 16: one launch, the quantization fused into the decode GEMM — the Gluon kernel on sm_90, else the
  Triton one; larger M: the activation-quantization kernel then the GEMM — the Gluon prefill kernel on sm_90,
  else the Triton tiled one; on the CPU, the PyTorch reference); ``triton e2e`` (where the layer runs a Gluon
  kernel): the Triton path instead; ``w4a8-lut e2e``: the same layer with FireQ's look-up-table operand
  (``weight_operand="lut"``): the activation quantization, the ``e4m3(ŵ σ)`` matrix written from the packed weight,
  then ``torch._scaled_mm`` rowwise;
* ``w4a8 gemm``: the GEMM of that path alone on pre-quantized activations
  (:func:`~quantpatch.kernels.w4a8.w4a8_gluon.w4a8_gemm_gluon` /
  :func:`~quantpatch.kernels.w4a8.w4a8_prefill_gluon.w4a8_gemm_prefill_gluon` where the layer runs a Gluon kernel,
  else :func:`~quantpatch.kernels.w4a8.w4a8_triton.w4a8_gemm`); ``w4a8 quant``: the activation quantization alone
  (in fragment order for the prefill kernel);
* ``fp8 e2e``: ``FP8Linear(x)`` from bf16 (``linear="fp8"`` of every mode): the per-token FP8 quantization kernel,
  then ``torch._scaled_mm`` rowwise with the per-channel weight scales; the CPU reference on the CPU;
* ``bf16``: ``torch.nn.functional.linear``;
* with ``--gelu``, the layer after a tanh GELU, as a Diffusers feed-forward's down projection runs: ``bf16 + gelu``
  (``F.gelu`` then ``F.linear``), ``fp8 e2e + gelu`` (``F.gelu`` then ``FP8Linear``) and ``fp8 e2e, gelu fused``
  (``FP8Linear`` with ``activation="gelu_tanh"``: the GELU inside its quantization kernel, as ``linear="fp8"``
  patches those feed-forwards); their ``vs_bf16`` is against ``bf16 + gelu``;
* ``fp8-tensor`` / ``fp8-rowwise``: ``torch._scaled_mm`` on pre-quantized FP8 e4m3 operands with
  per-tensor scales / per-token × per-channel fp32 scales (GEMM only: the quantization of x is
  not counted, which favours them against ``w4a8 e2e``).

Times are medians of ``triton.testing.do_bench`` (the shared harness ``eval/harness.py``,
which flushes L2 between calls, so weights come from HBM as in a model's forward pass), cycling
over several input sets; TFLOPS = 2·M·N·K / t. Each implementation is timed twice (``mode``):
``eager``, the Python call as is (host overhead included where the GPU waits for it), and
``graph``, the same call captured once per input set in a CUDA graph and replayed (as a decode
server runs; launch overhead gone). With ``--stream L``, also ``stream``: L distinct layers of the shape
(bf16, FP8 and W4A8 weights each; 16 of them exceed L2 at these shapes) called one after the other on the same
input in one CUDA graph, the replay's time / L, as a model's decode step runs its projections: weights from HBM, no
L2 flush or timing event between two layers (``do_bench`` still flushes before each replay). Ratios are the
baselines' times over each row's time, same run and same mode (> 1: faster than the baseline). Accuracy: relative
L1 against the bf16 ``F.linear`` output on the same inputs (M = ``--acc-m`` tokens of N(0, 1), weights N(0, 0.02²)).
``--tune`` times the layer's configurations instead (``w4a8_linear_2d``, quantization included, as
CUDA-graph replays: GPU time; decode kernel for M ≤ 16, tiled above;
``tune.csv``, and ``best_table.json``: the best configuration per M bucket, which ``--configs``
runs with). ``--device cpu`` (with
``--quick``) is a smoke run of the whole pipeline with a wall-clock timer.

Writes ``speed.csv``, ``accuracy.csv``, ``bench.json`` (GPU, versions, commit, config, rows),
``summary.md`` and ``bench.png`` under ``--out``.

Usage::

    QP_GIT_SHA=$(git rev-parse HEAD) python eval/bench_linear.py --out eval/results/bench_linear/h200
    python eval/bench_linear.py --tune --out /tmp/tune
    python eval/bench_linear.py --tokens 1 16 --stream 16 --no-accuracy --out /tmp/decode
    python eval/bench_linear.py --quick --device cpu --out /tmp/bench_linear
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import bench, graph_replays, write_csv  # noqa: E402  (the shared benchmark harness, beside this script)

from quantpatch.environment import environment_info  # noqa: E402
from quantpatch.fp8_linear import FP8Linear  # noqa: E402
from quantpatch.metrics import rel_l1  # noqa: E402
from quantpatch.w4a8_linear import W4A8Linear  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "eval" / "results" / "bench_linear"
LLAMA_8B_SHAPES = ((4096, 4096), (4096, 14336), (14336, 4096))  # (K, N): q/o_proj, gate/up_proj, down_proj
TOKENS = (1, 16, 128, 1024, 4096)
QUICK_CPU_SHAPES, QUICK_CPU_TOKENS = ((256, 384),), (1, 16)
BASELINES = ("bf16", "fp8-tensor", "fp8-rowwise")
GELU_BASELINE = "bf16 + gelu"  # the vs_bf16 baseline of the --gelu rows
L2_ROTATE_BYTES = 256 * 2**20
LINE_STYLES = {"eager": "-", "graph": "--", "stream": ":"}
logger = logging.getLogger("quantpatch").getChild("eval.bench_linear")


def cpu_time(fn: Callable[[int], object], n_sets: int, warmup: int, rep: int) -> float:
    """Median milliseconds of ``fn(i)`` by wall clock (the CPU smoke run; ``warmup``/``rep`` are call counts)."""
    for i in range(warmup):
        fn(i % n_sets)
    times = []
    for i in range(rep):
        t0 = time.perf_counter()
        fn(i % n_sets)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


class Layer:
    """One (K, N) projection in every format: bf16 weight, W4A8 and FP8 modules, FP8 weight with both scale kinds;
    with ``gelu``, also the FP8 module that applies a tanh GELU to its input (``fp8_gelu``)."""

    def __init__(self, k: int, n: int, device: torch.device, seed: int, gelu: bool = False):
        gen = torch.Generator(device="cpu").manual_seed(seed)
        self.weight = (torch.randn(n, k, generator=gen) * 0.02).to(device=device, dtype=torch.bfloat16)
        lin = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(self.weight)
        self.w4a8 = W4A8Linear.from_linear(lin)
        self.w4a8_lut = W4A8Linear.from_linear(lin, weight_operand="lut")
        self.fp8 = FP8Linear.from_linear(lin)
        if gelu:
            self.fp8_gelu = FP8Linear.from_linear(lin)
            self.fp8_gelu.activation = "gelu_tanh"
        w = self.weight.float()
        self.w_scale_tensor = w.abs().amax() / 448
        self.w_fp8_tensor = (w / self.w_scale_tensor).to(torch.float8_e4m3fn)
        self.w_scale_row = w.abs().amax(1, keepdim=True) / 448  # (N, 1)
        self.w_fp8_row = (w / self.w_scale_row).to(torch.float8_e4m3fn)
        self.w_scale_row = self.w_scale_row.T.contiguous()  # (1, N) for _scaled_mm

    def fp8_operands(self, x: torch.Tensor) -> dict:
        """Per-tensor and per-token FP8 activations for ``_scaled_mm`` (fp32 scales)."""
        xf = x.float()
        st = xf.abs().amax() / 448
        sr = xf.abs().amax(1, keepdim=True) / 448
        return dict(tensor=((xf / st).to(torch.float8_e4m3fn), st), rowwise=((xf / sr).to(torch.float8_e4m3fn), sr))

    def scaled_mm(self, kind: str, x_fp8: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
        if kind == "tensor":
            w, s = self.w_fp8_tensor, self.w_scale_tensor
        else:
            w, s = self.w_fp8_row, self.w_scale_row
        return torch._scaled_mm(x_fp8, w.T, x_scale, s, out_dtype=torch.bfloat16)

    def w4a8_args(self) -> tuple:
        m = self.w4a8
        return m.qweight, m.scales, m.pts_exp, m.bias


def _inputs(m: int, k: int, n_sets: int, device: torch.device, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(m, k, generator=gen).to(device=device, dtype=torch.bfloat16) for _ in range(n_sets)]


def gelu(x: torch.Tensor) -> torch.Tensor:
    """The tanh GELU of Diffusers' feed-forwards (``F.gelu(x, approximate="tanh")``)."""
    return torch.nn.functional.gelu(x, approximate="tanh")


def _timer(device: torch.device) -> Callable:
    return bench if device.type == "cuda" else cpu_time


def _measured_row(args, fn: Callable[[int], object], n_sets: int, mode: str, k: int, n: int, m: int, impl: str,
                  calls: int = 1) -> dict | None:
    """``fn(i)`` over ``n_sets`` input sets, timed as called (``eager``, and every mode on the CPU) or as CUDA-graph
    replays, as a speed row with the time of one layer call (``fn`` makes ``calls`` of them); None, with a warning,
    where ``fn`` cannot take the shape (a baseline the GPU lacks)."""
    try:
        run = graph_replays(fn, n_sets) if mode != "eager" and args.device.type == "cuda" else fn
        run(0)
        ms = _timer(args.device)(run, n_sets, args.warmup, args.rep) / calls
    except RuntimeError as err:
        logger.warning("%s (%s) failed at M=%d K=%d N=%d: %s", impl, mode, m, k, n, err)
        return None
    return dict(k=k, n=n, m=m, impl=impl, mode=mode, ms=ms, tflops=2.0 * m * n * k / (ms * 1e-3) / 1e12)


def speed_rows(args) -> list[dict]:
    rows = []
    kernels = args.device.type == "cuda"
    modes = ("eager", "graph") if kernels else ("eager",)
    if kernels:
        from quantpatch.kernels.w4a8 import w4a8_triton as wt
    for m, (k, n) in itertools.product(args.tokens, args.shapes):  # small M first: a time-boxed run keeps decode
        layer = Layer(k, n, args.device, seed=k + n, gelu=args.gelu)
        n_sets = max(1, min(4, L2_ROTATE_BYTES // (m * k * 2 + n * k * 2)))
        xs = _inputs(m, k, n_sets, args.device, seed=m)
        shape_rows = []

        def timed(impl, fn):
            for mode in modes:
                row = _measured_row(args, fn, n_sets, mode, k, n, m, impl)
                if row is not None:
                    shape_rows.append(row)

        timed("bf16", lambda i: torch.nn.functional.linear(xs[i], layer.weight))
        fp8 = [layer.fp8_operands(x) for x in xs]
        for kind in ("tensor", "rowwise"):
            timed(f"fp8-{kind}", lambda i, kind=kind: layer.scaled_mm(kind, *fp8[i][kind]))
        timed("fp8 e2e", lambda i: layer.fp8(xs[i]))
        if args.gelu:
            timed(GELU_BASELINE, lambda i: torch.nn.functional.linear(gelu(xs[i]), layer.weight))
            timed("fp8 e2e + gelu", lambda i: layer.fp8(gelu(xs[i])))
            timed("fp8 e2e, gelu fused", lambda i: layer.fp8_gelu(xs[i]))
        timed("w4a8 e2e", lambda i: layer.w4a8(xs[i]))
        timed("w4a8-lut e2e", lambda i: layer.w4a8_lut(xs[i]))
        if kernels:
            args_w = layer.w4a8_args()
            gluon = wt.uses_gluon(m, n, k, args.device)
            prefill = gluon and wt.gemm_config(m, n, k)["kernel"] != "decode"
            quant = [wt.quantize_activation_fp8(x, fragment_order=gluon) for x in xs]  # both Gluon GEMMs' order
            if prefill:
                from quantpatch.kernels.w4a8.w4a8_prefill_gluon import w4a8_gemm_prefill_gluon as gemm
            elif gluon:
                from quantpatch.kernels.w4a8.w4a8_gluon import w4a8_gemm_gluon as gemm
            else:
                gemm = wt.w4a8_gemm
            timed("w4a8 gemm", lambda i: gemm(*quant[i], *args_w, torch.bfloat16))
            timed("w4a8 quant", lambda i: wt.quantize_activation_fp8(xs[i], fragment_order=gluon))
            if gluon:  # the Triton decode or tiled path on the same inputs
                cfg = wt.gemm_config(m, n, k)
                timed("triton e2e", lambda i: wt.w4a8_linear_2d(xs[i], *args_w, config=cfg))
        rows += _with_ratios(shape_rows)
        layer = xs = quant = fp8 = None
        if kernels:
            torch.cuda.empty_cache()
    return rows


def _with_ratios(shape_rows: list[dict]) -> list[dict]:
    """Each row of one (K, N, M) with ``vs_<baseline>`` (the baseline's time in the same mode / the row's), printed."""
    base = {(r["impl"], r["mode"]): r["ms"] for r in shape_rows if r["impl"] in (*BASELINES, GELU_BASELINE)}
    for r in shape_rows:
        gelu_row = "gelu" in r["impl"]  # compared with bf16 + gelu only
        for b in BASELINES:
            if gelu_row:
                b_ms = base.get((GELU_BASELINE, r["mode"])) if b == "bf16" else None
            else:
                b_ms = base.get((b, r["mode"]))
            r[f"vs_{b}"] = b_ms / r["ms"] if b_ms is not None and r["impl"] != "w4a8 quant" else ""
        print(f"K={r['k']:5d} N={r['n']:5d} M={r['m']:4d} {r['impl']:>11s} {r['mode']:>6s} {r['ms']:8.4f} ms "
              f"{r['tflops']:7.1f} TFLOPS  " + "  ".join(f"x{r[f'vs_{b}'] or 0:5.2f} {b}" for b in BASELINES),
              flush=True)
    return shape_rows


def stream_rows(args) -> list[dict]:
    """``stream`` rows (module docstring): per shape, ``args.stream`` layers built once, then each M."""
    rows = []
    for k, n in args.shapes:
        layers = [Layer(k, n, args.device, seed=k + n + i) for i in range(args.stream)]
        for m in args.tokens:
            x = _inputs(m, k, 1, args.device, seed=m)[0]
            fp8 = [layer.fp8_operands(x) for layer in layers]
            impls = {"bf16": lambda: [torch.nn.functional.linear(x, layer.weight) for layer in layers],
                     "fp8 e2e": lambda: [layer.fp8(x) for layer in layers],
                     "w4a8 e2e": lambda: [layer.w4a8(x) for layer in layers]}
            for kind in ("tensor", "rowwise"):
                impls[f"fp8-{kind}"] = lambda kind=kind: [layer.scaled_mm(kind, *ops[kind])
                                                          for layer, ops in zip(layers, fp8)]
            measured = (_measured_row(args, lambda i, fn=fn: fn(), 1, "stream", k, n, m, impl, calls=args.stream)
                        for impl, fn in impls.items())
            rows += _with_ratios([row for row in measured if row is not None])
        layers = fp8 = None
        if args.device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def accuracy_rows(args) -> list[dict]:
    rows = []
    for k, n in args.shapes:
        layer = Layer(k, n, args.device, seed=k + n)
        x = _inputs(args.acc_m, k, 1, args.device, seed=7)[0]
        ref = torch.nn.functional.linear(x, layer.weight)
        fp8 = layer.fp8_operands(x)
        outs = {"w4a8 e2e": layer.w4a8(x), "w4a8-lut e2e": layer.w4a8_lut(x), "fp8 e2e": layer.fp8(x)}
        for kind in ("tensor", "rowwise"):
            try:
                outs[f"fp8-{kind}"] = layer.scaled_mm(kind, *fp8[kind])
            except RuntimeError as err:
                logger.warning("fp8-%s failed at M=%d K=%d N=%d: %s", kind, args.acc_m, k, n, err)
        for impl, y in outs.items():
            rows.append(dict(k=k, n=n, m=args.acc_m, impl=impl, rel_l1_vs_bf16=rel_l1(y, ref),
                             weight_bytes=layer.w4a8.weight_nbytes() if impl.startswith("w4a8") else n * k,
                             bf16_weight_bytes=2 * n * k))
            print(f"accuracy K={k} N={n} M={args.acc_m} {impl:>11s} rel-L1 vs bf16 {rows[-1]['rel_l1_vs_bf16']:.5f} "
                  f"weight x{rows[-1]['bf16_weight_bytes'] / rows[-1]['weight_bytes']:.2f} smaller than bf16")
    return rows


def tune_candidates(m: int) -> list[dict]:
    """``GEMM_CONFIGS`` entries timed by ``--tune`` at ``m`` tokens: the decode kernel (M ≤ 16) or FP8 tiles."""
    from quantpatch.kernels.w4a8 import w4a8_triton as wt

    if m <= wt.DECODE_BLOCK_M:
        swapped = [dict(kernel="decode", block_n=bn, gps=gps, fused=f, swap=1, num_warps=w)
                   for (bn, w), gps, f in itertools.product(((64, 4), (128, 4), (128, 8)), (2, 4, 8), (0, 1))]
        return swapped + [dict(kernel="decode", block_n=64, gps=4, fused=f, swap=0, num_warps=4) for f in (0, 1)]
    plain = [dict(kernel="tiled", block_m=128, block_n=bn, swap=0, num_warps=w, num_stages=st)
             for bn, w, st in ((64, 4, 3), (64, 4, 4), (128, 8, 3))]
    swapped = [dict(kernel="tiled", block_m=bm, block_n=bn, swap=1, num_warps=w, num_stages=st)
               for bm, bn, w in ((128, 64, 4), (64, 128, 4), (128, 128, 8), (128, 256, 8), (256, 128, 8))
               for st in (3, 4)]
    return plain + swapped


TABLE_BUCKETS = (16, 256, None)  # the max-M rows of ``w4a8_triton.GEMM_CONFIGS``


def best_table(rows: list[dict]) -> list:
    """``GEMM_CONFIGS`` rows from a sweep: per M bucket, the configuration with the least geometric mean of
    (its time / the best time) over the bucket's (shape, M) points (only configurations timed at all of them)."""
    table, lo = [], 0
    for hi in TABLE_BUCKETS:
        pts = {(r["k"], r["n"], r["m"]) for r in rows if r["m"] > lo and (hi is None or r["m"] <= hi)}
        lo = hi or 0
        if not pts:
            continue
        best_ms = {p: min(r["ms"] for r in rows if (r["k"], r["n"], r["m"]) == p) for p in pts}
        score: dict = {}
        for r in rows:
            p = (r["k"], r["n"], r["m"])
            if p in pts:
                score.setdefault(r["config"], []).append(math.log(r["ms"] / best_ms[p]))
        full = {c: sum(v) / len(v) for c, v in score.items() if len(v) == len(pts)}
        if full:
            table.append([hi, json.loads(min(full, key=full.get))])
    return table


def tune_rows(args) -> list[dict]:
    from quantpatch.kernels.w4a8 import w4a8_triton as wt

    rows = []
    for (k, n), m in itertools.product(args.shapes, args.tokens):
        layer = Layer(k, n, args.device, seed=k + n)
        x = _inputs(m, k, 1, args.device, seed=m)[0]
        w = layer.w4a8_args()
        # the whole layer (quantization included), as CUDA-graph replays: GPU time, not host overhead
        bf16_ms = bench(graph_replays(lambda i: torch.nn.functional.linear(x, layer.weight), 1), 1, args.warmup,
                        args.rep)
        best = None
        for cfg in tune_candidates(m):
            try:
                run = graph_replays(lambda i, c=cfg: wt.w4a8_linear_2d(x, *w, config=c), 1)
                ms = bench(run, 1, args.warmup, args.rep)
            except Exception as err:  # a configuration the compiler rejects (resources, ...)
                print(f"tune K={k} N={n} M={m} {cfg}: failed: {type(err).__name__}: {str(err)[:160]}")
                continue
            rows.append(dict(k=k, n=n, m=m, config=json.dumps(cfg, sort_keys=True), ms=ms, vs_bf16=bf16_ms / ms))
            print(f"tune K={k} N={n} M={m} {rows[-1]['config']} {ms * 1e3:.1f} us x{bf16_ms / ms:.2f} bf16", flush=True)
            if best is None or ms < best["ms"]:
                best = rows[-1]
        print(f"tune K={k} N={n} M={m} bf16 {bf16_ms:.4f} ms; best {best}", flush=True)
        # written after every point: a time-boxed sweep still leaves its table
        write_csv(args.out / "tune.csv", rows)
        (args.out / "best_table.json").write_text(json.dumps(best_table(rows)))
        layer = None
        torch.cuda.empty_cache()
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({(r["k"], r["n"]) for r in rows})
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4), squeeze=False)
    impls = sorted({r["impl"] for r in rows if r["impl"] != "w4a8 quant"})
    color = {impl: plt.get_cmap("tab10")(i % 10) for i, impl in enumerate(impls)}
    for ax, (k, n) in zip(axes[0], shapes):
        sel = [r for r in rows if (r["k"], r["n"]) == (k, n) and r["impl"] != "w4a8 quant"]
        for impl, mode in sorted({(r["impl"], r["mode"]) for r in sel}):
            pts = sorted((r["m"], r["vs_bf16"]) for r in sel if (r["impl"], r["mode"]) == (impl, mode))
            ax.plot([p[0] for p in pts], [p[1] for p in pts], LINE_STYLES[mode], color=color[impl],
                    marker="o" if mode == "eager" else "x", ms=3, label=f"{impl} ({mode})")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens M")
        ax.set_ylabel("speed-up over bf16 F.linear (same mode)")
        ax.set_title(f"{k} → {n}")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summary_md(meta: dict, speed: list[dict], acc: list[dict]) -> str:
    lines = [f"# Linear benchmark ({meta['device']})", "",
             f"torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}, commit {meta['git_sha']}, "
             f"{meta['date']}", "", f"Command: `{meta['command']}`", ""]
    if speed:
        lines += ["| K | N | M | impl | mode | ms | TFLOPS | × bf16 | × fp8-tensor | × fp8-rowwise |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(speed, key=lambda r: (r["k"], r["n"], r["m"])):
            ratios = " | ".join(f"{r[f'vs_{b}']:.2f}" if r[f"vs_{b}"] != "" else "" for b in BASELINES)
            lines.append(f"| {r['k']} | {r['n']} | {r['m']} | {r['impl']} | {r['mode']} | {r['ms']:.4f} | "
                         f"{r['tflops']:.1f} | {ratios} |")
    if acc:
        lines += ["", "| K | N | M | impl | rel-L1 vs bf16 | weight bytes × smaller than bf16 |",
                  "|---|---|---|---|---|---|"]
        for r in acc:
            lines.append(f"| {r['k']} | {r['n']} | {r['m']} | {r['impl']} | {r['rel_l1_vs_bf16']:.5f} | "
                         f"{r['bf16_weight_bytes'] / r['weight_bytes']:.2f} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--shapes", nargs="+", default=[f"{k}x{n}" for k, n in LLAMA_8B_SHAPES],
                   help="K x N, e.g. 4096x14336")
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up (ms; calls on the CPU)")
    p.add_argument("--rep", type=int, default=100, help="do_bench measurement time (ms; calls on the CPU)")
    p.add_argument("--acc-m", type=int, default=128, help="tokens of the accuracy measurement")
    p.add_argument("--stream", type=int, default=0, metavar="L",
                   help="also time streams of L distinct layers in one CUDA graph (mode 'stream'; 0: off)")
    p.add_argument("--no-accuracy", action="store_true")
    p.add_argument("--gelu", action="store_true",
                   help="also time the layer after a tanh GELU: bf16, FP8 after F.gelu, FP8 with the GELU fused")
    p.add_argument("--quick", action="store_true", help="CPU: one 256x384 shape at M in {1, 16}, 3 calls")
    p.add_argument("--tune", action="store_true", help="time GEMM tile configurations instead (GEMM only)")
    p.add_argument("--configs", type=Path, help="GEMM_CONFIGS rows (best_table.json of --tune) to run with")
    args = p.parse_args(argv)
    args.device = torch.device(args.device)
    args.shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    if args.quick and args.device.type == "cpu":
        args.shapes, args.tokens, args.warmup, args.rep, args.acc_m = QUICK_CPU_SHAPES, QUICK_CPU_TOKENS, 1, 3, 16
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_linear --device cuda needs a CUDA GPU (use --quick --device cpu for a smoke run)")
    if args.tune and args.device.type != "cuda":
        raise SystemExit("--tune times the Triton GEMM and needs a CUDA GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.configs is not None:
        from quantpatch.kernels.w4a8 import w4a8_triton as wt

        tuned = {max_m: cfg for max_m, cfg in json.loads(args.configs.read_text())}  # rows it has replace the table's
        wt.GEMM_CONFIGS = tuple((max_m, tuned.get(max_m, cfg)) for max_m, cfg in wt.GEMM_CONFIGS)
    meta = environment_info(args.device, REPO_ROOT)
    meta["config"] = {k: (str(v) if isinstance(v, (Path, torch.device)) else v) for k, v in vars(args).items()}
    print(json.dumps({k: v for k, v in meta.items() if k != "config"}), flush=True)
    if args.tune:
        rows = tune_rows(args)
        (args.out / "tune.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        return dict(meta=meta, tune=rows)
    if args.device.type == "cuda":
        from quantpatch.kernels.w4a8 import w4a8_triton as wt

        meta["gemm_configs"] = wt.GEMM_CONFIGS
    speed = speed_rows(args) + (stream_rows(args) if args.stream > 0 else [])
    acc = [] if args.no_accuracy else accuracy_rows(args)
    write_csv(args.out / "speed.csv", speed)
    write_csv(args.out / "accuracy.csv", acc)
    result = dict(meta=meta, speed=speed, accuracy=acc)
    (args.out / "bench.json").write_text(json.dumps(result, indent=1))
    (args.out / "summary.md").write_text(summary_md(meta, speed, acc))
    plot(speed, args.out / "bench.png")
    return result


if __name__ == "__main__":
    main()
