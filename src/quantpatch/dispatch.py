"""The one place that picks an attention implementation for a call.

Implementations register per numerics family with a priority and an ``unsupported`` check
(returns why it cannot take a call, or ``None``). :func:`select` returns the best that
accepts the call, plus the reasons of those that declined; the caller falls back to SDPA
when none accepts. The pure-PyTorch reference is registered here for every quantized
numerics; GPU kernels register themselves from ``quantpatch.kernels`` when CUDA is usable.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
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


def load_kernels(module: str) -> None:
    """Import a GPU kernel module once (on the first CUDA call): it registers itself where it serves."""
    if module in _kernels_tried:
        return
    _kernels_tried.add(module)
    try:
        importlib.import_module(module)
    except ImportError as err:  # Triton missing or too old: the reference serves every call
        logger.warning("quantpatch GPU kernels %s unavailable (%s); using the PyTorch reference", module, err)


def cuda_unsupported(t: torch.Tensor, min_capability: tuple[int, int], needs: str) -> str | None:
    """Why ``t``'s device cannot run a kernel whose ``needs`` ask for ``min_capability`` (None if it can)."""
    if not t.is_cuda:
        return "inputs are not CUDA tensors"
    if torch.version.hip is not None:
        return "ROCm is not supported by these kernels"
    cap = torch.cuda.get_device_capability(t.device)
    if cap < min_capability:
        return f"{needs} need compute capability >= {min_capability[0]}.{min_capability[1]}, got {cap[0]}.{cap[1]}"
    return None


FAST_PATHS_MODULE = "quantpatch.kernels.fast_paths"  # the attention kernels: they register themselves here
W4A8_KERNELS_MODULE = "quantpatch.kernels.w4a8_triton"  # registers with quantpatch.w4a8_linear
# TurboCache's compression and decode kernels (patches/transformers/turbo_cache.py imports them by name per call)
TURBO_KERNELS_MODULES = ("quantpatch.kernels.turbo_compress_triton", "quantpatch.kernels.turbo_decode_triton")


def preload_kernels() -> None:
    """Import the GPU kernel modules now if CUDA is usable (``patch_model`` calls this).

    Otherwise the first CUDA call imports them, and when that first call runs under
    ``torch.compile`` the import happens inside the trace: a graph break, and that call is
    compiled without the kernels.
    """
    if torch.cuda.is_available():
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


@torch.compiler.assume_constant_result  # a table lookup: a constant to torch.compile, no graph break
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

    length, why = _crossover(device.index or 0, speed_key(cfg), head_dim, is_causal)
    return why if nq < length or nk < length else None


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
    from quantpatch.kernels.quant_attention_ref import quant_attention_ref

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
