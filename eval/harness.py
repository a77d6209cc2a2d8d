"""The benchmark harness shared by ``eval/bench_*.py``: timing, the machine record, result files, plot, table.

* :func:`bench`: ``triton.testing.do_bench`` median of a short call, cycling over input sets (kernels, layers);
  :func:`graph_replays` captures such a call in CUDA graphs first (no host launch cost in the time);
* :func:`time_calls`: median of whole calls that each take milliseconds to seconds (a model step), timed with
  CUDA events after warm-up calls; :class:`StepClock`: the time between consecutive steps of a loop that runs
  elsewhere (``generate()``'s decode steps, through a logits processor);
* :func:`machine_record`: GPU, versions (torch, Triton, Transformers, Diffusers), git SHA, command line;
* :func:`write_csv`, :func:`write_json`, :func:`bar_chart` (PNG), :func:`markdown_table`;
* :func:`similarity`: CosSim and relative L1 of a large output against its reference, streamed in float64.
"""

from __future__ import annotations

import csv
import itertools
import math
import statistics
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from quantpatch.environment import environment_info, write_json

__all__ = [
    "StepClock", "bar_chart", "bench", "graph_replays", "machine_record", "markdown_table", "median", "similarity",
    "time_calls", "warm_up_on_side_stream", "write_csv", "write_json",
]


# --------------------------------------------------------------------------- timing


def bench(fn: Callable[[int], object], n_sets: int, warmup: int, rep: int) -> float:
    """Median milliseconds of ``fn(i)`` with ``i`` cycling over ``n_sets`` input sets (``do_bench``: warm-up and
    repetition budgets in ms, the L2 cache flushed between calls)."""
    import triton.testing

    counter = itertools.count()
    return float(triton.testing.do_bench(lambda: fn(next(counter) % n_sets), warmup=warmup, rep=rep,
                                         return_mode="median"))


def warm_up_on_side_stream(fn: Callable[[int], object], n_sets: int) -> torch.cuda.Stream:
    """``fn(i)`` for every input set on a side stream (compilation and cached workspaces before a CUDA-graph
    capture, which needs them made outside it); the current stream waits for it. Returns the side stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(n_sets):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    return side


def graph_replays(fn: Callable[[int], object], n_sets: int) -> Callable[[int], object]:
    """``fn(i)`` captured once per input set in a CUDA graph (warmed up on a side stream first: compilation
    and cached workspaces stay outside the capture); returns ``i ↦ replay``."""
    warm_up_on_side_stream(fn, n_sets)
    graphs = []
    for i in range(n_sets):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(i)
        graphs.append(graph)
    return lambda i: graphs[i].replay()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn: Callable[[], object], device: str | torch.device, *, warmup: int = 1,
               reps: int = 3, host_ms: list[float] | None = None) -> tuple[object, list[float]]:
    """Run ``fn()`` ``warmup`` times, then time ``reps`` calls one by one (CUDA events around each on a GPU,
    ``perf_counter`` after a synchronize on a CPU).

    For calls long enough that launch gaps between calls do not matter (a model step: milliseconds to
    seconds); the median of the returned times is the figure to report. Returns ``(output of the first
    call, [ms of each timed call])``; with ``warmup=0`` the first call is also the first timed one.
    ``host_ms`` (a list) receives, for each timed call, the ms until ``fn()`` returned on the host: on a GPU, where
    it comes close to the call's time, the call waited on the host's launches rather than on the device.
    """
    device = torch.device(device)
    first, times = None, []
    for i in range(warmup + reps):
        _synchronize(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            out = fn()
            host = (time.perf_counter() - t0) * 1e3
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            out = fn()
            ms = host = (time.perf_counter() - t0) * 1e3
        if i == 0:
            first = out
        if i >= warmup:
            times.append(ms)
            if host_ms is not None:
                host_ms.append(host)
        del out
    return first, times


class StepClock:
    """Marks the steps of a loop run by someone else (call :meth:`tick` once per step) and gives the
    milliseconds between consecutive ticks: CUDA events on a GPU (no synchronisation added to the loop),
    ``perf_counter`` after a synchronize on a CPU."""

    def __init__(self, device: str | torch.device):
        self.device = torch.device(device)
        self._marks: list = []

    def tick(self) -> None:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())

    def intervals_ms(self) -> list[float]:
        """Milliseconds from each tick to the next (``len(ticks) - 1`` values)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return [a.elapsed_time(b) for a, b in itertools.pairwise(self._marks)]
        return [(b - a) * 1e3 for a, b in itertools.pairwise(self._marks)]


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


