"""``quantpatch calibrate``, ``quantpatch info`` and ``quantpatch eval``: calibrate-convert-save once,
inspect a checkpoint, run an evaluation script.

    quantpatch calibrate MODEL_DIR --mode fireq --data FILE.jsonl --samples 64 --seq-len 512 --out DIR
    quantpatch info DIR
    quantpatch eval lm --model DIR --data FILE.jsonl --modes sage2-8b   # = python eval/lm_eval_run.py ...

:func:`add_subcommands` registers them on the main parser's subparsers; each sets
``args.func`` to its command function. ``quantpatch eval NAME ARGS...`` hands ``ARGS`` to the
``main(argv)`` of the script in ``eval/`` (:data:`EVAL_SCRIPTS`): the scripts are the one
implementation, and they ship with the source checkout, not with the wheel.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import sys
import time
from pathlib import Path

logger = logging.getLogger("quantpatch")

EVAL_DIR = Path(__file__).resolve().parents[2] / "eval"
EVAL_SCRIPTS = {
    "lm": ("lm_eval_run.py", "lm-eval tasks (local perplexity / multiple choice, offline standard ones), fp vs modes"),
    "perplexity": ("perplexity.py", "sliding-window perplexity of a causal LM, fp vs modes"),
    "video": ("video_generation.py", "a Diffusers video pipeline, fp vs modes: latency, PSNR/SSIM, videos"),
}


def read_texts(path: str | Path) -> list[str]:
    """Documents of a ``.jsonl`` file (its ``text`` field) or of a plain text file (one document)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"calibration data {path} does not exist")
    if path.suffix == ".jsonl":
        docs = []
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if "text" not in record:
                raise ValueError(f"{path}:{i} has no 'text' field")
            docs.append(record["text"])
        return docs
    return [path.read_text()]


def calibrate_command(args: argparse.Namespace) -> Path:
    """Load ``args.model``, calibrate on ``args.data``, convert with ``args.mode`` and save to ``args.out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantpatch.calibration import calibrate
    from quantpatch.checkpoint import save
    from quantpatch.convert import FireQOptions, convert

    start = time.perf_counter()
    texts = read_texts(args.data)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    stats = calibrate(model, texts, args.mode, tokenizer=tokenizer, samples=args.samples, seq_len=args.seq_len)
    stats.meta["data"] = str(args.data)
    defaults = FireQOptions()
    options = FireQOptions(
        rpn=not args.no_rpn,
        rpn_alpha=defaults.rpn_alpha if args.rpn_alpha is None else args.rpn_alpha,
        crs_beta=defaults.crs_beta if args.crs_beta is None else args.crs_beta,
        cas_sites=defaults.cas_sites if args.cas_sites is None else tuple(args.cas_sites),
        weight_operand=args.weight_operand,
    )
    state = convert(model, stats, args.mode, options=options)
    out = save(model, args.out, tokenizer=tokenizer)
    print(f"calibrated {args.model} ({stats.meta['samples']} samples, {stats.meta['tokens']} tokens), "
          f"{len(state.linears)} W4A8 linears, {len(state.attention)} attention sites -> {out} "
          f"in {time.perf_counter() - start:.1f} s")
    return out


def info_command(args: argparse.Namespace) -> dict:
    """Print a checkpoint's summary (``--json`` for machine-readable output)."""
    from quantpatch.checkpoint import info

    summary = info(args.directory, verify=args.verify)
    if args.json:
        print(json.dumps(summary, indent=2))
        return summary
    base = summary["base_model"]
    cal = summary["calibration"] or {}
    ratio = summary["compression_vs_bf16"]
    lines = [
        f"quantpatch checkpoint {summary['directory']} (format v{summary['version']}, "
        f"quantpatch {summary['quantpatch_version']})",
        f"  mode            {summary['mode']}  options {summary['options']}",
        f"  base model      {base.get('name_or_path')!r} ({base.get('architecture')}, {base.get('model_type')}, "
        f"arch hash {base.get('arch_hash')}, {base.get('dtype')})",
        f"  W4A8 linears    {summary['w4a8_linears']}  PTS exponents {summary['pts_exponents']}  "
        f"zero-scale groups {summary['zero_scale_groups']}",
        f"  weight memory   {summary['weight_bytes']} B vs bf16 {summary['bf16_weight_bytes']} B"
        + (f" ({ratio:.2f}x smaller)" if ratio else ""),
        f"  attention       {summary['attention_sites']} sites, {summary['crs_pairs_per_head']} CRS pairs per KV head",
        f"  calibration     {cal.get('samples')} samples x <= {cal.get('seq_len')} tokens ({cal.get('tokens')} "
        f"tokens) from {cal.get('data')}",
    ]
    lines += [f"  file            {name}: {f['bytes']} B sha256 {f['sha256'][:16]}…"
              for name, f in (summary["files"] or {}).items()]
    print("\n".join(lines))
    return summary


