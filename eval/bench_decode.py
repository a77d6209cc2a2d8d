"""Decode-attention latency and KV-cache memory: TurboAttention's compressed cache vs SDPA over a bf16 cache.

One Llama-3-8B-shaped attention layer (32 query heads, 8 KV heads, D = 128) decodes one token
(q_len = 1) against a cache of ``N`` tokens, for batch ``B`` ∈ {1, 8, 32} × ``N`` ∈ {4k, 16k, 32k, 64k}:

* ``sdpa-bf16``: ``F.scaled_dot_product_attention(q, K, V, enable_gqa=True)`` on bf16 ``(B, 8, N, 128)``
  K/V (the cache Transformers keeps), PyTorch's own backend choice: the baseline, timed in the same run;
  ``sdpa-flash`` / ``sdpa-cudnn``: the same forced to one backend (skipped where it declines the call);
* ``turbo-ref``: ``turbo_cache_attention`` on a ``TurboLayer`` (the PyTorch reference: it dequantizes
  the cache to the INT8 grid in float32, so it is slow and large; rows it cannot hold are skipped);
* ``turbo-triton``: the Triton decode kernel ``kernels/turbo_kv/turbo_decode_triton.py`` (packed INT4/INT2 →
  INT8 in registers, INT8 dots, SAS, split over the sequence, the splits merged by the last one to finish:
  one launch per code-width group);
* ``turbo-gluon``: what ``turbo_decode_attention`` runs by default: the Gluon kernel
  ``kernels/turbo_kv/turbo_decode_gluon.py`` (sm_90: the codes as ``mma`` operands straight from registers, one warp a
  program) for the 4-bit heads, the Triton kernel for the others (rows skipped where Gluon takes no head).

Two times per row: ``ms`` (eager: each call launched from Python, so a call whose GPU work is shorter than
its host launch cost is timed at the host's pace) and ``graph_ms`` (the GPU time of one call: ``GRAPH_CALLS``
calls captured in a CUDA graph, one replay timed and divided; this is how decoding runs under CUDA graphs,
e.g. ``generate()`` with a static cache and ``torch.compile``; calls 2-8 of a replay may find a cache smaller
than L2 still there, for SDPA and turbo alike). ``speedup_vs_sdpa`` divides the ``sdpa-bf16``
time by each row's (eager), ``graph_speedup_vs_sdpa`` the same for graph times, ``speedup_vs_best_sdpa`` the
fastest SDPA backend's (eager). ``--sweep`` first times the kernel's launch options (warps, pipeline stages, splits)
at one ``B × N`` and writes ``sweep.csv``.

The compressed cache is synthesized in its stored layout (random codes, each code width's heads views of one
tensor as a real cache keeps them; ``s^int`` ∈ [1, 16], ``z^int``, block scales), since latency does not depend on
the values; ``--check`` compresses real data at a small size and compares the bytes stored and the code layout.
Memory is what the layer stores (packed codes, INT8 ``s^int``/``z^int``, FP32 block scales, the INT8 buffer and its
scale) next to the bf16 cache, per layer and for the 32-layer model; ``max_batch`` is the largest batch whose 32-layer
KV cache fits in ``--memory-gib`` (default: the device's memory) less the bf16 weights of an 8B model.

Times are medians: ``triton.testing.do_bench`` on CUDA (warm-up, then ``--rep`` ms), a
``perf_counter`` loop on CPU. Writes ``decode.csv``, ``bench.json`` (machine, versions, git SHA,
config, rows), ``decode.png`` and ``summary.md`` under ``--out``.

Usage::

    QP_GIT_SHA=$(git rev-parse HEAD) python eval/bench_decode.py --out eval/results/bench_decode     # GPU
    python eval/bench_decode.py --quick --device cpu --out /tmp/bench_decode                          # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import warm_up_on_side_stream, write_csv  # noqa: E402  (the shared benchmark harness, beside this script)

from quantpatch.environment import environment_info  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "eval" / "results" / "bench_decode"
HEADS, KV_HEADS, HEAD_DIM, LAYERS = 32, 8, 128, 32  # Llama-3-8B
WEIGHT_BYTES_8B = 8.03e9 * 2  # bf16 weights of Llama-3-8B
IMPLS = ("sdpa-bf16", "sdpa-flash", "sdpa-cudnn", "turbo-ref", "turbo-triton", "turbo-gluon")
SDPA_BACKENDS = {"sdpa-flash": "FLASH_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION"}
logger = logging.getLogger("quantpatch").getChild("eval.bench_decode")


# --------------------------------------------------------------------------- caches


def synthetic_turbo_layer(
    b: int, n: int, bits: Sequence[int], *, device: str, seed: int = 0, kv_heads: int = KV_HEADS, d: int = HEAD_DIM
):
    """A ``TurboLayer`` holding ``n`` tokens in the stored layout, values random (latency does not depend on them):
    each code width's heads are views of one ``(B, H_w, N, D·w/8)`` tensor, as a real cache keeps them (the decode
    kernels then address the heads without an offsets table)."""
    from quantpatch.kernels.turbo_kv.turbo_ref import CompressedKV, Int8Buffer, bit_groups, width_views
    from quantpatch.patches.transformers.turbo_cache import TurboLayer

    layer = TurboLayer(kv_heads, d, bits, bits, layer_idx=0)
    gen = torch.Generator(device=device).manual_seed(seed)
    t, tail = divmod(n, layer.block)

    def blocks() -> CompressedKV:
        widths = bit_groups(layer.k_bits)  # one (B, H_w, N, D·w/8) tensor per width, its heads' codes views of it
        codes = width_views([torch.randint(0, 256, (b, len(heads), t * layer.block, d * w // 8), generator=gen,
                                           device=device, dtype=torch.uint8) for (w,), heads in widths], layer.k_bits)
        s_int = torch.randint(1, 17, (b, kv_heads, t, d), generator=gen, device=device, dtype=torch.int8)
        # z^int with (q + z)·s inside ±119 for every 4-bit code: z ∈ [-119/s, 119/s − 15].
        z = (torch.rand(b, kv_heads, t, d, generator=gen, device=device) * 2 - 1) * (119 / s_int.float() - 7.5) - 7.5
        block_scale = torch.rand(b, kv_heads, t, generator=gen, device=device) * 0.05 + 0.01
        return CompressedKV(codes, s_int, z.round().to(torch.int8), block_scale, tuple(layer.k_bits), layer.block)

    def buffer() -> Int8Buffer:
        values = torch.randint(-119, 120, (b, kv_heads, tail, d), generator=gen, device=device, dtype=torch.int8)
        return Int8Buffer(values, torch.full((b, kv_heads, 1, 1), 0.03, device=device))

    layer.k_blocks, layer.v_blocks, layer.k_buffer, layer.v_buffer = blocks(), blocks(), buffer(), buffer()
    layer.dtype, layer.device, layer.batch, layer.is_initialized = torch.bfloat16, torch.device(device), b, True
    layer.cumulative_length = n
    return layer


def turbo_bytes(b: int, n: int, bits: Sequence[int]) -> int:
    """K + V bytes of one layer, FP32 block scales (as ``TurboLayer`` stores them)."""
    from quantpatch.kernels.turbo_kv.turbo_ref import turbo_kv_bytes

    return 2 * turbo_kv_bytes(n, HEAD_DIM, list(bits), batch=b, scale_bytes=4)


def bf16_bytes(b: int, n: int) -> int:
    return 2 * 2 * b * KV_HEADS * n * HEAD_DIM


def code_layout(layer) -> list[tuple]:
    """Of K and V: each head's codes' shape, strides and offset in its storage, and the storages of each width."""
    from quantpatch.kernels.turbo_kv.turbo_ref import bit_groups

    return [(tuple((tuple(c.shape), c.stride(), c.storage_offset()) for c in blocks.codes),
             tuple(len({blocks.codes[h].untyped_storage().data_ptr() for h in heads})
                   for _, heads in bit_groups(blocks.bits)))
            for blocks in (layer.k_blocks, layer.v_blocks)]


def check_layout(device: str) -> None:
    """Synthetic and really compressed layers store the same bytes in the same code layout (each width's heads views
    of one tensor), and the reference attention runs on both."""
    from quantpatch.patches.transformers.turbo_cache import TurboLayer, turbo_cache_attention

    b, n, bits = 2, 64 * 3 + 5, (4, 2) * (KV_HEADS // 2)
    real = TurboLayer(KV_HEADS, HEAD_DIM, bits, bits)
    gen = torch.Generator(device=device).manual_seed(1)
    kv = torch.randn(2, b, KV_HEADS, n, HEAD_DIM, generator=gen, device=device)
    real.update(kv[0], kv[1])
    fake = synthetic_turbo_layer(b, n, bits, device=device)
    if real.nbytes() != fake.nbytes() or real.nbytes() != turbo_bytes(b, n, bits):
        raise AssertionError(f"layouts differ: real {real.nbytes()}, synthetic {fake.nbytes()}, "
                             f"formula {turbo_bytes(b, n, bits)}")
    if code_layout(real) != code_layout(fake):
        raise AssertionError(f"code layouts differ: real {code_layout(real)}, synthetic {code_layout(fake)}")
    q = torch.randn(b, HEADS, 1, HEAD_DIM, generator=gen, device=device)
    for layer in (real, fake):
        if not torch.isfinite(turbo_cache_attention(q, layer)).all():
            raise AssertionError("reference decode produced non-finite values")


# --------------------------------------------------------------------------- implementations


def _triton_decode() -> Callable | None:
    try:
        from quantpatch.kernels.turbo_kv.turbo_decode_triton import turbo_decode_attention
    except ImportError:  # no Triton
        return None
    return turbo_decode_attention


def ref_fits(b: int, n: int, device: str, budget_gib: float) -> bool:
    """The reference dequantizes K and V to float32 and expands them to 32 heads: ~ 2·(4 + 4·4)·B·Hkv·N·D bytes."""
    need = 2 * (4 + 4 * HEADS // KV_HEADS) * b * KV_HEADS * n * HEAD_DIM
    return need <= budget_gib * 2**30


def make_runner(impl: str, b: int, n: int, bits: Sequence[int], device: str, n_sets: int, **launch):
    """``(fn(i), None)`` timing one decode step of ``impl``, or ``(None, reason)``; ``launch``: kernel options."""
    gen = torch.Generator(device=device).manual_seed(0)
    qs = [torch.randn(b, HEADS, 1, HEAD_DIM, generator=gen, device=device).to(torch.bfloat16) for _ in range(n_sets)]
    if impl.startswith("sdpa"):
        k = torch.randn(b, KV_HEADS, n, HEAD_DIM, generator=gen, device=device).to(torch.bfloat16)
        v = torch.randn(b, KV_HEADS, n, HEAD_DIM, generator=gen, device=device).to(torch.bfloat16)
        return sdpa_runner(impl, qs, k, v)
    layer = synthetic_turbo_layer(b, n, bits, device=device)
    if impl == "turbo-ref":
        from quantpatch.patches.transformers.turbo_cache import turbo_cache_attention

        return (lambda i: turbo_cache_attention(qs[i], layer, use_kernel=False)), None
    kernel = _triton_decode()
    if kernel is None:
        return None, "Triton is not installed"
    if not device.startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
        return None, "the Triton kernel needs CUDA (or TRITON_INTERPRET=1 on CPU)"
    parts = (layer.k_blocks, layer.v_blocks, layer.k_buffer, layer.v_buffer)
    if impl == "turbo-gluon":
        from quantpatch.kernels.turbo_kv.turbo_decode_triton import gluon_takes

        if not any(gluon_takes(torch.device(device), HEADS // KV_HEADS, 1, HEAD_DIM, w, w, n // 64) for w in bits):
            return None, "the Gluon kernel takes no head of this cache here"
        return (lambda i: kernel(qs[i], *parts, **launch)), None
    return (lambda i: kernel(qs[i], *parts, kernel="triton", **launch)), None


def sdpa_runner(impl: str, qs: list[torch.Tensor], k: torch.Tensor, v: torch.Tensor):
    """``(fn(i), None)`` for SDPA with PyTorch's backend choice or one forced backend; ``(None, reason)``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa = torch.nn.functional.scaled_dot_product_attention
    if impl == "sdpa-bf16":
        return (lambda i: sdpa(qs[i], k, v, enable_gqa=True)), None
    backend = getattr(SDPBackend, SDPA_BACKENDS[impl])

    def fn(i: int):
        with sdpa_kernel(backend):
            return sdpa(qs[i], k, v, enable_gqa=True)

    try:
        fn(0)
    except RuntimeError as err:  # the backend declines this call (GQA, device, build)
        return None, f"{SDPA_BACKENDS[impl]} declined: {str(err).splitlines()[0][:80]}"
    return fn, None


