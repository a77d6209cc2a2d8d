"""Sliding-window perplexity of a causal LM, full precision vs quantpatch modes.

    python eval/perplexity.py --model ../shared/models/pydoc-llama-21m --data ../shared/data/pydoc-val.jsonl \
        --max-tokens 16384 --window 1024 --modes off sage2-8b int8-flash fireq sage2-4b --out ppl.json

Documents (the ``text`` field of a jsonl file, or a plain text file) are tokenized and
concatenated, each followed by EOS; the first ``--max-tokens`` tokens are scored in
``--window``-token windows advanced by ``--stride`` (default: the window, i.e. disjoint
windows); with a smaller stride (WikiText style) each window scores only its last
``stride`` tokens and the rest is context. ``off`` is the unpatched model.

With ``--kv-cache`` every mode is evaluated through a KV cache: each window's first ``--prefill``
tokens fill the cache in one forward, the rest go through it ``--chunk`` tokens at a time, and only
those chunk predictions are scored. A mode may then name its cache as ``MODE:CACHE`` with CACHE one of
``dynamic`` (default), ``turbo4`` / ``turbo8`` (every head 4 / 8 bits), ``mixed`` (2/4 bits by
priority, calibrated on ``--calib``), ``mixed-inverse`` (the highest-priority heads at 2 bits) and
``mixed-randomSEED`` (the same number of 2-bit heads at random)::

    python eval/perplexity.py --model ../shared/models/pydoc-llama-21m --data ../shared/data/pydoc-val.jsonl \
        --kv-cache --calib ../shared/data/pydoc-calib.jsonl --modes off off:turbo4 turbo turbo:turbo4 turbo:mixed \
        turbo:mixed-random0 --out ppl_kv.json

With ``--linear fp8`` every mode is scored a second time with FP8 linear layers
(``patch_model(..., linear="fp8")``), in rows named ``MODE+fp8``; ``off+fp8`` keeps the attention
unpatched and isolates the linears::

    python eval/perplexity.py --model ../shared/models/pydoc-llama-21m --data ../shared/data/pydoc-val.jsonl \
        --modes off --linear fp8

With ``--lm-eval-windows`` the windows are those of lm-eval's ``loglikelihood_rolling`` (what
``eval/lm_eval_run.py``'s ``pydoc_perplexity`` task runs): each document on its own, tokenized as
lm-eval's HFLM does (``tokenizer.encode``), every token scored, the first from the prefix token
(BOS, else EOS), in disjoint chunks of ``--window`` predictions fed as ``--window``-token inputs (the
last chunk of a document with a full window of context); no EOS between documents. The perplexity is
``exp`` of the summed NLL over the summed token count (lm-eval's token-level perplexity)::

    python eval/perplexity.py --model ../shared/models/pydoc-llama-21m --data ../shared/data/pydoc-val.jsonl \
        --lm-eval-windows --window 1024 --modes off sage2-8b
"""

from __future__ import annotations

import argparse
import logging
import math
import platform
import time
from pathlib import Path

import torch
from tqdm import tqdm

import quantpatch
from quantpatch.cli_commands import read_texts
from quantpatch.environment import write_json

logger = logging.getLogger("quantpatch.eval")


def load_token_stream(tokenizer, path: str | Path, max_tokens: int) -> torch.Tensor:
    """The first ``max_tokens`` tokens of the corpus, documents each followed by EOS, as ``(N,)`` int64."""
    ids: list[int] = []
    for doc in read_texts(path):
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


@torch.no_grad()
def rolling_nll(model, docs: list[list[int]], prefix_token: int, window: int, desc: str = "") -> tuple[float, int]:
    """Summed NLL and token count with lm-eval's ``loglikelihood_rolling`` windows (``context_len=1``).

    Each document (a list of token ids) is scored on its own, every token predicted: its first
    token from ``prefix_token`` alone. Targets are cut into chunks of ``window`` tokens; the chunk
    ``tokens[p:p+w]`` is scored from one ``(1, <= window)`` forward over ``[prefix] + tokens`` ending
    at its last input, so the last, shorter chunk of a long document gets a full window of context.
    """
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for tokens in tqdm(docs, desc=desc or "documents", leave=False):
        seq = torch.tensor([prefix_token, *tokens], dtype=torch.long, device=device)
        for p in range(0, len(tokens), window):
            w = min(window, len(tokens) - p)
            logits = model(seq[max(0, p + w - window) : p + w].unsqueeze(0)).logits[0, -w:].float()
            total += float(torch.nn.functional.cross_entropy(logits, seq[p + 1 : p + w + 1], reduction="sum"))
        count += len(tokens)
    return total, count


