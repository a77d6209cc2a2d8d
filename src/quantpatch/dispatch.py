"""The one place that picks an attention implementation for a call.

Implementations register per numerics family with a priority and an ``unsupported`` check
(returns why it cannot take a call, or ``None``). :func:`select` returns the best that
accepts the call, plus the reasons of those that declined; the caller falls back to SDPA
when none accepts. The pure-PyTorch reference is registered here for every quantized
numerics; the GPU kernels when :func:`load_kernels` imports them (kernels never import this layer: the
API side registers what a kernel module exposes).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Callable

import torch

from quantpatch.config import NUMERICS, AttentionConfig
from quantpatch.fallback import logger

REFERENCE_HEAD_DIMS = (32, 256)  # the range every mode supports; others fall back to SDPA


@dataclass(frozen=True)
class AttentionCall:
    """A validated call in ``(B, H, S, D)`` layout."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    config: AttentionConfig
    is_causal: bool
    scale: float | None
    attn_mask: torch.Tensor | None
    return_lse: bool


@dataclass(frozen=True)
class Implementation:
    name: str
    priority: int
    unsupported: Callable[[AttentionCall], str | None]
    run: Callable[[AttentionCall], object]


_REGISTRY: dict[str, list[Implementation]] = {n: [] for n in NUMERICS if n != "none"}


def register(numerics: str, impl: Implementation) -> None:
    """Add ``impl`` for ``numerics``; higher priority is tried first."""
    if numerics not in _REGISTRY:
        raise ValueError(f"unknown numerics {numerics!r}; valid: {sorted(_REGISTRY)}")
    _REGISTRY[numerics] = sorted([*_REGISTRY[numerics], impl], key=lambda i: -i.priority)


def implementations(numerics: str) -> list[Implementation]:
    return list(_REGISTRY[numerics])


_kernels_tried: set[str] = set()
_ON_IMPORT: dict[str, Callable[[ModuleType], None]] = {}


def on_kernels_import(module: str, register: Callable[[ModuleType], None]) -> None:
    """Have :func:`load_kernels` pass the kernel module ``module`` to ``register`` when it imports it: how an API
    module registers kernels with its own dispatch point (``quantpatch.w4a8_linear`` does at its import)."""
    _ON_IMPORT[module] = register


def load_kernels(module: str) -> None:
    """Import a GPU kernel module once (from ``patch_model``, else on the first CUDA call) and register it where it
    serves (:func:`on_kernels_import`)."""
    if module in _kernels_tried:
        return
    _kernels_tried.add(module)
    try:
        kernels = importlib.import_module(module)
    except ImportError as err:  # Triton missing or too old: the reference serves every call
        logger.warning("quantpatch GPU kernels %s unavailable (%s); using the PyTorch reference", module, err)
        return
    register = _ON_IMPORT.get(module)
    if register is not None:
        register(kernels)


FAST_PATHS_MODULE = "quantpatch.kernels.attention.fast_paths"  # the attention kernels (registered below)
W4A8_KERNELS_MODULE = "quantpatch.kernels.w4a8.w4a8_triton"  # registered by quantpatch.w4a8_linear
# TurboCache's compression and decode kernels (patches/transformers/turbo_cache.py imports them by name per call)
TURBO_KERNELS_MODULES = ("quantpatch.kernels.turbo_kv.turbo_compress_triton",
                         "quantpatch.kernels.turbo_kv.turbo_decode_triton")


def _register_attention_kernels(kernels: ModuleType) -> None:
    """The attention kernels as one implementation of every numerics family they compute."""
    impl = Implementation("triton", 10, kernels.call_unsupported, kernels.run)
    for numerics in kernels.NUMERICS:
        register(numerics, impl)


on_kernels_import(FAST_PATHS_MODULE, _register_attention_kernels)


def preload_kernels() -> None:
    """Import the GPU kernel modules now if CUDA is usable (``patch_model`` calls this).

    Otherwise the first CUDA call imports them, and when that first call runs under
    ``torch.compile`` the import happens inside the trace: a graph break, and that call is
    compiled without the kernels.
    """
    if torch.cuda.is_available():
        crossover_lookup()
        for module in (FAST_PATHS_MODULE, W4A8_KERNELS_MODULE, *TURBO_KERNELS_MODULES):
            load_kernels(module)


def select(call: AttentionCall) -> tuple[Implementation | None, list[str]]:
    """The highest-priority implementation that accepts ``call``, and why the others declined."""
    if call.q.is_cuda:
        load_kernels(FAST_PATHS_MODULE)
    declined = []
    for impl in _REGISTRY[call.config.numerics]:
        reason = impl.unsupported(call)
        if reason is None:
            return impl, declined
        declined.append(f"{impl.name}: {reason}")
    return None, declined


