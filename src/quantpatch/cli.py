"""The ``quantpatch`` command line.

``quantpatch compare`` (the default) runs every mode's attention on embedded synthetic
inputs and prints its accuracy against a float64 attention: no download, CPU or GPU.
``quantpatch calibrate MODEL_DIR --mode fireq --data FILE.jsonl --samples N --seq-len L --out DIR``
calibrates, converts and saves a checkpoint; ``quantpatch info DIR`` summarizes one.
``quantpatch tune`` measures where each mode beats SDPA on this GPU (``policy="speed"`` reads it).
``quantpatch eval {lm,perplexity,video} ARGS...`` and ``quantpatch bench {models,attention,linear,host} ARGS...``
run the evaluation and benchmark scripts of ``eval/``.

Errors print one line, ``quantpatch: error: ...``, and exit with status 2 for a wrong command line
(argparse's usage message for a bad argument) or 1 for a failure while running;
``quantpatch --debug COMMAND ...`` shows the full traceback instead.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import torch

from quantpatch.api import attention
from quantpatch.cli_commands import UsageError, add_subcommands, device_name, int_at_least
from quantpatch.metrics import all_metrics
from quantpatch.modes import available_modes
from quantpatch.synthetic import KINDS, attention_inputs


def compare(args: argparse.Namespace) -> list[dict]:
    """Accuracy (and wall time) of each mode on one synthetic input; returns the table rows."""
    from quantpatch.kernels.attention.attention_ref import attention_exact

    if args.heads % args.kv_heads:
        raise UsageError(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")

    q, k, v = attention_inputs(
        args.inputs, heads=args.heads, kv_heads=args.kv_heads, seq_q=args.seq_len, head_dim=args.head_dim,
        dtype=torch.bfloat16, device=args.device,
    )
    ref = attention_exact(q, k, v, is_causal=args.causal)
    rows = []
    for mode in args.modes:
        start = time.perf_counter()
        out = attention(q, k, v, mode=mode, is_causal=args.causal)
        if out.is_cuda:
            torch.cuda.synchronize()
        rows.append({"mode": mode, **all_metrics(out, ref), "seconds": time.perf_counter() - start})
    return rows


def _print_table(rows: list[dict]) -> None:
    print(f"{'mode':<12} {'CosSim':>9} {'rel-L1':>8} {'RMSE':>9} {'MRE':>8} {'time s':>7}")
    for r in rows:
        print(
            f"{r['mode']:<12} {r['cos_sim']:>9.6f} {r['rel_l1']:>8.4f} {r['rmse']:>9.2e} {r['mre']:>8.4f} "
            f"{r['seconds']:>7.2f}"
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="quantpatch", description=__doc__.split("\n\n")[0])
    debug_help = "on an error, show the full traceback"
    parser.add_argument("--debug", action="store_true", help=debug_help)
    sub = parser.add_subparsers(dest="command")
    cmp = sub.add_parser("compare", help="accuracy of every mode on synthetic attention inputs (default)")
    cmp.add_argument("--modes", nargs="+", choices=available_modes(),
                     default=[m for m in available_modes() if m != "off"])
    cmp.add_argument("--inputs", choices=KINDS, default="outliers")
    cmp.add_argument("--seq-len", type=int_at_least(1), default=1024)
    cmp.add_argument("--heads", type=int_at_least(1), default=8)
    cmp.add_argument("--kv-heads", type=int_at_least(1), default=2)
    cmp.add_argument("--head-dim", type=int_at_least(1), default=128)
    cmp.add_argument("--causal", action="store_true")
    cmp.add_argument("--device", type=device_name, default="cuda" if torch.cuda.is_available() else "cpu")
    add_subcommands(sub)  # calibrate, info, tune, eval, bench
    for name, command in sub.choices.items():
        if name not in ("eval", "bench"):  # these hand every argument to their script
            command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug_help)
    return parser


def _run(args: argparse.Namespace) -> None:
    if args.command == "compare":
        _print_table(compare(args))
    else:
        args.func(args)


def _one_line(err: BaseException) -> str:
    """The error as one line; the exception type is kept where the message alone says little (``KeyError: 'x'``)."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if isinstance(err, (ValueError, OSError)) else f"{type(err).__name__}: {text}"


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit status (0, 1 or 2)."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)  # a bad argument exits here with status 2 (argparse)
    if getattr(args, "forward_unknown", False):  # `quantpatch eval|bench NAME ...`: the script parses the rest
        args.forwarded = unknown
    elif unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:  # bare `quantpatch`: the default job
        args = parser.parse_args(["compare"], namespace=argparse.Namespace(debug=args.debug))
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.debug:
        logging.getLogger("quantpatch").setLevel(logging.DEBUG)
    try:
        _run(args)
    except Exception as err:
        if args.debug:
            raise
        print(f"quantpatch: error: {_one_line(err)}", file=sys.stderr)
        return 2 if isinstance(err, UsageError) else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