# --------------------------------------------------------------------------- accuracy


def similarity(out: torch.Tensor, ref: torch.Tensor, chunk: int = 1 << 24) -> dict[str, float]:
    """``{"cos_sim", "rel_l1"}`` of ``out`` against ``ref`` (same shape) in float64, ``chunk`` elements at a time,
    so that a multi-GB activation is compared without a float64 copy of it (the values of
    :func:`quantpatch.metrics.cos_sim` and :func:`quantpatch.metrics.rel_l1`)."""
    if out.shape != ref.shape:
        raise ValueError(f"shape mismatch: {tuple(out.shape)} vs reference {tuple(ref.shape)}")
    a, b = out.detach().reshape(-1), ref.detach().reshape(-1)
    dot = na = nb = l1 = ref_l1 = 0.0
    for s in range(0, a.numel(), chunk):
        x, y = a[s:s + chunk].double(), b[s:s + chunk].double()
        dot += float((x * y).sum())
        na += float((x * x).sum())
        nb += float((y * y).sum())
        l1 += float((x - y).abs().sum())
        ref_l1 += float(y.abs().sum())
    return {"cos_sim": dot / math.sqrt(na * nb) if na and nb else math.nan,
            "rel_l1": l1 / ref_l1 if ref_l1 else math.nan}


# --------------------------------------------------------------------------- records


def machine_record(device: str | torch.device, repo: str | Path) -> dict:
    """:func:`quantpatch.environment.environment_info` (date, command line, GPU, torch/Triton/Transformers/CUDA
    versions, git SHA) plus the Diffusers version and the GPU's memory."""
    info = environment_info(device, repo)
    try:
        import diffusers

        info["diffusers"] = diffusers.__version__
    except ImportError:
        info["diffusers"] = None
    device = torch.device(device)
    if device.type == "cuda":
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
    return info


def write_csv(path: str | Path, rows: list[dict]) -> None:
    """Rows as CSV, the columns being every key in order of first appearance; nothing for no rows."""
    if not rows:
        return
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with Path(path).open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)


def markdown_table(rows: list[dict], columns: Sequence[tuple[str, str, str]]) -> str:
    """A markdown table of ``rows``; ``columns`` are ``(key, header, format spec)``; a missing or NaN value
    is left blank."""
    def cell(row: dict, key: str, spec: str) -> str:
        value = row.get(key)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return ""
        return format(value, spec)

    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |",
             "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(cell(r, k, s) for k, _, s in columns) + " |" for r in rows]
    return "\n".join(lines)


def bar_chart(path: str | Path, values: dict[str, dict[str, float]], *, ylabel: str, title: str,
              reference: float | None = 1.0) -> None:
    """Grouped bars, one group per outer key of ``values`` and one bar per inner key (NaN bars left out),
    a dashed line at ``reference``; written as a PNG. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(values)
    series = list(dict.fromkeys(k for g in groups for k in values[g]))
    width = 0.8 / max(len(series), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(groups) + 2), 4.5))
    for i, name in enumerate(series):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ys = [values[group].get(name, math.nan) for group in groups]
        ax.bar(xs, ys, width, label=name)
    if reference is not None:
        ax.axhline(reference, color="k", lw=0.8, ls="--")
    ax.set_xticks(range(len(groups)), groups, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, ncol=min(len(series), 4))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
