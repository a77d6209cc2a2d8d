"""README figures from committed results: perplexity per mode, and attention accuracy per mode on the GPU.

Reads only files under ``eval/results`` (no model, no GPU):

* ``perplexity/pydoc-llama-21m_*.json`` (``eval/perplexity.py --out``): one bar group per mode,
  one bar per machine/dtype, the increase over the unpatched model in percent;
* ``bench_attention/accuracy.csv`` (``eval/bench_attention.py``, H200): CosSim and relative L1
  of each mode and SDPA against a float64 attention, per input kind, D=128 non-causal.

Usage::

    python eval/plot_results.py --out eval/results/plots
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path
from typing import Sequence

RESULTS = Path(__file__).resolve().parent / "results"


def perplexity_runs(directory: Path) -> dict[str, dict[str, float]]:
    """``{"<device> <dtype>": {mode: Δ%}}`` from every ``pydoc-llama-21m_*.json`` in ``directory``."""
    runs: dict[str, dict[str, float]] = {}
    for path in sorted(directory.glob("pydoc-llama-21m_*.json")):
        run = json.loads(path.read_text())
        label = f"{run['device'].replace('NVIDIA ', '').split(' 80GB')[0]} {run['dtype']}"
        runs.setdefault(label, {}).update({m: r["delta_pct"] for m, r in run["results"].items() if m != "off"})
    return runs


def plot_perplexity(runs: dict[str, dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted({m for r in runs.values() for m in r}, key=lambda m: max(r.get(m, 0) for r in runs.values()))
    width = 0.8 / len(runs)
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for i, (label, deltas) in enumerate(runs.items()):
        xs = [j + i * width for j, m in enumerate(modes) if m in deltas]
        ax.bar(xs, [deltas[m] for m in modes if m in deltas], width, label=label)
    ax.set_xticks([j + width * (len(runs) - 1) / 2 for j in range(len(modes))], modes)
    ax.axhline(0, color="black", lw=0.6)
    ax.set_ylabel("perplexity increase (%)")
    ax.set_title("pydoc-llama-21m, pydoc-val first 16k tokens, 1024-token windows")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_accuracy(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["head_dim"] == "128" and r["causal"] == "0"]
    kinds = sorted({r["inputs"] for r in rows})
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    width = 0.8 / len(kinds)
    for ax, metric, title in ((axes[0], "cos_sim", "1 − CosSim"), (axes[1], "rel_l1", "relative L1")):
        for i, kind in enumerate(kinds):
            vals = {r["impl"]: float(r[metric]) for r in rows if r["inputs"] == kind}
            ys = [1 - vals[m] if metric == "cos_sim" else vals[m] for m in impls]
            ax.bar([j + i * width for j in range(len(impls))], ys, width, label=f"{kind} inputs")
        ax.set_xticks([j + width * (len(kinds) - 1) / 2 for j in range(len(impls))], impls, rotation=30, fontsize=8)
        ax.set_yscale("log")
        ax.set_title(f"{title} vs float64 (lower is better)")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    seq, heads = rows[0]["seq_len"], rows[0]["heads"]
    fig.suptitle(f"NVIDIA H200, bf16 in, D=128, N={seq}, {heads} heads, non-causal (eval/bench_attention.py)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--out", type=Path, default=RESULTS / "plots")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    written = [args.out / "perplexity.png", args.out / "accuracy_h200.png"]
    plot_perplexity(perplexity_runs(args.results / "perplexity"), written[0])
    with open(args.results / "bench_attention" / "accuracy.csv", newline="") as f:
        plot_accuracy(list(csv.DictReader(f)), written[1])
    return written


if __name__ == "__main__":
    for p in main():
        print(p)
