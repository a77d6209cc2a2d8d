"""Host time of one patched call against the call it replaces (launch-bound shapes, so host work is what is timed).

Rows (µs per call, median of repeats of ``--calls`` back-to-back calls, then one synchronize):

* ``sdpa``: Transformers' own ``sdpa_attention_forward`` on a Llama attention module (the unpatched call);
* ``patched-speed``: the same call through quantpatch's registered attention under ``policy="speed"``
  (a short call: routed to the model's own attention);
* ``patched-always``: the mode's quantized path (quantization launches and the kernel), ``policy="always"``;
* ``sdpa-short`` / ``attention-short`` (GPU only): ``F.scaled_dot_product_attention`` and
  ``quantpatch.attention(..., policy="always", strict=True)`` back to back at a launch-bound shape of the kernel
  route (B=1, 2 heads, 1024 tokens, D = 128): the public call's host time once its signature is planned;
* ``sm90-quantization-launches`` / ``sm90-attention-launch`` / ``sm90-planned-call`` (sm_90 only): the parts of that
  call's sm90 route (``fast_paths.Sm90Prefill``) from its second call on: the bound quantization launches alone, the
  bound attention launch alone, and the planned call (both, the outputs' allocations and the scratch lookup); no
  baseline (components);
* ``sdpa-long`` / ``patched-kernel`` (GPU only): one call of ``F.scaled_dot_product_attention`` and of
  ``quantpatch.attention(..., policy="always", strict=True)`` at a shape whose GPU work outlasts the host's
  (``--long-heads`` heads of ``--long-seq`` tokens, D = 128, Flux.1-dev's by default: the kernel route,
  quantization launches then the attention kernel), timed alone: the device idle before it, no synchronize inside;
* ``linear`` / ``w4a8`` / ``fp8``: ``F.linear`` on bf16 weights against ``W4A8Linear`` and ``FP8Linear`` (the FP8 path:
  the activation quantization launch, then ``torch._scaled_mm``), M = 1; ``scaled-mm`` (GPU only): that
  ``torch._scaled_mm`` call alone on pre-quantized operands, the part of ``fp8`` that is PyTorch's.

``overhead_us`` is each row's time less its baseline's. Writes ``host_overhead.csv``, ``bench.json`` and
``summary.md`` under ``--out``.

    python eval/bench_host_overhead.py --out eval/results/bench_host_overhead        # GPU
    python eval/bench_host_overhead.py --device cpu --calls 50 --out /tmp/host        # smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine_record, markdown_table, time_calls, write_csv, write_json  # noqa: E402

import quantpatch  # noqa: E402


def host_us(fn: Callable[[], object], device: torch.device, calls: int, repeats: int) -> float:
    """Median over ``repeats`` of the wall time of ``calls`` back-to-back calls, per call, in µs."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def host_once_us(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median over ``repeats`` of the wall time of one call, the device synchronized before (not inside) it
    (:func:`harness.time_calls`' host time): the host time of a call whose GPU work outlasts it, in µs."""
    host_ms: list[float] = []
    time_calls(fn, device, warmup=3, reps=repeats, host_ms=host_ms)
    return statistics.median(host_ms) * 1e3


SHORT_TOKENS, SHORT_HEAD_DIM = 1024, 128  # the launch-bound shape of the short rows (B=1, --short-heads heads)


def short_inputs(args, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q, k, v (1, --short-heads, SHORT_TOKENS, SHORT_HEAD_DIM)`` in bf16: the short rows' inputs."""
    shape = (1, args.short_heads, SHORT_TOKENS, SHORT_HEAD_DIM)
    return tuple(torch.randn(shape, device=device, dtype=torch.bfloat16) for _ in range(3))


def short_kernel_rows(args, device: torch.device) -> list[dict]:
    """``F.scaled_dot_product_attention`` and ``quantpatch.attention(..., policy="always", strict=True)`` at a
    launch-bound shape that takes the kernel route (:func:`short_inputs`), back to back: the public call's host time
    from its signature's second call on (a planned call: route and checks made once)."""
    q, k, v = short_inputs(args, device)
    calls = {"sdpa-short": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v),
             "attention-short": lambda: quantpatch.attention(q, k, v, mode=args.mode, policy="always", strict=True)}
    return [dict(row=name, us=host_us(fn, device, args.calls, args.repeats), baseline="sdpa-short")
            for name, fn in calls.items()]


def sm90_route_rows(args, device: torch.device) -> list[dict]:
    """The sm90 route's parts at :func:`short_kernel_rows`' shape, each call timed in a loop (:func:`host_us`); none
    where that call does not take the route (another GPU, the Gluon kernel unavailable)."""
    from quantpatch.kernels.attention import fast_paths, qk_quant_triton

    q, k, v = short_inputs(args, device)
    device = q.device  # with its index (``cuda:0``): the planned launches key their scratch by stream
    prefill = fast_paths._sm90_prefill(q, k, v, quantpatch.get_mode(args.mode).attention, False,
                                       SHORT_HEAD_DIM ** -0.5)
    if prefill is None:
        return []
    for _ in range(2):  # the first call makes the launch plans, the second runs them bound
        prefill(q, k, v)
    if prefill.attend is None:
        return []
    plan, attend = prefill.quantize, prefill.attend
    scratch = qk_quant_triton.stats_scratch(device, *plan.scratch_size)
    workspace, x = plan.carve(device)  # kept alive while the launches below read its addresses
    o = torch.empty(attend.out_shape, device=device, dtype=q.dtype)
    calls = {"sm90-quantization-launches": lambda: plan.launch(q, k, v, x, scratch),
             "sm90-attention-launch": lambda: attend(x, o, prefill.lse, device=device.index),
             "sm90-planned-call": lambda: prefill(q, k, v)}
    rows = [dict(row=name, us=host_us(fn, device, args.calls, args.repeats), baseline=None)
            for name, fn in calls.items()]
    del workspace
    return rows


def kernel_route_rows(args, device: torch.device) -> list[dict]:
    """SDPA and the patched call's kernel route at a long shape, each call timed alone (:func:`host_once_us`)."""
    q, k, v = (torch.randn(1, args.long_heads, args.long_seq, 128, device=device, dtype=torch.bfloat16)
               for _ in range(3))
    calls = {"sdpa-long": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v),
             "patched-kernel": lambda: quantpatch.attention(q, k, v, mode=args.mode, policy="always", strict=True)}
    return [dict(row=name, us=host_once_us(fn, device, args.single_calls), baseline="sdpa-long")
            for name, fn in calls.items()]