@torch.no_grad()
def cached_nll(model, ids: torch.Tensor, make_cache, window: int, prefill: int, chunk: int, desc: str = ""):
    """Summed NLL and count of the tokens predicted through the cache (see the module docstring).

    Per ``window``-token window a fresh ``make_cache()`` is filled by a ``prefill``-token forward; the
    rest of the window is fed ``chunk`` tokens at a time, each forward reading the cache and appending to it.
    """
    if not 0 < prefill < window:
        raise ValueError(f"prefill must be in (0, window), got {prefill} with window {window}")
    device = next(model.parameters()).device
    total, count = 0.0, 0
    starts = range(0, max(len(ids) - prefill - 1, 0), window)
    for start in tqdm(starts, desc=desc or "windows", leave=False):
        x = ids[start : start + window].unsqueeze(0).to(device)
        cache = make_cache()
        model(x[:, :prefill], past_key_values=cache, use_cache=True)
        for c0 in range(prefill, x.shape[1], chunk):
            logits = model(x[:, c0 : c0 + chunk], past_key_values=cache, use_cache=True).logits[0].float()
            target = x[0, c0 + 1 : c0 + chunk + 1]
            loss = torch.nn.functional.cross_entropy(logits[: target.numel()], target, reduction="sum")
            total, count = total + float(loss), count + target.numel()
    return total, count


def cache_factory(model, spec: str, head_precision):
    """A zero-argument constructor of the cache named ``spec`` (see the module docstring)."""
    from transformers import DynamicCache

    from quantpatch.head_precision import HeadPrecision
    from quantpatch.methods.turbo import random_head_precision

    if spec == "dynamic":
        return DynamicCache
    if spec in ("turbo4", "turbo8"):
        config = quantpatch.KVCacheConfig(kind="turbo", bits=int(spec[-1]))
        return lambda: quantpatch.TurboCache(model, config)
    if not spec.startswith("mixed"):
        raise ValueError(f"unknown cache {spec!r}; valid: dynamic, turbo4, turbo8, mixed, mixed-inverse, mixed-randomN")
    if head_precision is None:
        raise ValueError(f"cache {spec!r} needs --calib (head priorities)")
    hp = head_precision
    if spec == "mixed-inverse":
        flip = [[6 - b for b in row] for row in hp.k_bits], [[6 - b for b in row] for row in hp.v_bits]
        hp = HeadPrecision(*flip, k_absmax=hp.k_absmax, v_absmax=hp.v_absmax, n_h=hp.n_h, ranking=hp.ranking,
                           method="inverse")
    elif spec.startswith("mixed-random"):
        rnd = random_head_precision(hp.num_layers, hp.kv_heads, hp.n_h, seed=int(spec[len("mixed-random"):]),
                                    ranking=hp.ranking)
        hp = HeadPrecision(rnd.k_bits, rnd.v_bits, k_absmax=hp.k_absmax, v_absmax=hp.v_absmax, n_h=hp.n_h,
                           ranking=hp.ranking, method="random", remarks=rnd.remarks)
    elif spec != "mixed":
        raise ValueError(f"unknown cache {spec!r}")
    return lambda: quantpatch.TurboCache(model, "turbo", hp)


def perplexity(model, ids: torch.Tensor, window: int, stride: int | None = None, desc: str = "") -> float:
    """``exp`` of the mean NLL over the scored tokens."""
    total, count = sliding_window_nll(model, ids, window, stride, desc)
    return math.exp(total / count)


