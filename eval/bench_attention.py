"""Attention speed: the quantized modes' Triton kernels next to PyTorch SDPA flash and cuDNN, in one run.

For B=4, H=32, D ∈ {64, 128}, N ∈ {1k … 32k}, causal and not, bf16 inputs:

* ``e2e``: ``quantpatch.attention(q, k, v, mode=...)`` from bf16 (quantization included);
* ``e2e-graph`` / ``graph``: the same call (mode / SDPA baseline) captured in a CUDA graph and
  replayed: the GPU time of every launch without the host's launch cost (which bounds the
  eager rows at short lengths); its ratios are against the baselines' graph rows;
* ``quant``: the quantization pass alone (``quantpatch::quantize_qkv``);
* ``kernel``: the attention kernel alone on pre-quantized operands (the one the ``e2e`` call takes,
  ``fast_paths.attention_kernel``);
* ``sdpa-default`` / ``sdpa-flash`` / ``sdpa-cudnn``: ``F.scaled_dot_product_attention`` as PyTorch picks its
  backend / under ``sdpa_kernel(SDPBackend.FLASH_ATTENTION)`` / ``(SDPBackend.CUDNN_ATTENTION)``;
* ``sageattn``: upstream SageAttention's ``sageattn`` end to end, the strongest public peer, when the
  ``sageattention`` package imports; its ``kernel`` row, on sm_90, times that package's sm_90 attention kernel
  alone (``sm90_compile.qk_int8_sv_f8_accum_f32_fuse_v_scale_attn_inst_buf``, the launch its
  ``sageattn_qk_int8_pv_fp8_cuda_sm90`` makes) on operands its own quantization made once: per-thread INT8 Q/K with
  K smoothed by its mean, V FP8 per channel padded to 128 keys, fp32+fp32 accumulation.

``--memory B H N D``: instead of timing, the peak extra GPU memory of one non-causal call from bf16 inputs at that
shape, per mode and SDPA backend: the most allocated during the call above what was allocated before it (inputs
excluded, the output included), in GiB; written to ``memory.csv`` and the summary.

Times are ``triton.testing.do_bench`` medians (warm-up first) cycling over several input sets
when they fit in L2; TFLOPS = 4·B·H·N²·D / t, halved for causal. Ratios are against cuDNN and
flash of the same shape. Accuracy (CosSim, relative L1 against float64 attention) of every
mode and of the two SDPA backends is measured on the same kind of inputs (``randn`` and the
channel ``outliers`` of :mod:`quantpatch.synthetic`) at one length.

Writes ``speed.csv``, ``accuracy.csv``, ``bench.json`` (GPU, versions, commit, config, rows),
``bench.png`` and ``summary.md`` under ``--out``. ``--tune`` instead times kernel variants
(block sizes, warps, stages, switches) kernel-only and writes ``tune.csv``.

Usage::

    QP_GIT_SHA=$(git rev-parse HEAD) python eval/bench_attention.py --out eval/results/bench_attention
    python eval/bench_attention.py --quick --out /tmp/bench          # D=128, N in {1k, 8k}
    python eval/bench_attention.py --tune --seq-lens 8192 --head-dims 128 --out /tmp/tune
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import sys
from pathlib import Path
from typing import Callable, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import bench, graph_replays, write_csv  # noqa: E402  (the shared benchmark harness, beside this script)

from quantpatch.environment import environment_info  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "eval" / "results" / "bench_attention"
MODES = ("sage2-8b", "sage2-4b", "int8-flash", "fireq", "turbo")
BASELINES = ("sdpa-default", "sdpa-flash", "sdpa-cudnn")
PEER = "sageattn"  # upstream SageAttention end to end (``sageattention.sageattn``), when the package imports
L2_ROTATE_BYTES = 256 * 2**20  # rotate input sets while one set is smaller than this
logger = logging.getLogger("quantpatch").getChild("eval.bench_attention")

# Kernel variants for --tune: (name, attention-launcher overrides).
TUNE_VARIANTS = [
    ("m64n128w4s2", dict(block_m=64, block_n=128, num_warps=4, num_stages=2)),
    ("m64n128w4s3", dict(block_m=64, block_n=128, num_warps=4, num_stages=3)),
    ("m64n128w4s2r168", dict(block_m=64, block_n=128, num_warps=4, num_stages=2, maxnreg=168)),
    ("m64n64w4s3", dict(block_m=64, block_n=64, num_warps=4, num_stages=3)),
    ("m64n64w4s3r168", dict(block_m=64, block_n=64, num_warps=4, num_stages=3, maxnreg=168)),
    ("m64n64w4s4r128", dict(block_m=64, block_n=64, num_warps=4, num_stages=4, maxnreg=128)),
    ("m64n128w4s2-1lvl", dict(block_m=64, block_n=128, num_warps=4, num_stages=2, two_level_accum=False)),
    ("m64n128w4s2-noDS", dict(block_m=64, block_n=128, num_warps=4, num_stages=2, no_delta_s=True)),
    ("m128n128w8s3", dict(block_m=128, block_n=128, num_warps=8, num_stages=3)),
    ("m128n64w8s3", dict(block_m=128, block_n=64, num_warps=8, num_stages=3)),
]


def mode_config(name: str):
    """``"mode"``, ``"mode+option"`` or ``"mode+option=0"``: a mode with boolean attention options switched on or
    off, e.g. ``sage2-8b+smooth_v``, or ``sage2-8b+smooth_q=0`` (SageAttention2's Hopper numerics, §5)."""
    import quantpatch as qp

    mode, *opts = name.split("+")
    cfg = qp.get_mode(mode).attention
    flags = {}
    for opt in opts:
        key, _, value = opt.partition("=")
        if value not in ("", "0", "1") or not isinstance(getattr(cfg, key, False), bool):
            raise ValueError(f"{name!r}: a mode option is a boolean one as 'option', 'option=1' or 'option=0', "
                             f"not {opt!r}")
        flags[key] = value != "0"
    return cfg.replace(**flags)


def flops(b: int, h: int, n: int, d: int, causal: bool) -> float:
    return 4.0 * b * h * n * n * d / (2.0 if causal else 1.0)



def graph_times(impls: dict[str, Callable[[], object]], label: str, rep: int) -> dict[str, float]:
    """Median milliseconds of each ``impls`` entry as CUDA-graph replays (:func:`graph_replays`); an entry that
    fails (a configuration that does not compile) is reported under ``label`` and left out."""
    times = {}
    for name, fn in impls.items():
        try:
            times[name] = bench(graph_replays(lambda i, fn=fn: fn(), 1), 1, 10, rep)
        except Exception as err:  # noqa: BLE001 (say so, go on)
            print(f"{label} {name}: {type(err).__name__}: {str(err)[:200]}", flush=True)
    return times


def machine_info() -> dict:
    return environment_info("cuda" if torch.cuda.is_available() else "cpu", REPO_ROOT)


def make_inputs(b, h, n, d, n_sets, seed=0, device="cuda"):
    gen = torch.Generator(device=device).manual_seed(seed)
    return [tuple(torch.randn(b, h, n, d, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(3))
            for _ in range(n_sets)]


def sdpa_fn(backend_name: str, is_causal: bool):
    """SDPA under one backend (``sdpa-flash``, ``sdpa-cudnn``), or as PyTorch picks it (``sdpa-default``)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa = torch.nn.functional.scaled_dot_product_attention
    if backend_name == "sdpa-default":
        return lambda q, k, v: sdpa(q, k, v, is_causal=is_causal)
    backend = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}[backend_name]

    def run(q, k, v):
        with sdpa_kernel(backend):
            return sdpa(q, k, v, is_causal=is_causal)

    return run


def peer_fn(is_causal: bool):
    """Upstream SageAttention end to end on ``(B, H, N, D)`` inputs (its own quantization included), or None with
    the reason when the ``sageattention`` package does not import."""
    try:
        from sageattention import sageattn
    except ImportError as err:
        return None, f"sageattention not importable ({err})"
    return (lambda q, k, v: sageattn(q, k, v, tensor_layout="HND", is_causal=is_causal)), ""


def peer_kernel_fn(sets: list, is_causal: bool):
    """Upstream SageAttention's sm_90 kernel alone over each input set, quantized once by the package's own
    functions as its ``sageattn_qk_int8_pv_fp8_cuda_sm90`` quantizes (``(B, H, N, D)`` bf16, ``D`` 64 or 128):
    ``(i -> o, "")``, or None with the reason where the package or its sm_90 extension does not import."""
    try:
        from sageattention import sm90_compile
        from sageattention.quant import per_channel_fp8
        from sageattention.triton.quant_per_thread import per_thread_int8
    except ImportError as err:
        return None, f"sageattention's sm_90 kernel not importable ({err})"
    launches = []
    for q, k, v in sets:
        q8, qs, k8, ks = per_thread_int8(q, k, k.mean(dim=2, keepdim=True), tensor_layout="HND", BLKQ=64, WARPQ=16,
                                         BLKK=128, WARPK=128)
        pad = -k.shape[2] % 128
        v8, vs, _ = per_channel_fp8(torch.nn.functional.pad(v, (0, 0, 0, pad)) if pad else v, tensor_layout="HND",
                                    smooth_v=False)
        launches.append((q8, k8, v8, torch.empty_like(q), qs, ks, vs))
    scale = q.shape[-1] ** -0.5

    def run(i):  # layout 1 = HND, granularity 3 = per thread, no LSE
        q8, k8, v8, o, qs, ks, vs = launches[i]
        sm90_compile.qk_int8_sv_f8_accum_f32_fuse_v_scale_attn_inst_buf(q8, k8, v8, o, qs, ks, vs, 1, int(is_causal),
                                                                         3, scale, 0)
        return o

    return run, ""


def speed_rows(args) -> list[dict]:
    import quantpatch as qp
    from quantpatch.kernels.attention import fast_paths

    rows = []
    shapes = [(d, n, c) for d in args.head_dims for n in args.seq_lens for c in args.causal]
    for d, n, causal in shapes:
        set_bytes = 3 * args.batch * args.heads * n * d * 2
        n_sets = max(1, min(4, L2_ROTATE_BYTES // set_bytes))
        sets = make_inputs(args.batch, args.heads, n, d, n_sets, seed=n + d)
        fl = flops(args.batch, args.heads, n, d, causal)
        shape_rows = []

        def add(impl, kind, ms):
            shape_rows.append(dict(head_dim=d, seq_len=n, causal=int(causal), impl=impl, kind=kind, ms=ms,
                                   tflops=fl / (ms * 1e-3) / 1e12))

        for name in BASELINES:
            fn = sdpa_fn(name, causal)
            try:
                fn(*sets[0])
                add(name, "kernel", bench(lambda i, fn=fn: fn(*sets[i]), n_sets, args.warmup, args.rep))
                add(name, "graph", bench(graph_replays(lambda i, fn=fn: fn(*sets[i]), n_sets), n_sets, args.warmup,
                                          args.rep))
            except RuntimeError as err:  # a backend that cannot take the shape
                logger.warning("%s failed at D=%d N=%d: %s", name, d, n, err)
        peer, why_not = peer_fn(causal)
        if peer is None:
            logger.info("no %s row: %s", PEER, why_not)
        else:
            add(PEER, "e2e", bench(lambda i: peer(*sets[i]), n_sets, args.warmup, args.rep))
            peer_kernel, why_not = peer_kernel_fn(sets, causal)
            if peer_kernel is None:
                logger.info("no %s kernel row: %s", PEER, why_not)
            else:
                try:
                    add(PEER, "kernel", bench(peer_kernel, n_sets, args.warmup, args.rep))
                except (RuntimeError, TypeError) as err:  # an upstream version whose launch differs: say so, go on
                    logger.warning("%s kernel failed at D=%d N=%d: %s", PEER, d, n, err)
            peer_kernel = None
        for mode in args.modes:
            cfg = mode_config(mode)
            opts, extra = fast_paths.prefill_options(  # as the e2e call has them
                cfg, torch.device("cuda"), d, n, n, is_causal=causal, sm_scale=1 / math.sqrt(d), return_lse=False,
                out_dtype=torch.bfloat16)

            def e2e(i, c=cfg):
                return qp.attention(*sets[i], mode=c, is_causal=causal, strict=True)

            add(mode, "e2e", bench(e2e, n_sets, args.warmup, args.rep))
            add(mode, "e2e-graph", bench(graph_replays(e2e, n_sets), n_sets, args.warmup, args.rep))
            add(mode, "quant", bench(lambda i, o=opts: fast_paths.quantize_qkv_op(*sets[i], **o), n_sets,
                                     args.warmup, args.rep))
            parts = [fast_paths.quantize_qkv_op(*s, **opts) for s in sets]
            add(mode, "kernel", bench(lambda i, p=parts, e=extra: fast_paths.attn_qk_int8_pv_fp8_op(*p[i], *e),
                                      n_sets, args.warmup, args.rep))
            parts = None
        eager = {r["impl"]: r["ms"] for r in shape_rows if r["impl"] in BASELINES and r["kind"] == "kernel"}
        graphed = {r["impl"]: r["ms"] for r in shape_rows if r["impl"] in BASELINES and r["kind"] == "graph"}
        for r in shape_rows:
            ref = graphed if r["kind"] in ("graph", "e2e-graph") else eager
            r["vs_cudnn"] = ref["sdpa-cudnn"] / r["ms"] if "sdpa-cudnn" in ref and r["kind"] != "quant" else ""
            r["vs_flash"] = ref["sdpa-flash"] / r["ms"] if "sdpa-flash" in ref and r["kind"] != "quant" else ""
            r["vs_default"] = ref["sdpa-default"] / r["ms"] if "sdpa-default" in ref and r["kind"] != "quant" else ""
            print(f"D={d:3d} N={n:5d} causal={int(causal)} {r['impl']:>11s} {r['kind']:>6s} {r['ms']:9.3f} ms "
                  f"{r['tflops']:7.1f} TFLOPS  x{r['vs_cudnn'] or 0:5.2f} cuDNN  x{r['vs_flash'] or 0:5.2f} flash",
                  flush=True)
        rows += shape_rows
        sets = None  # free before the next shape
        torch.cuda.empty_cache()
    return rows


def peak_extra_gib(fn: Callable[[], torch.Tensor]) -> float:
    """Peak GPU memory allocated during ``fn()`` above what was allocated before it (its output included), GiB."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out
    return peak / 2**30


def memory_rows(args) -> list[dict]:
    import quantpatch as qp

    b, h, n, d = args.memory
    (q, k, v), = make_inputs(b, h, n, d, 1, seed=n)
    output_gib = q.numel() * q.element_size() / 2**30
    calls = {name: (lambda fn=sdpa_fn(name, False): fn(q, k, v)) for name in BASELINES}
    calls |= {mode: (lambda c=mode_config(mode): qp.attention(q, k, v, mode=c, strict=True)) for mode in args.modes}
    rows = []
    for name, fn in calls.items():
        fn()  # compiled and warm: the measured call allocates only what a call needs
        gib = peak_extra_gib(fn)
        rows.append(dict(batch=b, heads=h, seq_len=n, head_dim=d, impl=name, peak_extra_gib=gib,
                         output_gib=output_gib))
        print(f"memory B={b} H={h} N={n} D={d} {name:>11s} peak extra {gib:6.2f} GiB (output {output_gib:.2f} GiB)",
              flush=True)
    return rows


def accuracy_rows(args) -> list[dict]:
    import quantpatch as qp
    from quantpatch.kernels.attention.attention_ref import attention_exact
    from quantpatch.metrics import cos_sim, rel_l1
    from quantpatch.synthetic import attention_inputs

    rows = []
    for d, kind, causal in itertools.product(args.head_dims, ("randn", "outliers"), args.causal):
        q, k, v = attention_inputs(kind, batch=1, heads=args.acc_heads, seq_q=args.acc_seq_len, head_dim=d,
                                   device="cuda", seed=1)
        q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
        exact = attention_exact(q, k, v, is_causal=causal, dtype=torch.float64)
        outs = {name: sdpa_fn(name, causal)(q, k, v) for name in BASELINES}
        for mode in args.modes:
            outs[mode] = qp.attention(q, k, v, mode=mode_config(mode), is_causal=causal, strict=True)
        for name, o in outs.items():
            rows.append(dict(head_dim=d, seq_len=args.acc_seq_len, heads=args.acc_heads, inputs=kind,
                             causal=int(causal), impl=name, cos_sim=cos_sim(o, exact), rel_l1=rel_l1(o, exact)))
            print(f"accuracy D={d} {kind:8s} causal={int(causal)} {name:>11s} CosSim {rows[-1]['cos_sim']:.6f} "
                  f"rel-L1 {rows[-1]['rel_l1']:.4f}", flush=True)
        del exact
        torch.cuda.empty_cache()
    return rows


def tune_rows(args) -> list[dict]:
    import quantpatch as qp
    from quantpatch.kernels.attention import fast_paths
    from quantpatch.kernels.attention.qk_quant_triton import QuantizedQKV
    from quantpatch.kernels.attention.quant_attn_triton import attn_qk_int8_pv_fp8

    rows = []
    for d, n, causal in itertools.product(args.head_dims, args.seq_lens, args.causal):
        (q, k, v), = make_inputs(args.batch, args.heads, n, d, 1, seed=n)
        fl = flops(args.batch, args.heads, n, d, causal)
        for name in BASELINES:
            ms = bench(lambda i, fn=sdpa_fn(name, causal): fn(q, k, v), 1, args.warmup, args.rep)
            rows.append(dict(head_dim=d, seq_len=n, causal=int(causal), impl=name, variant="", ms=ms,
                             tflops=fl / ms / 1e9))
            print(f"tune D={d} N={n} causal={int(causal)} {name:>11s} {ms:8.3f} ms {rows[-1]['tflops']:7.1f} TFLOPS")
        for mode in args.modes:
            cfg = qp.get_mode(mode).attention
            x = QuantizedQKV(*fast_paths.quantize_qkv_op(q, k, v, **fast_paths.quant_options(cfg)))
            for vname, over in TUNE_VARIANTS:
                if args.variants and vname not in args.variants:
                    continue
                kw = dict(is_causal=causal, block_q=cfg.block_q, l_from_quantized_p=cfg.l_from_quantized_p,
                          two_level_accum=cfg.two_level_accum, turbo=cfg.exp == "sas", p_qmax=cfg.pv_qmax)
                kw.update(over)
                xv = x._replace(delta_s=x.delta_s[:0]) if kw.pop("no_delta_s", False) else x
                if cfg.smooth_q and cfg.block_q % kw["block_m"]:
                    continue
                try:
                    ms = bench(lambda i, kw=kw, xv=xv: attn_qk_int8_pv_fp8(xv, n, **kw), 1, args.warmup, args.rep)
                except Exception as err:  # a variant the compiler rejects (resources, ...)
                    print(f"tune {mode} {vname}: failed: {type(err).__name__}: {str(err)[:200]}")
                    continue
                rows.append(dict(head_dim=d, seq_len=n, causal=int(causal), impl=mode, variant=vname, ms=ms,
                                 tflops=fl / ms / 1e9))
                print(f"tune D={d} N={n} causal={int(causal)} {mode:>11s} {vname:>20s} {ms:8.3f} ms "
                      f"{rows[-1]['tflops']:7.1f} TFLOPS", flush=True)
            x = None
        q = k = v = None
        torch.cuda.empty_cache()
    return rows


def profile_quant(args) -> None:
    """Per-kernel CUDA times of the quantization pass and the attention kernel (torch.profiler)."""
    import quantpatch as qp
    from quantpatch.kernels.attention import fast_paths, qk_quant_triton

    ds_configs = [dict(zip(("block_n", "qb_tile", "num_warps", "num_stages"), map(int, c.split(","))))
                  for c in args.ds_tuning] or [dict(qk_quant_triton.DS_TUNING)]
    for d, n, mode, ds in itertools.product(args.head_dims, args.seq_lens, args.modes, ds_configs):
        qk_quant_triton.DS_TUNING.update(ds)
        (q, k, v), = make_inputs(args.batch, args.heads, n, d, 1, seed=n)
        cfg = qp.get_mode(mode).attention
        for _ in range(3):
            qp.attention(q, k, v, mode=mode)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fast_paths.quantized_attention(q, k, v, cfg)
            torch.cuda.synchronize()
        print(f"profile {mode} D={d} N={n} delta_s launch {ds}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=40))


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["head_dim"], r["causal"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (d, c) in zip(axes[0], panels):
        sel = [r for r in rows if r["head_dim"] == d and r["causal"] == c and r["kind"] not in ("quant", "graph")]
        for impl, kind in sorted({(r["impl"], r["kind"]) for r in sel}):
            pts = sorted((r["seq_len"], r["tflops"]) for r in sel if r["impl"] == impl and r["kind"] == kind)
            style = {"kernel": "--", "e2e-graph": ":"}.get(kind, "-") if impl not in BASELINES else "-"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", ms=3,
                    label=impl if impl in BASELINES else f"{impl} {kind}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOPS")
        ax.set_title(f"D={d} {'causal' if c else 'non-causal'}")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def summary_md(meta: dict, speed: list[dict], acc: list[dict], memory: Sequence[dict] = ()) -> str:
    lines = [f"# Attention benchmark ({meta['gpu']})", "",
             f"torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}, cuDNN {meta['cudnn']}, "
             f"commit {meta['git_sha']}, {meta['date']}", "", f"Command: `{meta['command']}`", ""]
    if speed:
        lines += ["| D | N | causal | impl | kind | ms | TFLOPS | × cuDNN | × flash |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in speed:
            vc = f"{r['vs_cudnn']:.2f}" if r["vs_cudnn"] != "" else ""
            vf = f"{r['vs_flash']:.2f}" if r["vs_flash"] != "" else ""
            lines.append(f"| {r['head_dim']} | {r['seq_len']} | {r['causal']} | {r['impl']} | {r['kind']} | "
                         f"{r['ms']:.3f} | {r['tflops']:.1f} | {vc} | {vf} |")
    if acc:
        lines += ["", "| D | N | inputs | causal | impl | CosSim | rel-L1 |", "|---|---|---|---|---|---|---|"]
        for r in acc:
            lines.append(f"| {r['head_dim']} | {r['seq_len']} | {r['inputs']} | {r['causal']} | {r['impl']} | "
                         f"{r['cos_sim']:.6f} | {r['rel_l1']:.4f} |")
    if memory:
        lines += ["", "| B | H | N | D | impl | peak extra GiB | output GiB |", "|---|---|---|---|---|---|---|"]
        for r in memory:
            lines.append(f"| {r['batch']} | {r['heads']} | {r['seq_len']} | {r['head_dim']} | {r['impl']} | "
                         f"{r['peak_extra_gib']:.2f} | {r['output_gib']:.2f} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    p.add_argument("--causal", type=int, nargs="+", default=[0, 1], choices=[0, 1])
    p.add_argument("--modes", nargs="+", default=list(MODES),
                   help="mode names, optionally with boolean attention options switched on or off: sage2-8b+smooth_v, "
                        "sage2-8b+smooth_q=0")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up (ms)")
    p.add_argument("--rep", type=int, default=100, help="do_bench measurement time (ms)")
    p.add_argument("--acc-seq-len", type=int, default=4096)
    p.add_argument("--acc-heads", type=int, default=8)
    p.add_argument("--no-accuracy", action="store_true")
    p.add_argument("--no-speed", action="store_true")
    p.add_argument("--quick", action="store_true", help="D=128, N in {1k, 8k}: fits one short device call")
    p.add_argument("--tune", action="store_true", help="time kernel variants instead (kernel only)")
    p.add_argument("--profile", action="store_true", help="per-kernel times of quantization + attention")
    p.add_argument("--ds-tuning", nargs="*", default=[],
                   help="--profile: ΔS GEMM launches to compare, each 'block_n,qb_tile,num_warps,num_stages' "
                        "(qb_tile: calls of more than DS_TUNING['short_nqb'] query blocks)")
    p.add_argument("--memory", type=int, nargs=4, metavar=("B", "H", "N", "D"),
                   help="measure the peak extra memory of one call at this shape instead of timing")
    p.add_argument("--variants", nargs="+", help=f"--tune variants (default all: {[v for v, _ in TUNE_VARIANTS]})")
    args = p.parse_args(argv)
    if args.quick:
        args.head_dims, args.seq_lens = [128], [1024, 8192]
    args.causal = [bool(c) for c in args.causal]
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention needs a CUDA GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    meta = machine_info()
    meta["config"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    print(json.dumps({k: v for k, v in meta.items() if k != "config"}), flush=True)
    if args.profile:
        profile_quant(args)
        return
    if args.tune:
        rows = tune_rows(args)
        write_csv(args.out / "tune.csv", rows)
        (args.out / "tune.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        return
    if args.memory:
        memory = memory_rows(args)
        write_csv(args.out / "memory.csv", memory)
        (args.out / "bench.json").write_text(json.dumps(dict(meta=meta, memory=memory), indent=1))
        (args.out / "summary.md").write_text(summary_md(meta, [], [], memory))
        return
    speed = [] if args.no_speed else speed_rows(args)
    acc = [] if args.no_accuracy else accuracy_rows(args)
    write_csv(args.out / "speed.csv", speed)
    write_csv(args.out / "accuracy.csv", acc)
    (args.out / "bench.json").write_text(json.dumps(dict(meta=meta, speed=speed, accuracy=acc), indent=1))
    (args.out / "summary.md").write_text(summary_md(meta, speed, acc))
    if speed:
        plot(speed, args.out / "bench.png")


if __name__ == "__main__":
    main()
