"""``quantpatch calibrate``, ``info``, ``tune``, ``eval`` and ``bench``: calibrate-convert-save once,
inspect a checkpoint, measure this GPU's crossover table, run an evaluation or benchmark script.

    quantpatch calibrate MODEL_DIR --mode fireq --data FILE.jsonl --samples 64 --seq-len 512 --out DIR
    quantpatch info DIR
    quantpatch tune                                                      # GPU: writes the crossover table
    quantpatch eval lm --model DIR --data FILE.jsonl --modes sage2-8b   # = python eval/lm_eval_run.py ...
    quantpatch bench models --out DIR                                    # = python eval/bench_models.py ...

:func:`add_subcommands` registers them on the main parser's subparsers; each sets
``args.func`` to its command function. ``quantpatch eval NAME ARGS...`` hands ``ARGS`` to the
``main(argv)`` of the script in ``eval/`` (:data:`EVAL_SCRIPTS`, :data:`BENCH_SCRIPTS` for ``bench``): the scripts
are the one
implementation, and they ship with the source checkout, not with the wheel.

Arguments are checked before any model loads: argparse ``type`` functions (:func:`int_at_least`,
:func:`existing_file`, :func:`output_dir`, ...) reject a bad value with the usage message, rules
between arguments raise :class:`UsageError`, and ``calibrate`` reads its data file (errors name
the file and line) before it loads the model.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from quantpatch.modes import available_modes

logger = logging.getLogger("quantpatch")

EVAL_DIR = Path(__file__).resolve().parents[2] / "eval"
EVAL_SCRIPTS = {
    "lm": ("lm_eval_run.py", "lm-eval tasks (local perplexity / multiple choice, offline standard ones), fp vs modes"),
    "perplexity": ("perplexity.py", "sliding-window perplexity of a causal LM, fp vs modes"),
    "video": ("video_generation.py", "a Diffusers video pipeline, fp vs modes: latency, PSNR/SSIM, videos"),
}
BENCH_SCRIPTS = {
    "models": ("bench_models.py", "model-level speed: real configs, random bf16 weights, unpatched vs modes (GPU)"),
    "attention": ("bench_attention.py", "attention kernels vs SDPA cuDNN / flash: TFLOPS end to end and kernel only"),
    "linear": ("bench_linear.py", "W4A8 linears vs bf16 F.linear and torch._scaled_mm FP8"),
    "host": ("bench_host_overhead.py", "host time of a patched call against the call it replaces"),
}
# ``quantpatch calibrate`` options that only the FireQ converter reads.
FIREQ_OPTIONS = ("no_rpn", "rpn_alpha", "crs_beta", "cas_sites", "weight_operand")


class UsageError(ValueError):
    """A command line that is wrong in a way one argument's type cannot see (``quantpatch`` exits with status 2)."""


# --------------------------------------------------------------------------- argument types


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer ``>= low``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    return parse


def positive_float(text: str) -> float:
    """An argparse ``type``: a finite float ``> 0``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def existing_file(text: str) -> Path:
    """An argparse ``type``: a path to a file that exists."""
    path = Path(text).expanduser()
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text} {'is a directory' if path.is_dir() else 'does not exist'}"
                                         " (expected a file)")
    return path


def existing_dir(text: str) -> Path:
    """An argparse ``type``: a path to a directory that exists."""
    path = Path(text).expanduser()
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} {'is a file' if path.exists() else 'does not exist'}"
                                         " (expected a directory)")
    return path


def output_dir(text: str) -> Path:
    """An argparse ``type``: a directory to write, existing or creatable (no file in the way, writable)."""
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} exists and is not a directory")
    ancestor = next(p for p in (path.absolute(), *path.absolute().parents) if p.exists())
    if not ancestor.is_dir():
        raise argparse.ArgumentTypeError(f"cannot create {text}: {ancestor} is a file")
    if not os.access(ancestor, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text}: {ancestor} is not writable")
    return path


def model_source(text: str) -> str:
    """An argparse ``type``: a local model directory (with ``config.json``) or a hub id (``name``, ``org/name``)."""
    path = Path(text).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise argparse.ArgumentTypeError(f"{text} is not a model directory (it has no config.json)")
        return str(path)
    if path.is_absolute() or text.startswith((".", "~")) or text.count("/") > 1 or "\\" in text:
        raise argparse.ArgumentTypeError(f"model directory {text} does not exist")
    return text


def device_name(text: str) -> str:
    """An argparse ``type``: a torch device string; a CUDA device must exist."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError) as err:
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device ({err})") from None
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if (device.index or 0) >= count:
            raise argparse.ArgumentTypeError(f"{text}: no such CUDA device ({count} visible)")
    return text


