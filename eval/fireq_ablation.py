"""FireQ ablation: perplexity of a causal LM with W4A8 linears, CAS, PTS, RPN, CRS and an INT4 KV cache.

    python eval/fireq_ablation.py --model ../shared/models/pydoc-llama-21m \
        --calib ../shared/data/pydoc-calib.jsonl --samples 64 --seq-len 512 \
        --data ../shared/data/pydoc-val.jsonl --max-tokens 16384 --window 1024 \
        --out eval/results/fireq_ablation/pydoc-llama-21m_cpu.json

The model is calibrated once (the statistics come from the unconverted model, so every
variant shares them); each variant reloads the model, converts it with its own switches and
is scored with ``eval/perplexity.py``'s sliding-window perplexity. Attention per variant:
``float`` (the model's own), ``fp8`` (the ``fireq`` FP8 prefill attention with online CRS),
``kv4`` (K and V through FireQ's INT4 per-token cache with online CRS, Q and P̃ in FP8,
attended by every query: :func:`quantpatch.methods.fireq.fireq_attention_ref`), or ``kv4-k`` /
``kv4-v`` (only K, or only V, replaced by its INT4 cache operand ``e4m3(x̂ σ)``, float
attention otherwise: where the INT4 cost comes from). The attention runs through a temporary
``AttentionInterface`` registration (:func:`fireq_attention`), evaluation only.

Why every query attends to the INT4 cache in ``kv4``: FireQ's own prefill kernel reads FP8
K/V (App. D: "quantized in FP8 (not in INT4) for the prefill phase"), so a served forward
over a window never reads the INT4 cache; yet the paper's WikiText-2 ablation (Table 3) moves
with RPN and CRS, which only change INT4 key quantization, so its perplexity attends to INT4
K/V for every token, as a decode would. ``--checkpoint`` scores both: the ``kv4`` headline
and ``checkpoint-served`` (the loaded model's own patched attention, FP8 prefill).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import json
import logging
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from quantpatch.calibration import CalibrationStats, calibrate
from quantpatch.checkpoint import load
from quantpatch.conversion import FireQOptions, convert
from quantpatch.crs import crs_buffers
from quantpatch.methods.fireq import fireq_attention_ref
from quantpatch.modes import get_mode
from quantpatch.w4a8_linear import W4A8Linear

logger = logging.getLogger("quantpatch.eval")
_keys = itertools.count()


def _perplexity_module():
    """``eval/perplexity.py`` (not a package): its token stream and sliding-window perplexity."""
    name = "_quantpatch_eval_perplexity"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("perplexity.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def int4_only_attention(query, key, value, crs, which: str, *, is_causal: bool, scale, attn_mask):
    """Float attention after online CRS with only K (``which="k"``) or only V (``"v"``) through the INT4 cache."""
    from quantpatch.api import attention
    from quantpatch.crs import apply_online_crs
    from quantpatch.kernels.fireq_kv.fireq_ref import dequantize_kv_cache, quantize_kv_cache

    query, key = apply_online_crs(query, key, crs)
    if which == "k":
        key = dequantize_kv_cache(quantize_kv_cache(key)).to(key.dtype)
    else:
        value = dequantize_kv_cache(quantize_kv_cache(value)).to(value.dtype)
    return attention(query, key, value, mode="off", is_causal=is_causal, scale=scale, attn_mask=attn_mask)


@contextlib.contextmanager
def fireq_attention(model, *, kv_int4: bool = True, fp8: bool = True, kv_operand: str = "fp8",
                    int4_only: str | None = None):
    """Run ``model``'s attention through :func:`fireq_attention_ref` (CRS from the module's buffers) inside the block.

    ``int4_only`` (``"k"`` or ``"v"``) runs :func:`int4_only_attention` instead. Registers a
    fresh ``AttentionInterface`` key (with the sdpa mask) and restores the model's
    implementation and the global registries on exit.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    def forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
        buffers = crs_buffers(module)
        causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
        causal = causal and attention_mask is None and query.shape[2] > 1
        if int4_only:
            crs = None if buffers is None else buffers[0]
            out = int4_only_attention(query, key, value, crs, int4_only, is_causal=causal, scale=scaling,
                                      attn_mask=attention_mask)
            return out.transpose(1, 2).contiguous(), None
        out = fireq_attention_ref(query, key, value, None if buffers is None else buffers[0], kv_int4=kv_int4,
                                  fp8=fp8, kv_operand=kv_operand, is_causal=causal, scale=scaling,
                                  attn_mask=attention_mask)
        return out.transpose(1, 2).contiguous(), None

    name = f"quantpatch_fireq_eval_{next(_keys)}"
    original = model.config._attn_implementation
    AttentionInterface._global_mapping[name] = forward
    ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[name] = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping["sdpa"]
    try:
        model.set_attn_implementation(name)
        yield model
    finally:
        model.set_attn_implementation(original)
        del AttentionInterface._global_mapping[name]
        del ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[name]