def rows(modes: list[str], linear: str | None) -> list[tuple[str, str | None]]:
    """``(row name, linear kind)`` of each scored row: every mode as given, then, with ``linear``, each again
    with those linears, named ``MODE+LINEAR[:CACHE]`` (``off+fp8``: the model's attention unpatched)."""
    out = [(name, None) for name in modes]
    if linear is not None:
        for name in modes:
            mode, sep, cache = name.partition(":")
            out.append((f"{mode}+{linear}{sep}{cache}", linear))
    return out


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if args.lm_eval_windows:
        if args.kv_cache or args.stride:
            raise ValueError("--lm-eval-windows scores disjoint per-document windows: no --kv-cache or --stride")
        docs = [tokenizer.encode(doc) for doc in read_texts(args.data)[: args.max_docs]]  # as lm-eval's HFLM
        prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        n_tokens = sum(len(d) for d in docs)
    else:
        ids = load_token_stream(tokenizer, args.data, args.max_tokens)
        n_tokens = len(ids)
    head_precision = None
    if args.calib:
        from quantpatch.methods.turbo import calibrate_head_precision, load_texts

        head_precision = calibrate_head_precision(model, load_texts(args.calib, args.calib_docs), tokenizer,
                                                  n_h=args.n_h, ranking=args.ranking, max_length=args.window)
        logger.info("%s", head_precision.report())

    def evaluate(name: str, cache: str) -> float:
        if args.lm_eval_windows:
            total, count = rolling_nll(model, docs, prefix, args.window, desc=name)
            return math.exp(total / count)
        if not args.kv_cache:
            return perplexity(model, ids, args.window, args.stride, desc=name)
        total, count = cached_nll(model, ids, cache_factory(model, cache, head_precision), args.window,
                                  args.prefill, args.chunk, desc=name)
        return math.exp(total / count)

    results = {}
    for name, linear in rows(args.modes, args.linear):
        mode, _, cache = name.partition(":")
        mode = mode.removesuffix(f"+{linear}")
        if cache and not args.kv_cache:
            raise ValueError(f"{name!r} names a cache: add --kv-cache")
        start = time.perf_counter()
        if mode == "off" and linear is None:
            value = evaluate(name, cache or "dynamic")
        else:
            with quantpatch.patch_model(model, mode, policy="always", linear=linear) as handle:
                value = evaluate(name, cache or "dynamic")
            if handle.fallbacks():
                logger.warning("%s fell back: %s", name, handle.fallbacks())
        results[name] = {"ppl": value, "seconds": time.perf_counter() - start}
    base = results.get("off", {}).get("ppl")
    for r in results.values():
        r["delta_pct"] = None if base is None else 100 * (r["ppl"] / base - 1)
    return {
        "model": str(args.model),
        "data": str(args.data),
        "tokens": n_tokens,
        "windowing": "lm-eval loglikelihood_rolling, per document" if args.lm_eval_windows else "token stream",
        "documents": len(docs) if args.lm_eval_windows else None,
        "window": args.window,
        "stride": args.stride or args.window,
        "kv_cache": {"prefill": args.prefill, "chunk": args.chunk} if args.kv_cache else None,
        "head_precision": head_precision.to_dict() if head_precision is not None else None,
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
    parser.add_argument("--linear", default=None, choices=["fp8"],
                        help="also score each mode with the transformer blocks' linears in FP8 (rows MODE+fp8; "
                             "off+fp8: FP8 linears, attention unpatched)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--kv-cache", action="store_true", help="score chunks fed through a KV cache")
    parser.add_argument("--lm-eval-windows", action="store_true",
                        help="score each document on its own with lm-eval's loglikelihood_rolling windows of --window "
                             "tokens (prefix token BOS, else EOS); --max-tokens is then unused")
    parser.add_argument("--max-docs", type=int, default=None, help="--lm-eval-windows: the first N documents")
    parser.add_argument("--prefill", type=int, default=512, help="--kv-cache: tokens prefilled per window")
    parser.add_argument("--chunk", type=int, default=64, help="--kv-cache: tokens per cached forward")
    parser.add_argument("--calib", default=None, help="jsonl of calibration texts for the mixed caches")
    parser.add_argument("--calib-docs", type=int, default=8)
    parser.add_argument("--n-h", type=float, default=0.5, help="2-bit KV heads per layer (a fraction)")
    parser.add_argument("--ranking", default="joint", choices=["joint", "separate"], help="K/V heads ranked together")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    report = run(args)
    how = f", prefill {args.prefill} + chunks of {args.chunk} through the cache" if args.kv_cache else ""
    print(f"{'mode':<22} {'ppl':>9} {'Δ %':>7} {'s':>7}   ({report['tokens']} tokens, window {args.window}{how}, "
          f"{args.dtype} on {report['device']})")
    for mode, r in report["results"].items():
        delta = "" if r["delta_pct"] is None else f"{r['delta_pct']:+.2f}"
        print(f"{mode:<22} {r['ppl']:>9.3f} {delta:>7} {r['seconds']:>7.1f}")
    if args.out:
        write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
