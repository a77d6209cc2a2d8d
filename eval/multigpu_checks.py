"""Patched models inside the distributed engines users run, on 2 GPUs: one summary table of acceptance checks.

Run under ``torchrun --standalone --nproc-per-node 2`` (``eval/run_multigpu_checks.sh`` does); random bf16 weights
from the public configs of ``bench_models.py`` (no download), identical on both ranks (broadcast from rank 0).

* ``wan``: a Wan2.1-1.3B-shaped transformer (``--wan-layers`` of its 30 blocks), 720p latent 1x16x21x90x160
  (75,600 tokens), one step patched (``sage2-8b``) on one GPU, then under Diffusers context parallelism
  (``ContextParallelConfig(ulysses_degree=2)``, ``ring_degree=2``): CosSim to the one-GPU output, Ulysses' speedup.
* ``tp``: a Llama-3-8B-shaped model (``--llama-layers`` of its 32 layers), saved once and loaded with
  ``from_pretrained(..., tp_plan="auto")``: last-token logits of a ``--prompt``-token prefill patched (sage2-8b,
  policy always) vs unpatched TP; greedy ``generate()`` under ``patch_model(model, "turbo", policy="always")``
  (its TurboCache).
* ``device_map``: the same Llama loaded by rank 0 alone with ``device_map="auto"`` and a ``max_memory`` that forces
  a split over cuda:0 / cuda:1 (cuda:0 stays current): patched logits vs the same patched model on one GPU and vs
  unpatched; with ``tp``, the patched TP logits vs the same patched model on one GPU too.

    torchrun --standalone --nproc-per-node 2 eval/multigpu_checks.py --out DIR [--parts wan tp device_map]

``--device cpu`` is a smoke run of the same code paths on two CPU processes (gloo): the tiny configs of
``bench_models.py`` (the Llama one with 2 KV heads, one a rank), every call through the reference numerics
(``policy="always"``), no ``device_map`` part; its numbers are no acceptance figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_models  # noqa: E402  (model configs and random-weight builder, beside this script)
import harness  # noqa: E402  (timing, similarity, machine record, table)

import quantpatch as qp  # noqa: E402

WAN_LATENT = (16, 21, 90, 160)  # 720p, 81 frames: 21 x 45 x 80 = 75,600 tokens after the (1, 2, 2) patch
WAN_TEXT_TOKENS = 512
TINY_WAN_LATENT, TINY_TEXT_TOKENS = (4, 2, 8, 8), 8
TINY_LLAMA = bench_models.TINY["llama"] | dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
MODE = "sage2-8b"
# acceptance targets
COS_CP, SPEEDUP_ULYSSES, COS_TP, COS_DEVICE_MAP_SAME, COS_MODE = 0.9999, 1.8, 0.999, 0.99999, 0.999


def log(message: str) -> None:
    if dist.get_rank() == 0:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def routes(handle: qp.PatchHandle) -> dict[str, int]:
    """Calls per route over every site of ``handle`` (SDPA routes cut to their first words)."""
    total: dict[str, int] = {}
    for site in handle.sites:
        for route, n in site.routes.items():
            key = route if not route.startswith("sdpa") else " ".join(route.split()[:6])
            total[key] = total.get(key, 0) + n
    return total


def quantized_calls(r: dict[str, int]) -> int:
    return sum(n for route, n in r.items() if not route.startswith("sdpa"))


def row(check: str, value: float | int | str, target: str, ok: bool, detail: str = "") -> dict:
    return dict(check=check, value=value, target=target, result="PASS" if ok else "FAIL", detail=detail)


# --------------------------------------------------------------------------- Wan under context parallelism


def wan_model(layers: int, device: torch.device) -> torch.nn.Module:
    spec = bench_models.MODELS["wan2.1-t2v-1.3b"]
    config = spec.config | dict(num_layers=layers) if device.type == "cuda" else bench_models.TINY["wan"]
    model = bench_models.build_model(spec, config, device, dtype(device))
    for p in model.parameters():  # one set of weights on every rank
        dist.broadcast(p.data, 0)
    return model


def dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def policy(device: torch.device) -> str:
    """The Wan runs' policy: the user's default on the GPU; every call quantized in the CPU smoke run."""
    return "speed" if device.type == "cuda" else "always"


def wan_inputs(device: torch.device) -> dict:
    gen = torch.Generator().manual_seed(1)
    rand = lambda *s: torch.randn(*s, generator=gen).to(device, dtype(device))  # noqa: E731
    gpu = device.type == "cuda"
    text_dim = (bench_models.WAN_1_3B if gpu else bench_models.TINY["wan"])["text_dim"]
    return dict(hidden_states=rand(1, *(WAN_LATENT if gpu else TINY_WAN_LATENT)),
                timestep=torch.tensor([500], device=device),
                encoder_hidden_states=rand(1, WAN_TEXT_TOKENS if gpu else TINY_TEXT_TOKENS, text_dim),
                return_dict=False)


def check_wan(args, device: torch.device) -> list[dict]:
    from diffusers.models._modeling_parallel import ContextParallelConfig

    inputs = wan_inputs(device)
    step = lambda m: (lambda: m(**inputs)[0])  # noqa: E731
    model = wan_model(args.wan_layers, device)
    with torch.no_grad(), qp.patch_model(model, MODE, policy=policy(device)) as handle:
        single, times = harness.time_calls(step(model), device, warmup=1, reps=args.reps)
    t_single, r_single = harness.median(times), routes(handle)
    log(f"wan one GPU patched: {t_single:.0f} ms, routes {r_single}")
    del model
    torch.cuda.empty_cache()
    rows, timings = [], {"one GPU": t_single}
    for name, config in (("ulysses", dict(ulysses_degree=2)), ("ring", dict(ring_degree=2))):
        model = wan_model(args.wan_layers, device)
        model.enable_parallelism(config=ContextParallelConfig(**config))
        with torch.no_grad(), qp.patch_model(model, MODE, policy=policy(device)) as handle:
            out, times = harness.time_calls(step(model), device, warmup=1, reps=args.reps)
        timings[name] = harness.median(times)
        cos = harness.similarity(out, single)["cos_sim"]
        r = routes(handle)
        log(f"wan {name}: {timings[name]:.0f} ms, CosSim {cos:.6f}, routes {r}")
        rows.append(row(f"{args.wan_name} {name} 2: CosSim vs one GPU", round(cos, 6),
                        f">= {COS_CP}, quantized", cos >= COS_CP and quantized_calls(r) > 0, json.dumps(r)))
        del model, out
        torch.cuda.empty_cache()
    speedup = timings["one GPU"] / timings["ulysses"]
    rows.append(row(f"{args.wan_name} ulysses 2: one step vs one GPU", round(speedup, 2),
                    f">= {SPEEDUP_ULYSSES}x", speedup >= SPEEDUP_ULYSSES,
                    ", ".join(f"{k} {v:.0f} ms" for k, v in timings.items())))
    return rows


# --------------------------------------------------------------------------- Llama: tensor parallel, device_map


def save_llama(args, path: str, device: torch.device) -> None:
    if dist.get_rank() == 0:
        spec = bench_models.MODELS["llama-3-8b"]
        config = spec.config | dict(num_hidden_layers=args.llama_layers) if device.type == "cuda" else TINY_LLAMA
        model = bench_models.build_model(spec, config, device, dtype(device))
        model.save_pretrained(path)
        del model
        torch.cuda.empty_cache()
    dist.barrier()


def prompt(tokens: int, device, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(2)).to(device)


def check_tp(args, path: str, device: torch.device) -> tuple[list[dict], tuple[torch.Tensor, torch.Tensor]]:
    """The TP rows, and the patched and unpatched TP last-token logits (on the CPU) for :func:`check_device_map` to
    hold against the same models on one GPU."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=dtype(device)).eval()
    vocab = model.config.vocab_size
    ids = prompt(args.prompt, device, vocab)
    with torch.no_grad():
        unpatched = model(ids).logits[:, -1].float()
        with qp.patch_model(model, MODE, policy="always") as handle:
            patched = model(ids).logits[:, -1].float()
    cos, r = harness.similarity(patched, unpatched)["cos_sim"], routes(handle)
    log(f"tp: CosSim {cos:.6f}, routes {r}")
    rows = [row(f"{args.llama_name} tp 2, {args.prompt} tokens: last-token logits vs unpatched TP",
                round(cos, 6), f">= {COS_TP}, quantized", cos >= COS_TP and quantized_calls(r) > 0, json.dumps(r))]
    with torch.no_grad(), qp.patch_model(model, "turbo", policy="always") as handle:  # the TurboCache at any size
        short = prompt(args.generate_prompt, device, vocab)
        t0 = time.perf_counter()
        generated = model.generate(short, max_new_tokens=args.new_tokens, do_sample=False)
        seconds = time.perf_counter() - t0
    new = generated.shape[1] - short.shape[1]
    turbo = any("TurboCache" in remark for remark in handle.remarks)
    log(f"tp turbo generate: {new} tokens in {seconds:.1f} s, remarks {handle.remarks}")
    rows.append(row(f"{args.llama_name} tp 2: greedy generate() with the turbo cache", new,
                    f"{args.new_tokens} tokens, TurboCache", new == args.new_tokens and turbo,
                    f"{seconds:.1f} s; {json.dumps(routes(handle))}"))
    del model
    torch.cuda.empty_cache()
    return rows, (patched.cpu(), unpatched.cpu())