def load_eval_script(relative: str):
    """Import ``eval/<relative>`` (e.g. ``"lm_eval_run.py"``) of the source checkout as a module."""
    script = EVAL_DIR / relative
    if not script.is_file():
        raise SystemExit(f"{script} does not exist: the eval/ scripts ship with the source checkout (pip install -e .),"
                         " not with the wheel")
    name = "_quantpatch_eval_" + script.relative_to(EVAL_DIR).with_suffix("").as_posix().replace("/", "_")
    spec = importlib.util.spec_from_file_location(name, script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name
    spec.loader.exec_module(module)
    return module


def eval_command(args: argparse.Namespace) -> object:
    """Run ``eval/<script>``'s ``main(args.forwarded)``; returns what it returns."""
    return load_eval_script(EVAL_SCRIPTS[args.eval_name][0]).main(args.forwarded)


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    """Register ``calibrate``, ``info`` and ``eval`` on the ``quantpatch`` parser's subparsers."""
    from quantpatch.modes import available_modes

    cal = sub.add_parser("calibrate", help="calibrate a Transformers model, convert it and save a checkpoint")
    cal.add_argument("model", help="model directory or hub id (AutoModelForCausalLM + AutoTokenizer)")
    cal.add_argument("--mode", default="fireq", choices=[m for m in available_modes() if m != "off"])
    cal.add_argument("--data", required=True, help="calibration texts: .jsonl with a 'text' field, or a text file")
    cal.add_argument("--samples", type=int, default=64, help="number of documents")
    cal.add_argument("--seq-len", type=int, default=512, help="tokens kept per document")
    cal.add_argument("--out", required=True, help="checkpoint directory to write")
    cal.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    cal.add_argument("--device", default="cpu")
    cal.add_argument("--no-rpn", action="store_true", help="skip RoPE-preserving normalization")
    cal.add_argument("--rpn-alpha", type=float, default=None)
    cal.add_argument("--crs-beta", type=float, default=None)
    cal.add_argument("--cas-sites", nargs="*", default=None, choices=["qkv", "o", "gate_up", "down"])
    cal.add_argument("--weight-operand", default="group", choices=["group", "lut"])
    cal.set_defaults(func=calibrate_command)
    inf = sub.add_parser("info", help="summarize a quantpatch checkpoint")
    inf.add_argument("directory")
    inf.add_argument("--verify", action="store_true", help="also check every file's sha256")
    inf.add_argument("--json", action="store_true")
    inf.set_defaults(func=info_command)
    ev = sub.add_parser("eval", help="run an evaluation script of eval/ (arguments go to the script)")
    scripts = ev.add_subparsers(dest="eval_name", required=True)
    for name, (script, help_text) in EVAL_SCRIPTS.items():
        # no -h here: --help and every other argument reach the script's own parser (cli.main forwards them)
        scripts.add_parser(name, help=f"{help_text} (eval/{script})", add_help=False)
    ev.set_defaults(func=eval_command, forward_unknown=True)