GRAPH_CALLS = 8  # decode calls captured back to back in one CUDA graph (cycling the query sets)


def graph_runner(fn: Callable[[int], object], n_sets: int) -> Callable[[int], object]:
    """``fn`` replayed from a CUDA graph: ``GRAPH_CALLS`` calls captured back to back (query sets in turn), so
    that timing one replay / ``GRAPH_CALLS`` is the GPU time of a call with no host launch cost in it (how
    ``generate()`` runs under CUDA graphs). Warm-up on the capture stream first (compilation, cached workspaces)."""
    stream = warm_up_on_side_stream(fn, n_sets)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(GRAPH_CALLS):
            fn(i % n_sets)
    return lambda i: graph.replay()


def bench_ms(fn: Callable[[int], object], device: str, n_sets: int, warmup: int, rep: int) -> float:
    """Median milliseconds of ``fn(i)``, ``i`` cycling over ``n_sets`` query sets."""
    counter = iter(range(10**12))
    if device.startswith("cuda"):
        import triton.testing

        return float(triton.testing.do_bench(lambda: fn(next(counter) % n_sets), warmup=warmup, rep=rep,
                                             return_mode="median"))
    for _ in range(2):
        fn(0)
    times, start = [], time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start) * 1e3 < rep:
        t0 = time.perf_counter()
        fn(next(counter) % n_sets)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# --------------------------------------------------------------------------- rows