def check_device_map(args, path: str, tp_logits: tuple[torch.Tensor, torch.Tensor] | None) -> list[dict]:
    """Rank 0 only (one process over both GPUs); cuda:0 stays current while layers run on cuda:1. With ``tp_logits``
    (the TP part's patched and unpatched logits) also whether tensor parallelism adds error of its own to the patched
    model: random weights put the mode's own error (patched vs unpatched on one GPU) near the absolute bounds, and TP
    sums the row-parallel projections' bf16 partial products in another order, which moves the unpatched model too.
    The patched TP model passes when it is as close to the patched one-GPU model as the unpatched TP model is to the
    unpatched one-GPU model (1 − CosSim at most twice as large)."""
    from transformers import AutoModelForCausalLM

    size_gib = sum(f.stat().st_size for f in Path(path).glob("*.safetensors")) / 2**30
    max_memory = {0: f"{size_gib * 0.6:.1f}GiB", 1: "60GiB"}
    split = AutoModelForCausalLM.from_pretrained(path, device_map="auto", max_memory=max_memory,
                                                 dtype=torch.bfloat16).eval()
    devices = sorted({str(d) for d in split.hf_device_map.values()})
    ids = prompt(args.prompt, "cuda:0", split.config.vocab_size)
    with torch.no_grad(), qp.patch_model(split, MODE, policy="always") as handle:
        patched_split = split(ids).logits[:, -1].float().cpu()
    r = routes(handle)
    del split
    torch.cuda.empty_cache()
    one = AutoModelForCausalLM.from_pretrained(path, device_map={"": 0}, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        unpatched = one(ids).logits[:, -1].float().cpu()
        with qp.patch_model(one, MODE, policy="always"):
            patched_one = one(ids).logits[:, -1].float().cpu()
    del one
    torch.cuda.empty_cache()
    same = harness.similarity(patched_split, patched_one)["cos_sim"]
    vs_fp = harness.similarity(patched_split, unpatched)["cos_sim"]
    vs_fp_one = harness.similarity(patched_one, unpatched)["cos_sim"]
    log(f"device_map {devices}: CosSim vs one GPU patched {same:.6f}, vs unpatched {vs_fp:.6f}, routes {r}")
    detail = f"devices {devices}; one GPU patched vs unpatched {vs_fp_one:.6f}; {json.dumps(r)}"
    rows = []
    if tp_logits is not None:
        tp_same = harness.similarity(tp_logits[0], patched_one)["cos_sim"]
        tp_unpatched = harness.similarity(tp_logits[1], unpatched)["cos_sim"]
        log(f"tp vs one GPU: patched CosSim {tp_same:.6f}, unpatched {tp_unpatched:.6f} (one GPU patched vs "
            f"unpatched {vs_fp_one:.6f})")
        rows.append(row(f"{args.llama_name} tp 2: logits vs same patched on one GPU", round(tp_same, 6),
                        f"1 - CosSim <= 2 x unpatched TP's ({tp_unpatched:.6f} vs unpatched one GPU)",
                        1 - tp_same <= 2 * (1 - tp_unpatched), f"one GPU patched vs unpatched {vs_fp_one:.6f}"))
    return rows + [row(f"{args.llama_name} device_map over 2 GPUs: logits vs same patched on one GPU",
                round(same, 6), f">= {COS_DEVICE_MAP_SAME}, split, quantized",
                same >= COS_DEVICE_MAP_SAME and devices == ["0", "1"] and quantized_calls(r) > 0, detail),
            row(f"{args.llama_name} device_map over 2 GPUs: logits vs unpatched", round(vs_fp, 6),
                f">= {COS_MODE} ({MODE} one-GPU bound)", vs_fp >= COS_MODE)]


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--parts", nargs="+", default=["wan", "tp", "device_map"], choices=["wan", "tp", "device_map"])
    parser.add_argument("--wan-layers", type=int, default=30)
    parser.add_argument("--llama-layers", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=4096, help="prefill tokens of the logits checks")
    parser.add_argument("--generate-prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a smoke run (gloo)")
    args = parser.parse_args()

    gpu = args.device == "cuda"
    args.wan_name = f"Wan-1.3B {args.wan_layers}L 720p" if gpu else "tiny Wan (smoke)"
    args.llama_name = f"Llama-8B {args.llama_layers}L" if gpu else "tiny Llama (smoke)"
    dist.init_process_group("nccl" if gpu else "gloo")
    rank = dist.get_rank()
    if dist.get_world_size() != 2 or (gpu and torch.cuda.device_count() < 2):
        raise SystemExit("run under torchrun --nproc-per-node 2 on a machine with 2 CUDA GPUs (or --device cpu)")
    if gpu:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        # Diffusers derives a rank's device as rank % torch.accelerator.device_count(): none on a CPU machine
        torch.accelerator.device_count = lambda: 1
    host = dist.new_group(backend="gloo")  # a barrier that keeps no GPU busy while rank 0 runs device_map
    rows: list[dict] = []
    t0 = time.perf_counter()
    if "wan" in args.parts:
        rows += check_wan(args, device)
    if {"tp", "device_map"} & set(args.parts):
        with tempfile.TemporaryDirectory(dir=os.environ.get("QP_MULTIGPU_TMP", "/tmp")) as local:
            path = [local]
            dist.broadcast_object_list(path, 0)  # rank 0's folder: both ranks load the same files
            save_llama(args, path[0], device)
            tp_logits = None
            if "tp" in args.parts:
                tp_rows, tp_logits = check_tp(args, path[0], device)
                rows += tp_rows
            dist.barrier(group=host)
            if "device_map" in args.parts and rank == 0 and gpu:
                rows += check_device_map(args, path[0], tp_logits)
            dist.barrier(group=host)
    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        table = harness.markdown_table(rows, [("check", "check", ""), ("value", "value", ""), ("target", "target", ""),
                                              ("result", "result", ""), ("detail", "detail", "")])
        record = dict(machine=harness.machine_record(device, Path(__file__).resolve().parents[1]), args=vars(args),
                      rows=rows, seconds=round(time.perf_counter() - t0, 1))
        (out / "multigpu_checks.json").write_text(json.dumps(record, indent=2, default=str))
        (out / "multigpu_checks.md").write_text(table + "\n")
        print(table, flush=True)
        print(f"{sum(r['result'] == 'PASS' for r in rows)}/{len(rows)} checks pass "
              f"({record['seconds']:.0f} s, {record['machine'].get('gpu')})", flush=True)
    dist.barrier(group=host)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