# --------------------------------------------------------------------------- calibrate


def read_texts(path: str | Path) -> list[str]:
    """Documents of a ``.jsonl`` file (its ``text`` field) or of a plain text file (one document).

    Raises:
        FileNotFoundError: ``path`` is not a file.
        ValueError: the file is not UTF-8, a line is not a JSON object with a string ``text``
            (the message names the file and line), or there is no non-empty document.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"calibration data {path} does not exist")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise ValueError(f"{path}:{line}: not UTF-8 text (byte {err.start}); calibration data is a .jsonl file "
                         "or a text file") from None
    if path.suffix != ".jsonl":
        docs = [text]
    else:
        docs = []
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{i}: not valid JSON ({err.msg}, column {err.colno})") from None
            if not isinstance(record, dict) or "text" not in record:
                raise ValueError(f"{path}:{i} has no 'text' field")
            if not isinstance(record["text"], str):
                raise ValueError(f"{path}:{i}: 'text' must be a string, got {type(record['text']).__name__}")
            docs.append(record["text"])
    if not any(doc.strip() for doc in docs):
        raise ValueError(f"{path} has no non-empty text to calibrate on")
    return docs


def calibration_modes() -> list[str]:
    """The registered modes ``quantpatch calibrate`` can run: those with a calibration method."""
    from quantpatch.calibration import calibration_key
    from quantpatch.methods import METHODS
    from quantpatch.modes import available_modes, get_mode

    modes = []
    for name in available_modes():
        try:
            key = calibration_key(get_mode(name))
        except ValueError:  # nothing to calibrate (attention-only modes)
            continue
        if key in METHODS:
            modes.append(name)
    return modes


def check_calibrate_args(args: argparse.Namespace) -> None:
    """Rules between ``quantpatch calibrate`` arguments; raises :class:`UsageError`."""
    if args.mode != "fireq":
        given = [name for name in FIREQ_OPTIONS if getattr(args, name) not in (None, False)]
        if given:
            flags = ", ".join("--" + name.replace("_", "-") for name in given)
            raise UsageError(f"{flags} apply to --mode fireq only (got --mode {args.mode})")


def calibrate_command(args: argparse.Namespace) -> Path:
    """Load ``args.model``, calibrate on ``args.data``, convert with ``args.mode`` and save to ``args.out``.

    Every argument and the data file are checked before the model loads.
    """
    check_calibrate_args(args)
    texts = read_texts(args.data)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantpatch.calibration import calibrate
    from quantpatch.checkpoint import save
    from quantpatch.conversion import FireQOptions, convert

    start = time.perf_counter()
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
        weight_operand=defaults.weight_operand if args.weight_operand is None else args.weight_operand,
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
        f"  attention       {summary['attention_sites']} sites, KV cache {summary['kv_cache']}, "
        + (f"KV heads per bit width: K {bits['k']}, V {bits['v']}" if (bits := summary["kv_head_bits"])
           else f"{summary['crs_pairs_per_head']} CRS pairs per KV head"),
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
    return load_eval_script(args.scripts[args.script_name][0]).main(args.forwarded)


def tune_command(args: argparse.Namespace) -> dict:
    """Measure this GPU's crossover table (:func:`quantpatch.routing.tune`) and print it."""
    from quantpatch.routing import tune

    if not torch.cuda.is_available():
        raise UsageError("quantpatch tune measures a GPU against SDPA and needs CUDA; on the CPU, policy='speed' "
                         "runs SDPA everywhere")
    table = tune(args.modes, args.head_dims, args.lengths, heads=args.heads, repeats=args.repeats, out=args.out)
    for key, length in table["crossovers"].items():
        print(f"{key:<28} {'never' if length is None else f'from {length} tokens'}")
    return table


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    """Register ``calibrate``, ``info``, ``tune`` and ``eval`` on the ``quantpatch`` parser's subparsers."""
    from quantpatch import routing

    cal = sub.add_parser("calibrate", help="calibrate a Transformers model, convert it and save a checkpoint")
    cal.add_argument("model", type=model_source,
                     help="model directory or hub id (AutoModelForCausalLM + AutoTokenizer)")
    cal.add_argument("--mode", default="fireq", choices=calibration_modes())
    cal.add_argument("--data", required=True, type=existing_file,
                     help="calibration texts: .jsonl with a 'text' field, or a text file")
    cal.add_argument("--samples", type=int_at_least(1), default=64, help="number of documents")
    cal.add_argument("--seq-len", type=int_at_least(2), default=512, help="tokens kept per document")
    cal.add_argument("--out", required=True, type=output_dir, help="checkpoint directory to write")
    cal.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    cal.add_argument("--device", default="cpu", type=device_name)
    fireq = cal.add_argument_group("FireQ conversion (--mode fireq)")
    fireq.add_argument("--no-rpn", action="store_true", help="skip RoPE-preserving normalization")
    fireq.add_argument("--rpn-alpha", type=positive_float, default=None)
    fireq.add_argument("--crs-beta", type=positive_float, default=None)
    fireq.add_argument("--cas-sites", nargs="*", default=None, choices=["qkv", "o", "gate_up", "down"])
    fireq.add_argument("--weight-operand", default=None, choices=["group", "lut"], help="default: group")
    cal.set_defaults(func=calibrate_command)
    inf = sub.add_parser("info", help="summarize a quantpatch checkpoint")
    inf.add_argument("directory", type=existing_dir)
    inf.add_argument("--verify", action="store_true", help="also check every file's sha256")
    inf.add_argument("--json", action="store_true")
    inf.set_defaults(func=info_command)
    tun = sub.add_parser("tune", help="measure where each mode beats SDPA on this GPU (policy='speed' reads it)")
    tun.add_argument("--modes", nargs="+", choices=[m for m in available_modes() if m != "off"],
                     default=list(routing.TUNE_MODES))
    tun.add_argument("--head-dims", nargs="+", type=int_at_least(1), default=list(routing.TUNE_HEAD_DIMS))
    tun.add_argument("--lengths", nargs="+", type=int_at_least(1), default=list(routing.TUNE_LENGTHS))
    tun.add_argument("--heads", type=int_at_least(1), default=32)
    tun.add_argument("--repeats", type=int_at_least(1), default=2,
                     help="measurements per shape; each ratio is the lowest (default 2)")
    tun.add_argument("--out", type=Path, default=None, help="default: the user's cache dir, which policy='speed' reads")
    tun.set_defaults(func=tune_command)
    for command, table, what in (("eval", EVAL_SCRIPTS, "an evaluation"), ("bench", BENCH_SCRIPTS, "a benchmark")):
        ev = sub.add_parser(command, help=f"run {what} script of eval/ (arguments go to the script)")
        scripts = ev.add_subparsers(dest="script_name", required=True)
        for name, (script, help_text) in table.items():
            # no -h here: --help and every other argument reach the script's own parser (cli.main forwards them)
            scripts.add_parser(name, help=f"{help_text} (eval/{script})", add_help=False)
        ev.set_defaults(func=eval_command, forward_unknown=True, scripts=table)