@dataclass(frozen=True)
class Variant:
    """One ablation row: which linear/KV techniques are on and how attention runs.

    ``attention``: ``float`` (the model's own), ``fp8`` (``fireq`` FP8 prefill), ``kv4`` (INT4 K/V
    cache read with FireQ's decode numerics), ``kv4-k`` / ``kv4-v`` (only K / only V through the
    INT4 cache, float attention otherwise). ``crs_pairs``: outlier pairs per head (8; the
    CRS-only row uses every pair, FireQ App. E.2's "64 outlier channels" case).
    """

    name: str
    linear: bool = False
    cas: bool = False
    pts: bool = False
    kv: bool = False  # merge RPN / set up CRS (kv_cache.kind = fireq)
    rpn: bool = False
    crs: bool = False
    crs_pairs: int = 8
    attention: str = "float"
    kv_operand: str = "fp8"
    options: dict = field(default_factory=dict)

    def mode(self, head_dim: int):
        pairs = min(self.crs_pairs, head_dim // 2) if self.crs else 0
        return get_mode("fireq").with_options(**{
            "linear.kind": "w4a8_fp8" if self.linear else "none", "linear.cas": self.cas, "linear.pts": self.pts,
            "kv_cache.kind": "fireq" if self.kv else "none", "kv_cache.crs_pairs": pairs,
        })


LIN = dict(linear=True, cas=True, pts=True)
KV = dict(kv=True, attention="kv4")
FULL = dict(**LIN, **KV, rpn=True, crs=True)
PAPER_AB = {"rpn_alpha": 8.0, "crs_beta": 8.0}  # FireQ App. E, Fig. 10
VARIANTS = {
    v.name: v
    for v in [
        Variant("fp"),
        Variant("fp8-attn", attention="fp8"),
        # the ablation's cumulative order (RTN, +CAS, +PTS, +RPN, +CRS, then +INT4 KV = full) with
        # the fireq FP8 prefill attention (the recipe's attention before the INT4 cache is read)
        Variant("rtn/fp8", linear=True, attention="fp8"),
        Variant("rtn+cas/fp8", linear=True, cas=True, attention="fp8"),
        Variant("rtn+cas+pts/fp8", **LIN, attention="fp8"),
        Variant("rtn+cas+pts+rpn/fp8", **LIN, kv=True, rpn=True, attention="fp8"),
        Variant("rtn+cas+pts+rpn+crs/fp8", **LIN, kv=True, rpn=True, crs=True, attention="fp8"),
        # linears alone (attention in float)
        Variant("rtn", linear=True),
        Variant("rtn+cas", linear=True, cas=True),
        Variant("rtn+pts", linear=True, pts=True),
        Variant("rtn+cas+pts", **LIN),
        # KV cache on top of CAS+PTS linears, then its smoothing
        Variant("rtn+cas+pts+kv4", **LIN, **KV),
        Variant("rtn+cas+pts+kv4+rpn", **LIN, **KV, rpn=True),
        Variant("full", **FULL),
        Variant("full-alpha8", **FULL, options=PAPER_AB),
        Variant("full-kv-exact", **FULL, kv_operand="exact"),
        Variant("full-w-lut", **FULL, options={"weight_operand": "lut"}),
        # FireQ §3.1.2 sets "Λ1" of its Fig. 1 to a constant without naming the site: either reading
        Variant("full-cas-no-o", **FULL, options={"cas_sites": ["qkv", "gate_up", "down"]}),
        Variant("full-cas-no-qkv", **FULL, options={"cas_sites": ["o", "gate_up", "down"]}),
        # KV cache alone (float linears)
        Variant("kv4", **KV),
        Variant("kv4+rpn", **KV, rpn=True),
        Variant("kv4+rpn-alpha8", **KV, rpn=True, options=PAPER_AB),
        Variant("kv4+crs-all", **KV, crs=True, crs_pairs=1 << 16),
        Variant("kv4+rpn+crs", **KV, rpn=True, crs=True),
        Variant("kv4-k-only+rpn+crs", kv=True, rpn=True, crs=True, attention="kv4-k"),
        Variant("kv4-v-only+rpn+crs", kv=True, rpn=True, crs=True, attention="kv4-v"),
        # no smoothing at all, and the components that helped on pydoc-llama-21m alone
        Variant("rtn+kv4", linear=True, **KV),
        Variant("rtn+pts+kv4+rpn", linear=True, pts=True, **KV, rpn=True),
    ]
}


def run_variant(variant: Variant, args, stats, ids, ppl) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    start = time.perf_counter()
    if variant.linear or variant.kv:
        opts = {"rpn": variant.rpn, "rpn_alpha": args.rpn_alpha, "crs_beta": args.crs_beta,
                "cas_sites": args.cas_sites, **variant.options}
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        convert(model, stats, variant.mode(head_dim), options=FireQOptions.from_dict(opts), progress=False)
        for m in model.modules():
            if isinstance(m, W4A8Linear):
                m.cache_unpacked = True  # unpack each weight once (reference path on CPU)
    ctx = contextlib.nullcontext() if variant.attention == "float" else fireq_attention(
        model, kv_int4=variant.attention == "kv4", fp8=True, kv_operand=variant.kv_operand,
        int4_only=variant.attention.removeprefix("kv4-") if variant.attention.startswith("kv4-") else None)
    with ctx:
        value = ppl.perplexity(model, ids, args.window, None, desc=variant.name)
    return {"ppl": value, "seconds": time.perf_counter() - start, **asdict(variant)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--calib", required=True, help="jsonl with a 'text' field")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--data", required=True)
    parser.add_argument("--max-tokens", type=int, default=16384)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--rpn-alpha", type=float, default=FireQOptions().rpn_alpha)
    parser.add_argument("--crs-beta", type=float, default=FireQOptions().crs_beta)
    parser.add_argument("--cas-sites", nargs="*", default=list(FireQOptions().cas_sites))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--stats-cache", default=None, help="JSON file to reuse calibration statistics from")
    parser.add_argument("--checkpoint", default=None, help="also score this `quantpatch calibrate` checkpoint")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ppl = _perplexity_module()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    ids = ppl.load_token_stream(tokenizer, args.data, args.max_tokens)
    texts = [json.loads(line)["text"] for line in Path(args.calib).read_text().splitlines() if line.strip()]
    if args.stats_cache and Path(args.stats_cache).exists():
        stats = CalibrationStats.from_dict(json.loads(Path(args.stats_cache).read_text()))
    else:
        base = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        stats = calibrate(base, texts, "fireq", tokenizer=tokenizer, samples=args.samples, seq_len=args.seq_len)
        del base
        if args.stats_cache:
            Path(args.stats_cache).write_text(json.dumps(stats.to_dict()))
    results = {}
    for name in args.variants:
        results[name] = run_variant(VARIANTS[name], args, stats, ids, ppl)
        logger.info("%-22s ppl %.3f (%.0f s)", name, results[name]["ppl"], results[name]["seconds"])
        if args.out:  # partial results survive an interrupted run
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).with_suffix(".partial.json").write_text(json.dumps(results, indent=2))
    if args.checkpoint:  # the acceptance path: `quantpatch calibrate` → quantpatch.load → full recipe
        for name, served in (("checkpoint", False), ("checkpoint-served", True)):
            start = time.perf_counter()
            model = load(args.checkpoint, base_model=args.model, patch_attention=served)
            for m in model.modules():
                if isinstance(m, W4A8Linear):
                    m.cache_unpacked = True
            # headline: every query attends to the INT4 cache (module docstring); served: the
            # loaded model's own patched attention (FP8 prefill, the cache is written, not read)
            ctx = contextlib.nullcontext() if served else fireq_attention(model, kv_int4=True, fp8=True)
            with ctx:
                value = ppl.perplexity(model, ids, args.window, None, desc=name)
            results[name] = {"ppl": value, "seconds": time.perf_counter() - start, "name": name,
                             "path": args.checkpoint, "options": model._quantpatch_state.options.to_dict(),
                             "attention": "served (fireq FP8 prefill)" if served else "kv4"}
            logger.info("%-22s ppl %.3f", name, value)
            del model
    base_ppl = results.get("fp", {}).get("ppl")
    rtn_ppl = results.get("rtn", {}).get("ppl")
    for r in results.values():
        r["delta_pct"] = None if base_ppl is None else 100 * (r["ppl"] / base_ppl - 1)
    report = {
        "command": "python eval/fireq_ablation.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "model": args.model, "calib": args.calib, "samples": stats.meta["samples"], "seq_len": args.seq_len,
        "calib_tokens": stats.meta["tokens"], "data": args.data, "tokens": len(ids), "window": args.window,
        "options": {"rpn_alpha": args.rpn_alpha, "crs_beta": args.crs_beta, "cas_sites": args.cas_sites},
        "machine": platform.platform(), "torch": torch.__version__, "results": results,
    }
    print(f"{'variant':<22} {'ppl':>9} {'Δ % vs fp':>10} {'vs rtn':>8}  ({len(ids)} tokens, window {args.window})")
    for name, r in results.items():
        delta = "" if r["delta_pct"] is None else f"{r['delta_pct']:+.2f}"
        vs_rtn = "" if rtn_ppl is None else f"{100 * (r['ppl'] / rtn_ppl - 1):+.2f}"
        print(f"{name:<22} {r['ppl']:>9.3f} {delta:>10} {vs_rtn:>8}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