POLICIES = ("speed", "always")
REFERENCE = "reference"
_CROSSOVERS: dict[tuple, tuple[float, str]] = {}


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r} is not valid; choose one of {list(POLICIES)}")
    return policy


def _crossover(device_index: int, key: str, head_dim: int, is_causal: bool) -> tuple[float, str]:
    """The crossover length of (device, :func:`routing.speed_key`, head dim, causal) and the reason SDPA runs below it,
    looked up once and cached."""
    entry = _CROSSOVERS.get((device_index, key, head_dim, is_causal))
    if entry is None:
        from quantpatch import routing

        architecture = routing.arch(torch.device("cuda", device_index))
        table, source = routing.table_for(architecture)
        length = routing.table_length(table, key, head_dim, is_causal)
        kind = "causal" if is_causal else "non-causal"
        if table is None:
            why = f"no measured crossover for {architecture} (run `quantpatch tune`)"
        elif length == float("inf"):
            why = f"SDPA was faster at every measured length on {architecture} (D={head_dim}, {kind}; {source})"
        else:
            why = f"shorter than the {architecture} crossover of {length} tokens (D={head_dim}, {kind}; {source})"
        entry = _CROSSOVERS[device_index, key, head_dim, is_causal] = (length, why)
    return entry


def speed_reason(cfg: AttentionConfig, device: torch.device, head_dim: int, nq: int, nk: int,
                 is_causal: bool) -> str | None:
    """Why ``policy="speed"`` runs SDPA for this call rather than ``cfg``'s kernel (None: the kernel).

    Decided from shapes against the crossover table of the device's architecture (:mod:`quantpatch.routing`),
    looked up once per (device, numerics, head dim, causal): a call costs a dict lookup and two comparisons.
    """
    if device.type != "cuda":
        return "SDPA is faster than the PyTorch reference off the GPU"
    from quantpatch.routing import speed_key

    length, why = crossover_lookup()(device.index or 0, speed_key(cfg), head_dim, is_causal)
    return why if nq < length or nk < length else None


_TRACEABLE: list = []


def crossover_lookup():
    """The table lookup as a constant to ``torch.compile`` (``assume_constant_result``: no graph break), made on the
    first CUDA call or by :func:`preload_kernels`, not at import: the decorator imports ``torch._dynamo`` (and
    Triton), which ``import quantpatch`` must not."""
    if not _TRACEABLE:
        _TRACEABLE.append(torch.compiler.assume_constant_result(_crossover))
    return _TRACEABLE[0]


def sdpa_reason(call: AttentionCall) -> str | None:
    """Why ``policy="speed"`` runs SDPA for ``call`` (None: a kernel takes it): shorter than the crossover
    (:func:`speed_reason`), or no kernel takes it and only the PyTorch reference would (a mask, a dtype, a head dim)."""
    q, k = call.q, call.k
    why = speed_reason(call.config, q.device, q.shape[-1], q.shape[2], k.shape[2], call.is_causal)
    if why is None:
        impl, declined = select(call)
        if impl is None or impl.name == REFERENCE:
            why = f"only the PyTorch reference takes this call ({'; '.join(declined)})"
    return why


def forget_crossovers() -> None:
    """Drop the cached routing decisions (after ``quantpatch tune``, and in tests)."""
    from quantpatch import routing

    _CROSSOVERS.clear()
    routing.forget_tables()


def _reference_unsupported(call: AttentionCall) -> str | None:
    lo, hi = REFERENCE_HEAD_DIMS
    d = call.q.shape[-1]
    if not lo <= d <= hi:
        return f"head_dim {d} outside the supported range [{lo}, {hi}]"
    return None


def _reference_run(call: AttentionCall):
    from quantpatch.kernels.attention.quant_attention_ref import quant_attention_ref

    for name, t in (("q", call.q), ("k", call.k), ("v", call.v)):
        message = f"quantpatch.attention: {name} contains NaN or Inf; quantization scales would be invalid"
        if not torch.compiler.is_compiling():
            if not torch.isfinite(t).all():
                raise ValueError(message)
        elif not t.is_cuda:  # traced: no data-dependent branch (a graph break); a device-side assert on CUDA
            torch._assert_async(torch.isfinite(t).all(), message)  # would poison the context, so CPU only
    return quant_attention_ref(
        call.q,
        call.k,
        call.v,
        call.config,
        is_causal=call.is_causal,
        scale=call.scale,
        attn_mask=call.attn_mask,
        return_lse=call.return_lse,
    )


for _numerics in _REGISTRY:
    register(_numerics, Implementation(REFERENCE, 0, _reference_unsupported, _reference_run))