def memory_budget_bytes(args: argparse.Namespace) -> float:
    if args.memory_gib is not None:
        total = args.memory_gib * 2**30
    elif args.device.startswith("cuda"):
        total = torch.cuda.get_device_properties(args.device).total_memory
    else:
        total = 80 * 2**30  # an H100's memory, for the analytic column on CPU
    return total * 0.95 - WEIGHT_BYTES_8B


def bit_settings(args: argparse.Namespace) -> dict[str, tuple[int, ...]]:
    settings = {f"turbo-{args.bits}b": (args.bits,) * KV_HEADS}
    if args.mixed:
        settings["turbo-mixed"] = (args.bits, 2) * (KV_HEADS // 2)  # half the KV heads at 2 bits
    return settings


def memory_rows(args: argparse.Namespace) -> list[dict]:
    budget = memory_budget_bytes(args)
    rows = []
    for n in args.contexts:
        per_seq = {"bf16": bf16_bytes(1, n)}
        per_seq |= {name: turbo_bytes(1, n, bits) for name, bits in bit_settings(args).items()}
        for name, nbytes in per_seq.items():
            rows.append({
                "cache": name, "context": n, "bytes_per_seq_layer": nbytes,
                "model_gib_per_seq": LAYERS * nbytes / 2**30,
                "ratio_vs_bf16": per_seq["bf16"] / nbytes,
                "max_batch": max(int(budget // (LAYERS * nbytes)), 0),
            })
    return rows


def speed_rows(args: argparse.Namespace) -> list[dict]:
    rows = []
    settings = bit_settings(args)
    for b in args.batches:
        for n in args.contexts:
            for impl in args.impls:
                sdpa = impl.startswith("sdpa")
                variants = [("bf16", ())] if sdpa else list(settings.items())
                for cache, bits in variants:
                    row = {"impl": impl, "cache": cache, "batch": b, "context": n,
                           "kv_bytes": bf16_bytes(b, n) if sdpa else turbo_bytes(b, n, bits)}
                    if impl == "turbo-ref" and not ref_fits(b, n, args.device, args.ref_budget_gib):
                        rows.append(row | {"ms": math.nan, "graph_ms": math.nan,
                                           "skipped": "reference temporaries exceed --ref-budget-gib"})
                        continue
                    fn, reason = make_runner(impl, b, n, bits, args.device, args.n_sets)
                    if fn is None:
                        rows.append(row | {"ms": math.nan, "graph_ms": math.nan, "skipped": reason})
                        continue
                    ms = bench_ms(fn, args.device, args.n_sets, args.warmup, args.rep)
                    graph_ms, note = math.nan, ""
                    if args.graph and args.device.startswith("cuda"):
                        try:
                            replay = graph_runner(fn, args.n_sets)
                        except RuntimeError as err:  # e.g. the reference builds host tensors: not capturable
                            note = f"no CUDA-graph time: {str(err).splitlines()[0][:120]}"
                            logger.warning("%s B=%d N=%d: %s", impl, b, n, note)
                            torch.cuda.synchronize()
                        else:
                            graph_ms = bench_ms(replay, args.device, 1, args.warmup, args.rep) / GRAPH_CALLS
                            del replay
                    rows.append(row | {"ms": ms, "graph_ms": graph_ms, "skipped": note})
                    del fn
                    if args.device.startswith("cuda"):
                        torch.cuda.empty_cache()
            here = [r for r in rows if r["batch"] == b and r["context"] == n]
            best_ms = min((r["ms"] for r in here if r["impl"].startswith("sdpa") and r["ms"] == r["ms"]),
                          default=None)
            base = next((r for r in here if r["impl"] == "sdpa-bf16" and r["ms"] == r["ms"]), None)
            base_ms, base_graph = (base["ms"], base["graph_ms"]) if base else (None, math.nan)
            for r in here:
                ok = r["ms"] == r["ms"]
                r["speedup_vs_sdpa"] = base_ms / r["ms"] if base_ms and ok else math.nan
                r["speedup_vs_best_sdpa"] = best_ms / r["ms"] if best_ms and ok else math.nan
                r["graph_speedup_vs_sdpa"] = base_graph / r.get("graph_ms", math.nan)
            logger.info("B=%d N=%d done", b, n)
    return rows


def sweep_rows(args: argparse.Namespace) -> list[dict]:
    """Kernel launch options at ``B × N = --sweep-shape``, 4-bit: every (warps, stages, splits) of the grids."""
    from quantpatch.kernels.turbo_kv.turbo_decode_triton import default_num_splits

    b, n = args.sweep_shape
    bits = (args.bits,) * KV_HEADS
    default = default_num_splits(b, KV_HEADS, n // 64, torch.device(args.device))
    rows = []
    for warps in (2, 4, 8):
        for stages in (1, 2, 3):
            for splits in sorted({default // 2, default, default * 2, default * 4} - {0}):
                fn, _ = make_runner("turbo-triton", b, n, bits, args.device, args.n_sets, num_warps=warps,
                                    num_stages=stages, num_splits=splits)
                ms = bench_ms(fn, args.device, args.n_sets, args.warmup, args.rep)
                rows.append({"batch": b, "context": n, "num_warps": warps, "num_stages": stages,
                             "num_splits": splits, "default_splits": default, "ms": ms,
                             "gb_per_s": turbo_bytes(b, n, bits) / ms / 1e6})
                logger.info("sweep %s", rows[-1])
    return rows


# --------------------------------------------------------------------------- output


def machine_info(device: str) -> dict:
    return environment_info(device, REPO_ROOT)


def plot(speed: list[dict], memory: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in speed})
    fig, axes = plt.subplots(1, len(batches) + 1, figsize=(4.5 * (len(batches) + 1), 4), squeeze=False)
    for ax, b in zip(axes[0], batches):
        for impl, cache in sorted({(r["impl"], r["cache"]) for r in speed if r["batch"] == b}):
            pts = sorted((r["context"], r["ms"]) for r in speed
                         if r["batch"] == b and r["impl"] == impl and r["cache"] == cache and r["ms"] == r["ms"])
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=f"{impl} {cache}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("ms per decode step (one layer)")
        ax.set_title(f"batch {b}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax = axes[0][-1]
    for cache in sorted({r["cache"] for r in memory}):
        pts = sorted((r["context"], r["max_batch"]) for r in memory if r["cache"] == cache)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=cache)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("max batch (32-layer KV cache)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def format_tables(speed: list[dict], memory: list[dict]) -> str:
    lines = ["eager: one call timed as Python calls it (host launch cost included where the GPU waits for it); "
             "graph: GPU time per call, replayed from a CUDA graph", "",
             f"{'impl':<13} {'cache':<12} {'B':>3} {'N':>6} {'eager ms':>9} {'x sdpa':>7} {'x best':>7} "
             f"{'graph ms':>9} {'x sdpa':>7} {'KV MiB':>9}  note"]
    for r in speed:
        lines.append(f"{r['impl']:<13} {r['cache']:<12} {r['batch']:>3} {r['context']:>6} {r['ms']:>9.4f} "
                     f"{r.get('speedup_vs_sdpa', math.nan):>7.2f} {r.get('speedup_vs_best_sdpa', math.nan):>7.2f} "
                     f"{r.get('graph_ms', math.nan):>9.4f} {r.get('graph_speedup_vs_sdpa', math.nan):>7.2f} "
                     f"{r['kv_bytes'] / 2**20:>9.2f}  {r['skipped']}")
    lines += ["", f"{'cache':<12} {'N':>6} {'GiB/seq (32 layers)':>20} {'x smaller':>9} {'max batch':>9}"]
    for r in memory:
        lines.append(f"{r['cache']:<12} {r['context']:>6} {r['model_gib_per_seq']:>20.3f} {r['ratio_vs_bf16']:>9.2f} "
                     f"{r['max_batch']:>9}")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32768, 65536])
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--bits", type=int, default=4, choices=[2, 4, 8], help="code width of the turbo cache")
    p.add_argument("--no-mixed", dest="mixed", action="store_false", help="skip the half-2-bit setting")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--memory-gib", type=float, default=None, help="memory for the max-batch column")
    p.add_argument("--ref-budget-gib", type=float, default=None,
                   help="largest float32 temporaries the reference may take (default: 1/3 of memory, 4 on CPU)")
    p.add_argument("--n-sets", type=int, default=4, help="query sets cycled through while timing")
    p.add_argument("--warmup", type=int, default=25)
    p.add_argument("--rep", type=int, default=100, help="timing budget in ms per row")
    p.add_argument("--quick", action="store_true", help="B=1, N in {1k, 2k}: a smoke run")
    p.add_argument("--check", action="store_true", help="compare the synthetic layout with real compression first")
    p.add_argument("--no-graph", dest="graph", action="store_false", help="skip the CUDA-graph timing column")
    p.add_argument("--sweep", action="store_true", help="time the Triton kernel's launch options first")
    p.add_argument("--sweep-shape", type=int, nargs=2, default=[8, 32768], metavar=("B", "N"))
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.contexts, args.warmup, args.rep = [1], [1024, 2048], 1, 20
    if args.ref_budget_gib is None:
        cuda = args.device.startswith("cuda")
        mem = torch.cuda.get_device_properties(args.device).total_memory if cuda else 12 * 2**30
        args.ref_budget_gib = mem / 3 / 2**30
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.check:
        check_layout(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        if args.sweep:
            sweep = sweep_rows(args)
            write_csv(args.out / "sweep.csv", sweep)
            print("\n".join(f"warps {r['num_warps']} stages {r['num_stages']} splits {r['num_splits']:>4}: "
                            f"{r['ms']:.4f} ms {r['gb_per_s']:.0f} GB/s" for r in sweep))
        speed = speed_rows(args)
    memory = memory_rows(args)
    meta = machine_info(args.device)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    config |= {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "layers": LAYERS}
    report = {"machine": meta, "config": config, "speed": speed, "memory": memory}
    table = format_tables(speed, memory)
    print(table)
    write_csv(args.out / "decode.csv", speed)
    write_csv(args.out / "memory.csv", memory)
    (args.out / "bench.json").write_text(json.dumps(report, indent=2, default=str))
    (args.out / "summary.md").write_text(f"# Decode attention ({meta['device']})\n\n```\n{table}\n```\n")
    try:
        plot(speed, memory, args.out / "decode.png")
    except ImportError:
        logger.warning("matplotlib missing: no plot")
    return report


if __name__ == "__main__":
    main()