def attention_rows(args, device: torch.device) -> list[dict]:
    import transformers as T
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    config = T.LlamaConfig(vocab_size=128, hidden_size=args.heads * 64, num_hidden_layers=1,
                           num_attention_heads=args.heads, num_key_value_heads=args.heads // 4, intermediate_size=128)
    model = T.LlamaForCausalLM(config).to(device, torch.bfloat16).eval()
    module = model.model.layers[0].self_attn
    q = torch.randn(1, args.heads, args.seq, 64, device=device, dtype=torch.bfloat16)
    k, v = (torch.randn(1, args.heads // 4, args.seq, 64, device=device, dtype=torch.bfloat16) for _ in range(2))
    kw = dict(dropout=0.0, scaling=64 ** -0.5)
    rows = [dict(row="sdpa", us=host_us(lambda: sdpa_attention_forward(module, q, k, v, None, **kw), device,
                                        args.calls, args.repeats), baseline="sdpa")]
    for policy in ("speed", "always"):
        with quantpatch.patch_model(model, args.mode, policy=policy):
            fn = AttentionInterface._global_mapping[model.config._attn_implementation]
            us = host_us(lambda: fn(module, q, k, v, None, **kw), device, args.calls, args.repeats)
        rows.append(dict(row=f"patched-{policy}", us=us, baseline="sdpa"))
    return rows


def linear_rows(args, device: torch.device) -> list[dict]:
    from quantpatch.fp8_linear import FP8Linear
    from quantpatch.kernels.fp8_linear.fp8_linear_ref import quantize_rows_fp8_ref
    from quantpatch.w4a8_linear import W4A8Linear

    linear = torch.nn.Linear(4096, 4096, bias=False, device=device, dtype=torch.bfloat16)
    w4a8 = W4A8Linear.from_linear(linear).to(device)
    fp8 = FP8Linear.from_linear(linear)  # called directly: the FP8 path on every call (no policy)
    x = torch.randn(1, 4096, device=device, dtype=torch.bfloat16)
    calls = {"linear": lambda: torch.nn.functional.linear(x, linear.weight), "w4a8": lambda: w4a8(x),
             "fp8": lambda: fp8(x)}
    if device.type == "cuda":
        x_fp8, x_scale = quantize_rows_fp8_ref(x)
        w_t, w_scale = fp8.weight_fp8.t(), fp8.weight_scale.view(1, -1)
        calls["scaled-mm"] = lambda: torch._scaled_mm(x_fp8, w_t, scale_a=x_scale, scale_b=w_scale,
                                                      out_dtype=torch.bfloat16, use_fast_accum=False)
    return [dict(row=name, us=host_us(fn, device, args.calls, args.repeats), baseline="linear")
            for name, fn in calls.items()]


def with_overheads(rows: list[dict]) -> list[dict]:
    base = {r["row"]: r["us"] for r in rows}
    return [dict(r, us=round(r["us"], 2),
                 overhead_us=None if r["baseline"] is None else round(r["us"] - base[r["baseline"]], 2))
            for r in rows]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--mode", default="sage2-8b")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--seq", type=int, default=16, help="tokens per call (short: launch-bound)")
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--short-heads", type=int, default=2, help="heads of the launch-bound kernel-route rows (GPU)")
    p.add_argument("--long-seq", type=int, default=4608, help="tokens of the kernel-route rows (GPU)")
    p.add_argument("--long-heads", type=int, default=24)
    p.add_argument("--single-calls", type=int, default=200, help="calls timed alone for the kernel-route rows")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    device = torch.device(args.device)
    rows = attention_rows(args, device)
    if device.type == "cuda":
        rows += short_kernel_rows(args, device)
        rows += sm90_route_rows(args, device)
        rows += kernel_route_rows(args, device)
        rows += linear_rows(args, device)
    rows = with_overheads(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "host_overhead.csv", rows)
    write_json(args.out / "bench.json", {"machine": machine_record(device, Path(__file__).resolve().parents[1]),
                                         "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows})
    table = markdown_table(rows, [("row", "call", ""), ("us", "µs / call", ".2f"),
                                  ("overhead_us", "µs over baseline", "+.2f"), ("baseline", "baseline", "")])
    command = "python eval/bench_host_overhead.py " + " ".join(sys.argv[1:] if argv is None else argv)
    (args.out / "summary.md").write_text(f"# Host time per call\n\n`{command}`\n\n{table}\n")
    print(table)
    return rows


if __name__ == "__main__":
    main()
