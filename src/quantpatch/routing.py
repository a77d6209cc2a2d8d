"""Where a quantized attention kernel beats SDPA: the crossover table behind ``policy="speed"``.

A quantized call pays a quantization pass (linear in tokens) to save tensor-core time (quadratic in
tokens), so it wins only from some sequence length on, which depends on the GPU, the kernel, the
head dim and causality. The table maps ``(speed_key, head_dim, causal)`` to the smallest query and
key length from which the mode's end-to-end time (quantization included) beat SDPA's default
backend on every longer length measured; ``None`` where it never did. Shorter calls, and
cross-attention over a few hundred text tokens, run SDPA.

Tables ship per architecture (:data:`SHIPPED`, measured with :func:`tune` on an H100/H200);
``quantpatch tune`` re-measures them on the user's GPU and writes :func:`user_table_path`, which
then takes precedence.

One more entry, :data:`TURBO_CACHE`, is the turbo mode's decode cache: the batch × context (KV tokens a
layer) from which eager ``generate()`` with the compressed cache took fewer ms per token than with the
model's own cache. It comes from model-level decode runs, not from :func:`tune`; a tuned table without it
keeps the shipped value.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from quantpatch.config import AttentionConfig

logger = logging.getLogger("quantpatch")

TABLE_VERSION = 1
TUNE_LENGTHS = (1024, 2048, 4096, 6144, 8192, 16384, 32768)
TUNE_HEAD_DIMS = (64, 128)
TUNE_MODES = ("sage2-8b", "sage2-4b", "int8-flash", "fireq", "turbo")


TURBO_CACHE = "turbo-cache/kv-tokens"


def speed_key(cfg: AttentionConfig) -> str:
    """The table key of ``cfg``: its numerics family, plus ``+smooth_q`` where that adds the ΔS pass."""
    return f"{cfg.numerics}+smooth_q" if cfg.smooth_q else cfg.numerics


def entry_key(key: str, head_dim: int, causal: bool) -> str:
    return f"{key}/d{head_dim}/{'causal' if causal else 'full'}"


# sm_90 (H100 / H200): per entry the later crossover of two GPUs' tables, so that no measured sm_90 GPU runs a call
# slower than SDPA: an H200's `quantpatch tune --repeats 2` (B=1, H=32, bf16; eval/results/tune/crossovers-sm_90.json,
# each ratio the lower of two measurements), with its int8_flash and fireq entries from
# `quantpatch tune --modes int8-flash fireq --repeats 2` once both ran the one-warpgroup sm_90 kernel
# (crossovers-sm_90-token-scales.json), and an H100 SXM's `quantpatch tune --modes sage2-8b sage2-4b int8-flash fireq
# --repeats 2` (crossovers-sm_90-h100.json; its lower memory bandwidth makes the quantization pass dearer, so five
# entries come later there: sage2+smooth_q d128 full, int8_flash d128 causal, fireq d64 causal, fireq d128 full, and
# int8_flash d64 full never). `quantpatch tune` writes the user's own GPU's table, which then replaces this one.
# Values: the crossover sequence length (queries and keys); None = the mode did not beat SDPA at the longest length
# measured (32k). turbo's prefill (SAS), not in those runs, ran 0.2-0.4x SDPA at every length in an earlier tune.
SHIPPED: dict[str, dict[str, int | None]] = {
    "sm_90": {
        entry_key("sage2", 64, False): 8192,
        entry_key("sage2", 64, True): 16384,
        entry_key("sage2", 128, False): 8192,
        entry_key("sage2", 128, True): 8192,
        entry_key("sage2+smooth_q", 64, False): None,
        entry_key("sage2+smooth_q", 64, True): None,
        entry_key("sage2+smooth_q", 128, False): 16384,
        entry_key("sage2+smooth_q", 128, True): 16384,
        entry_key("int8_flash", 64, False): None,
        entry_key("int8_flash", 64, True): None,
        entry_key("int8_flash", 128, False): 8192,
        entry_key("int8_flash", 128, True): 16384,
        entry_key("fireq", 64, False): 6144,
        entry_key("fireq", 64, True): 16384,
        entry_key("fireq", 128, False): 6144,
        entry_key("fireq", 128, True): 6144,
        entry_key("turbo", 64, False): None,
        entry_key("turbo", 64, True): None,
        entry_key("turbo", 128, False): None,
        entry_key("turbo", 128, True): None,
        # Llama-3-8B shape, 16 layers, random weights, median ms per generate() step after a synchronize, own cache →
        # turbo (H200, commit 884f228): B×N = 1×4k 12.7 → 20.1, 8×8k 12.5 → 16.7, 2×16k 15.0 → 17.4, 8×16k 13.0 →
        # 28.7, 1×32k 18.1 → 15.4 (fastest steps 12.5 → 14.7), 4×32k 23.2 → 21.3 (12.9 → 17.3), 8×32k 18.4 → 16.2;
        # only 8×32k won on its fastest steps too
        TURBO_CACHE: 8 * 32768,
    },
}


def arch(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def user_table_path(architecture: str) -> Path:
    """``$XDG_CACHE_HOME/quantpatch/crossovers-<arch>.json`` (``~/.cache`` by default)."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "quantpatch" / f"crossovers-{architecture}.json"


