"""Sliding-window perplexity of a causal LM, full precision vs quantpatch modes.

    python eval/perplexity.py --model ../shared/models/pydoc-llama-21m --data ../shared/data/pydoc-val.jsonl \
        --max-tokens 16384 --window 1024 --modes off sage2-8b int8-flash fireq sage2-4b --out ppl.json

Documents (the ``text`` field of a jsonl file, or a plain text file) are tokenized and
concatenated, each followed by EOS; the first ``--max-tokens`` tokens are scored in
``--window``-token windows advanced by ``--stride`` (default: the window, i.e. disjoint
windows); with a smaller stride (WikiText style) each window scores only its last
``stride`` tokens and the rest is context. ``off`` is the unpatched model.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import platform
import time
from pathlib import Path

import torch
from tqdm import tqdm

import quantpatch

logger = logging.getLogger("quantpatch.eval")


def load_token_stream(tokenizer, path: str | Path, max_tokens: int) -> torch.Tensor:
    """The first ``max_tokens`` tokens of the corpus, documents each followed by EOS, as ``(N,)`` int64."""
    path = Path(path)
    if path.suffix == ".jsonl":
        docs = [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()]
    else:
        docs = [path.read_text()]
    ids: list[int] = []
    for doc in docs:
        ids.extend(tokenizer(doc).input_ids + [tokenizer.eos_token_id])
        if len(ids) >= max_tokens:
            break
    if len(ids) < max_tokens:
        logger.warning("corpus has only %d tokens (< %d requested)", len(ids), max_tokens)
    return torch.tensor(ids[:max_tokens], dtype=torch.long)


@torch.no_grad()
def sliding_window_nll(
    model, ids: torch.Tensor, window: int, stride: int | None = None, desc: str = ""
) -> tuple[float, int]:
    """Summed negative log-likelihood (nats) and the number of scored tokens.

    Windows of ``window`` tokens start every ``stride`` tokens; the first window scores all
    its predictions, each later one only its last ``stride`` tokens (the rest is context).
    """
    stride = window if stride is None else stride
    if not 0 < stride <= window:
        raise ValueError(f"stride must be in (0, window], got {stride} with window {window}")
    device = next(model.parameters()).device
    total, count, prev_end = 0.0, 0, 0
    starts = range(0, max(len(ids) - 1, 1), stride)
    for start in tqdm(starts, desc=desc or "windows", leave=False):
        end = min(start + window, len(ids))
        x = ids[start:end].unsqueeze(0).to(device)
        labels = x.clone()
        labels[:, : max(prev_end - start, 0)] = -100  # tokens an earlier window already scored
        logits = model(x).logits.float()
        loss = torch.nn.functional.cross_entropy(
            logits[0, :-1], labels[0, 1:], ignore_index=-100, reduction="sum"
        )
        scored = int((labels[0, 1:] != -100).sum())
        total, count, prev_end = total + float(loss), count + scored, end
        if end == len(ids):
            break
    return total, count


def perplexity(model, ids: torch.Tensor, window: int, stride: int | None = None, desc: str = "") -> float:
    """``exp`` of the mean NLL over the scored tokens."""
    total, count = sliding_window_nll(model, ids, window, stride, desc)
    return math.exp(total / count)


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    ids = load_token_stream(tokenizer, args.data, args.max_tokens)
    results = {}
    for mode in args.modes:
        start = time.perf_counter()
        if mode == "off":
            value = perplexity(model, ids, args.window, args.stride, desc=mode)
        else:
            with quantpatch.patch_model(model, mode) as handle:
                value = perplexity(model, ids, args.window, args.stride, desc=mode)
            if handle.fallbacks():
                logger.warning("%s fell back: %s", mode, handle.fallbacks())
        results[mode] = {"ppl": value, "seconds": time.perf_counter() - start}
    base = results.get("off", {}).get("ppl")
    for r in results.values():
        r["delta_pct"] = None if base is None else 100 * (r["ppl"] / base - 1)
    return {
        "model": str(args.model),
        "data": str(args.data),
        "tokens": len(ids),
        "window": args.window,
        "stride": args.stride or args.window,
        "dtype": args.dtype,
        "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(),
        "machine": platform.platform(),
        "torch": torch.__version__,
        "results": results,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--max-tokens", type=int, default=16384)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--stride", type=int, default=None)
    parser.add_argument("--modes", nargs="+", default=["off", "sage2-8b", "int8-flash", "fireq", "sage2-4b", "turbo"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    report = run(args)
    print(f"{'mode':<12} {'ppl':>9} {'Δ %':>7} {'s':>7}   ({report['tokens']} tokens, window {args.window}, "
          f"{args.dtype} on {report['device']})")
    for mode, r in report["results"].items():
        delta = "" if r["delta_pct"] is None else f"{r['delta_pct']:+.2f}"
        print(f"{mode:<12} {r['ppl']:>9.3f} {delta:>7} {r['seconds']:>7.1f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
