"""The ``quantpatch`` command line.

``quantpatch compare`` (the default) runs every mode's attention on embedded synthetic
inputs and prints its accuracy against a float64 attention: no download, CPU or GPU.
``quantpatch calibrate MODEL_DIR --mode fireq --data FILE.jsonl --samples N --seq-len L --out DIR``
calibrates, converts and saves a checkpoint; ``quantpatch info DIR`` summarizes one.
``quantpatch eval {lm,perplexity,video} ARGS...`` runs the evaluation scripts of ``eval/``.
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

from quantpatch.api import attention
from quantpatch.cli_commands import add_subcommands
from quantpatch.metrics import all_metrics
from quantpatch.modes import available_modes
from quantpatch.synthetic import KINDS, attention_inputs


def compare(args: argparse.Namespace) -> list[dict]:
    """Accuracy (and wall time) of each mode on one synthetic input; returns the table rows."""
    from quantpatch.kernels.attention_ref import attention_exact

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
    sub = parser.add_subparsers(dest="command")
    cmp = sub.add_parser("compare", help="accuracy of every mode on synthetic attention inputs (default)")
    cmp.add_argument("--modes", nargs="+", default=[m for m in available_modes() if m != "off"])
    cmp.add_argument("--inputs", choices=KINDS, default="outliers")
    cmp.add_argument("--seq-len", type=int, default=1024)
    cmp.add_argument("--heads", type=int, default=8)
    cmp.add_argument("--kv-heads", type=int, default=2)
    cmp.add_argument("--head-dim", type=int, default=128)
    cmp.add_argument("--causal", action="store_true")
    cmp.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_subcommands(sub)  # calibrate, info, eval
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if getattr(args, "forward_unknown", False):  # `quantpatch eval NAME ...`: the script parses the rest
        args.forwarded = unknown
    elif unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:  # bare `quantpatch`: the default job
        args = parser.parse_args(["compare"])
    if args.command == "compare":
        _print_table(compare(args))
    else:
        args.func(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