def read_table(path: Path) -> dict[str, int | None]:
    """The ``crossovers`` of a table written by :func:`tune`; ``ValueError`` naming the file if malformed."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a quantpatch crossover table ({err})") from err
    valid = isinstance(data, dict) and data.get("version") == TABLE_VERSION
    if not (valid and isinstance(data.get("crossovers"), dict)):
        raise ValueError(f"{path}: not a version-{TABLE_VERSION} quantpatch crossover table")
    table = data["crossovers"]
    for key, value in table.items():
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{path}: crossover {key!r} = {value!r} is not a positive integer or null")
    return table


_TABLES: dict[str, tuple[dict[str, int | None], str]] = {}


def table_for(architecture: str) -> tuple[dict[str, int | None] | None, str]:
    """The crossover table of ``architecture`` and where it came from (the user's tuned file first)."""
    if architecture not in _TABLES:
        path = user_table_path(architecture)
        table, source = SHIPPED.get(architecture), f"shipped {architecture} table"
        if path.is_file():
            try:
                table, source = read_table(path), str(path)
            except ValueError as err:
                logger.warning("%s; using the %s", err, source)
        _TABLES[architecture] = (table, source)
    return _TABLES[architecture]


def turbo_cache_crossover(device: torch.device) -> tuple[int | None, str]:
    """``(KV tokens a layer from which the turbo cache pays on device, where that came from)``: the
    :data:`TURBO_CACHE` entry of the device's table (the shipped one where a tuned table lacks it); None where the
    device has no table (a CPU, a GPU without one)."""
    if device.type != "cuda":
        return None, f"no crossover table for {device.type}"
    architecture = arch(device)
    table, source = table_for(architecture)
    if table is not None and TURBO_CACHE in table:
        return table[TURBO_CACHE], source
    shipped = SHIPPED.get(architecture)
    if shipped is None:
        return None, f"no crossover table for {architecture}"
    return shipped.get(TURBO_CACHE), f"shipped {architecture} table"


def forget_tables() -> None:
    """Drop the loaded tables (after :func:`tune` wrote a new one, and in tests)."""
    _TABLES.clear()


# --------------------------------------------------------------------------- measurement


def _median_ms(fn, warmup: int, rep: int) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def crossover(lengths: Sequence[int], ratios: Sequence[float], margin: float = 1.02) -> int | None:
    """The smallest length from which every ``ratio`` (SDPA time / quantized time) is at least ``margin``."""
    best = None
    for n, r in sorted(zip(lengths, ratios), reverse=True):
        if r < margin:
            break
        best = n
    return best


def tune(
    modes: Sequence[str] = TUNE_MODES,
    head_dims: Sequence[int] = TUNE_HEAD_DIMS,
    lengths: Sequence[int] = TUNE_LENGTHS,
    *,
    heads: int = 32,
    device: str | torch.device = "cuda",
    warmup: int = 25,
    rep: int = 100,
    repeats: int = 2,
    out: Path | None = None,
    timer=None,
) -> dict[str, Any]:
    """Measure each mode against SDPA on this GPU and write the crossover table.

    Times ``quantpatch.attention(policy="always")`` end to end (bf16 inputs ``(1, heads, N, D)``,
    quantization included) against ``F.scaled_dot_product_attention`` (its default backend) at each
    length, causal and not, and keeps per entry the :func:`crossover` length. Each ratio is the lowest of
    ``repeats`` measurements (SDPA, then every mode, again): a length that won once by the timer's spread does
    not route calls away from SDPA. ``timer(fn) -> ms`` replaces the GPU timer (tests). Returns the table
    written to ``out`` (default :func:`user_table_path`).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    from tqdm import tqdm

    from quantpatch.api import attention
    from quantpatch.modes import get_mode

    device = torch.device(device)
    timer = timer or (lambda fn: _median_ms(fn, warmup, rep))
    architecture = arch(device) if device.type == "cuda" else device.type
    configs = {mode: get_mode(mode).attention for mode in modes}
    keys = {(mode, d, c): entry_key(speed_key(cfg), d, c) for mode, cfg in configs.items() for d in head_dims
            for c in (False, True)}
    ratios: dict[str, dict[int, float]] = {key: {} for key in keys.values()}
    with tqdm(total=len(keys) * len(lengths) * repeats, desc="quantpatch tune", unit="shape") as bar:
        for d in head_dims:
            for causal in (False, True):
                for n in lengths:
                    gen = torch.Generator(device=device).manual_seed(n)
                    q, k, v = (torch.randn(1, heads, n, d, device=device, dtype=torch.bfloat16, generator=gen)
                               for _ in range(3))
                    for _ in range(repeats):  # SDPA, then every mode against it
                        sdpa = timer(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v,
                                                                                             is_causal=causal))
                        for mode, cfg in configs.items():
                            quant = timer(lambda: attention(q, k, v, mode=cfg, is_causal=causal, policy="always"))
                            key = keys[mode, d, causal]
                            ratios[key][n] = min(ratios[key].get(n, math.inf), sdpa / quant)
                            bar.update()
    crossovers = {key: crossover(list(measured), list(measured.values())) for key, measured in ratios.items()}
    table = {"version": TABLE_VERSION, "architecture": architecture, "heads": heads, "repeats": repeats,
             "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
             "torch": torch.__version__, "crossovers": crossovers,
             "ratios": {k: {str(n): round(r, 4) for n, r in v.items()} for k, v in ratios.items()}}
    path = Path(out) if out is not None else user_table_path(architecture)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1) + "\n")
    from quantpatch.dispatch import forget_crossovers  # dispatch imports this module

    forget_crossovers()  # this process's routing decisions follow the new table
    logger.info("quantpatch tune: wrote %s", path)
    return table


def table_length(table: dict[str, int | None] | None, key: str, head_dim: int, causal: bool) -> float:
    """The crossover length of :func:`speed_key` ``key`` at ``head_dim`` (``inf``: never, or not measured)."""
    if table is None:
        return math.inf
    value = table.get(entry_key(key, head_dim, causal))
    return math.inf if value is None else value
