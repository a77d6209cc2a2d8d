"""The one backend layer: which implementation of an op serves a call.

Every op has a registry of implementations per key (the numerics it computes): ``attention`` per
:data:`~quantpatch.config.NUMERICS` family, ``w4a8_linear`` and ``fp8_linear`` per
:data:`~quantpatch.config.LINEAR_KINDS` kind, ``turbo_compress`` and ``turbo_decode`` for the ``turbo`` KV cache.
An :class:`Implementation` has a name, a priority and ``unsupported(call)``: why it cannot take a call, or
``None``. :func:`select` returns the highest-priority one that accepts the call, with the reasons of those that
declined; :func:`run_op` runs it and reports the declines (one warning per reason, the handle's report).

A call is a small frozen dataclass (:class:`AttentionCall`, :class:`LinearCall`; ``TurboCompressCall`` and
``TurboDecodeCall`` beside the TurboCache) with the ``is_cuda`` and ``device`` of its lead tensor (:class:`OpCall`):
the first CUDA call imports the op's GPU kernel module (:data:`KERNEL_MODULES`), and every implementation runs with
the call's device current (:func:`run_on_device`). The pure-PyTorch reference of
each op registers at priority 0 (attention's here, the others where their op lives); the GPU kernels register when
:func:`load_kernels` imports them, through :func:`on_kernels_import` (kernels never import this layer).
Architecture checks are the kernels' own (:mod:`quantpatch.kernels.device`), asked in their ``unsupported``.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, ClassVar

import torch

from quantpatch import routing
from quantpatch.config import NUMERICS, AttentionConfig
from quantpatch.fallback import SiteRecord, fall_back, logger
from quantpatch.kernels import device as kernel_devices

REFERENCE_HEAD_DIMS = (32, 256)  # the range every mode supports; others fall back to SDPA
REFERENCE = "reference"  # the name of every op's pure-PyTorch implementation

# op -> the keys its implementations register under
OPS: dict[str, tuple[str, ...]] = {
    "attention": tuple(n for n in NUMERICS if n != "none"),
    "w4a8_linear": ("w4a8_fp8",),
    "fp8_linear": ("fp8",),
    "turbo_compress": ("turbo",),
    "turbo_decode": ("turbo",),
}


class OpCall:
    """What every call shares: ``is_cuda`` and ``device`` are those of its tensor field named ``LEAD``; ``GRAD_INPUTS``
    names the tensor fields a gradient may flow back to (:func:`records_grad`)."""

    LEAD: ClassVar[str]
    GRAD_INPUTS: ClassVar[tuple[str, ...]] = ()

    @property
    def is_cuda(self) -> bool:
        return getattr(self, self.LEAD).is_cuda

    @property
    def device(self) -> torch.device:
        return getattr(self, self.LEAD).device


@dataclass(frozen=True)
class AttentionCall(OpCall):
    """A validated call in ``(B, H, S, D)`` layout."""

    LEAD: ClassVar[str] = "q"
    GRAD_INPUTS: ClassVar[tuple[str, ...]] = ("q", "k", "v")

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    config: AttentionConfig
    is_causal: bool
    scale: float | None
    attn_mask: torch.Tensor | None
    return_lse: bool


@dataclass(frozen=True)
class LinearCall(OpCall):
    """``x (..., K)`` through a quantized linear ``layer`` (ops ``w4a8_linear``, ``fp8_linear``)."""

    LEAD: ClassVar[str] = "x"
    GRAD_INPUTS: ClassVar[tuple[str, ...]] = ("x",)
    x: torch.Tensor
    layer: torch.nn.Module


def check_in_features(x: torch.Tensor, layer: torch.nn.Module) -> None:
    """A ``ValueError`` naming ``layer`` (its ``what``) where ``x``'s last dim is not its ``in_features``, as
    ``nn.Linear`` refuses such an input, before any implementation reshapes it."""
    if x.shape[-1:] != (layer.in_features,):
        raise ValueError(f"{layer.what}: input of shape {tuple(x.shape)}, the layer takes {layer.in_features} input "
                         "features in its last dim")


@dataclass(frozen=True)
class Implementation:
    """One way to run an op: ``unsupported(call)`` says why it cannot take ``call`` (None: it can), ``run(call)``
    computes it. Higher ``priority`` is tried first."""

    name: str
    priority: int
    unsupported: Callable[[Any], str | None]
    run: Callable[[Any], Any]
    # plan(call): where ``run`` computes every call of ``call``'s signature by the same launches, a function that
    # does so with no checks: ``(q, k, v) -> (o, lse)`` for attention (:func:`attention_signature`), ``(layer, x) ->
    # y`` for the linear ops (:class:`LinearPlans`); None elsewhere
    plan: Callable[[Any], Callable | None] | None = None


class Quiet(str):
    """A reason an implementation declines a call without a warning: the call is not one it is meant for (another
    device's, an empty input), and the next implementation is that call's path, not a fallback."""

    __slots__ = ()


_REGISTRY: dict[str, dict[str, list[Implementation]]] = {op: {key: [] for key in keys} for op, keys in OPS.items()}
# quantpatch.attention's planned calls: a call's signature (:func:`attention_signature`) → (the implementation's
# name, the call's attention config, its plan ``(q, k, v) -> (o, lse)``), kept where the chosen implementation had a
# plan (``Implementation.plan``): a later call of the signature runs the plan, its route and checks already made
_PLANNED: dict[tuple, tuple[str, AttentionConfig, Callable]] = {}
PLANNED_SIGNATURES = 256  # kept; past it, all are dropped
_registrations = 0  # how many registrations were made: a linear layer's planned calls made before the last one go


def register(op: str, key: str, impl: Implementation) -> None:
    """Add ``impl`` for ``op`` on calls of ``key`` (replacing one of the same name); higher priority is tried first."""
    if op not in _REGISTRY:
        raise ValueError(f"unknown op {op!r}; valid: {sorted(_REGISTRY)}")
    if key not in _REGISTRY[op]:
        raise ValueError(f"unknown key {key!r} of op {op!r}; valid: {sorted(_REGISTRY[op])}")
    others = [i for i in _REGISTRY[op][key] if i.name != impl.name]
    global _registrations
    _REGISTRY[op][key] = sorted([*others, impl], key=lambda i: -i.priority)
    _PLANNED.clear()  # a planned call's implementation may no longer be the one chosen
    _registrations += 1


def implementations(op: str, key: str) -> list[Implementation]:
    """``op``'s implementations for ``key``, in the order they are tried."""
    return list(_REGISTRY[op][key])


FAST_PATHS_MODULE = "quantpatch.kernels.attention.fast_paths"  # the attention kernels (registered below)
W4A8_KERNELS_MODULE = "quantpatch.kernels.w4a8.w4a8_triton"  # registered by quantpatch.w4a8_linear
# TurboCache's compression and decode kernels (registered by patches/transformers/turbo_cache.py)
TURBO_COMPRESS_MODULE = "quantpatch.kernels.turbo_kv.turbo_compress_triton"
TURBO_DECODE_MODULE = "quantpatch.kernels.turbo_kv.turbo_decode_triton"
TURBO_KERNELS_MODULES = (TURBO_COMPRESS_MODULE, TURBO_DECODE_MODULE)
# op -> the GPU kernel module that the op's first CUDA call imports (fp8_linear's GPU path is torch._scaled_mm)
KERNEL_MODULES = {"attention": FAST_PATHS_MODULE, "w4a8_linear": W4A8_KERNELS_MODULE,
                  "turbo_compress": TURBO_COMPRESS_MODULE, "turbo_decode": TURBO_DECODE_MODULE}

_kernels_tried: set[str] = set()
_ON_IMPORT: dict[str, Callable[[ModuleType], None]] = {}


def on_kernels_import(module: str, register: Callable[[ModuleType], None]) -> None:
    """Have :func:`load_kernels` pass the kernel module ``module`` to ``register`` when it imports it (at once if it
    has): how the module of an op registers that op's kernels (``quantpatch.w4a8_linear`` does at its import)."""
    _ON_IMPORT[module] = register
    if module in _kernels_tried and module in sys.modules:
        register(sys.modules[module])


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


def _register_attention_kernels(kernels: ModuleType) -> None:
    """The attention kernels as one implementation of every numerics family they compute."""
    impl = Implementation("triton", 10, kernels.call_unsupported, kernels.run, kernels.plan)
    for numerics in kernels.NUMERICS:
        register("attention", numerics, impl)


on_kernels_import(FAST_PATHS_MODULE, _register_attention_kernels)


def preload_kernels() -> None:
    """Import the GPU kernel modules now if CUDA is usable (``patch_model`` calls this).

    Otherwise the first CUDA call imports them, and when that first call runs under
    ``torch.compile`` the import happens inside the trace: a graph break, and that call is
    compiled without the kernels.
    """
    if torch.cuda.is_available():
        crossover_lookup()
        for module in KERNEL_MODULES.values():
            load_kernels(module)


def records_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd would record an op on ``tensors``: grad mode on and one of them requiring a gradient. No
    kernel of quantpatch has a backward: such a call takes the op's PyTorch reference (or, routed by speed, SDPA),
    never a kernel whose output would silently carry no gradient."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _choose(op: str, key: str, call: Any) -> tuple[Implementation | None, list[tuple[str, str]]]:
    """The highest-priority implementation that accepts ``call``, and ``(name, reason)`` of those that declined; only
    the reference takes a call with a gradient to record (:func:`records_grad`)."""
    module = KERNEL_MODULES.get(op)
    if module is not None and call.is_cuda:
        load_kernels(module)
    grad = records_grad(*(getattr(call, name) for name in getattr(call, "GRAD_INPUTS", ())))
    declined = []
    for impl in _REGISTRY[op][key]:
        reason = impl.unsupported(call)
        if reason is None and grad and impl.name != REFERENCE:
            reason = "a gradient to record (the kernel has no backward)"
        if reason is None:
            return impl, declined
        declined.append((impl.name, reason))
    return None, declined


def plan_epoch() -> tuple[int, int]:
    """What changes whenever a kept plan may stop being the route its calls would take: the registrations made and the
    Gluon gates closed in this process (another implementation or kernel may now serve them)."""
    return _registrations, kernel_devices.gate_closures


def select(op: str, key: str, call: Any) -> tuple[Implementation | None, list[str]]:
    """The highest-priority implementation of ``op`` for ``key`` that accepts ``call``, and why the others declined
    (``"name: reason"``)."""
    impl, declined = _choose(op, key, call)
    return impl, [f"{name}: {reason}" for name, reason in declined]


def run_on_device(impl: Implementation, call: Any) -> Any:
    """``impl.run(call)`` with the call's CUDA device current.

    Triton and Gluon launch on the current device (and its current stream), not on their tensors' one: a layer that
    accelerate's ``device_map`` put on ``cuda:1`` runs while ``cuda:0`` is current. The guard is entered only when
    the devices differ (a device index compared per call); a ``torch.compile`` graph sets its own device guard.
    """
    device = call.device
    if device.type != "cuda" or device.index is None or torch.compiler.is_compiling():
        return impl.run(call)
    if device.index == torch.cuda.current_device():
        return impl.run(call)
    with torch.cuda.device(device):
        return impl.run(call)


def run_op(op: str, key: str, call: Any, *, what: str, record: SiteRecord | None = None,
           plans: LinearPlans | None = None) -> Any:
    """Run ``call`` on the implementation :func:`select` picks.

    The reasons of the implementations that declined it before (but :class:`Quiet` ones) are a fallback of ``what``:
    one warning per reason, recorded on the running site (``fall_back``) and on ``record``. ``record`` also counts
    the call under the implementation's name (its ``routes``). ``plans`` (a linear call's layer's): where no
    implementation declined it loudly, the chosen one's plan of the call (``Implementation.plan``) is kept there.
    """
    impl, declined = _choose(op, key, call)
    if impl is None:
        raise ValueError(f"{what}: no implementation takes this call ({'; '.join(r for _, r in declined)})")
    loud = [reason for _, reason in declined if not isinstance(reason, Quiet)]
    if loud:
        reason = "; ".join(dict.fromkeys(loud))
        fall_back(what, reason, strict=False,
                  to="the PyTorch reference" if impl.name == REFERENCE else f"the {impl.name} implementation")
        if record is not None:
            record.fallbacks.add(reason)
    out = run_on_device(impl, call)
    if record is not None:
        record.count(impl.name)
    if plans is not None and not loud and impl.plan is not None and plans.may_serve(call.x):
        plan = impl.plan(call)
        if plan is not None:
            plans.keep(call.x, impl.name, plan)
    return out


def rows_view(x: torch.Tensor, k: int) -> torch.Tensor | None:
    """``x (..., K)`` as ``(M, K)`` rows with a contiguous last dim, a view of ``x`` (no copy), or None where there is
    none: what a linear op's plan reads (``x.view(-1, K)`` then works for every input of ``x``'s signature)."""
    rows = x.reshape(-1, k)
    return rows if rows.stride(-1) == 1 and rows.data_ptr() == x.data_ptr() else None


def linear_signature(x: torch.Tensor) -> tuple:
    """What a linear layer's call is decided by, besides the layer: ``x``'s shape, strides, dtype, device and 16-byte
    alignment."""
    return x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % 16


class LinearPlans:
    """A quantized linear layer's planned calls (:class:`PlannedLinear`): :func:`linear_signature` of an input → the
    route its calls take and a function ``(layer, x) -> y`` that runs it with no checks (``Implementation.plan``, or
    the layer's own route by policy). A later call of the signature runs that function and is counted on the
    layer's site: no dispatch, no checks. The layer clears them whenever it may change (an attribute set, ``.to()``
    or a cast); a registration or a closed Gluon gate (``kernels.device.GluonGate.close``) since drops them all;
    copies of the layer start with none."""

    __slots__ = ("entries", "epoch")

    def __init__(self) -> None:
        self.entries: dict[tuple, tuple[str, Callable]] = {}
        self.epoch = plan_epoch()

    def __deepcopy__(self, memo: dict) -> LinearPlans:
        return LinearPlans()

    def __reduce__(self) -> tuple:
        return LinearPlans, ()

    def clear(self) -> None:
        self.entries.clear()

    def _drop_stale(self) -> None:
        """Drop the plans if a registration was made or a Gluon gate closed since they were (another implementation
        or kernel may now serve their calls)."""
        if self.epoch != plan_epoch():
            self.entries.clear()
            self.epoch = plan_epoch()

    def run(self, layer: torch.nn.Module, x: torch.Tensor, record: SiteRecord | None) -> torch.Tensor | None:
        """``layer``'s output on ``x`` by the planned call of ``x``'s signature, counted on ``record``; None where
        there is none, or where a planned call may not serve ``x`` (:meth:`may_serve`; another CUDA device
        current)."""
        if not (self.entries and self.may_serve(x)):
            return None
        self._drop_stale()
        entry = self.entries.get(linear_signature(x))
        if entry is None or (x.is_cuda and x.device.index != torch.cuda.current_device()):
            return None
        route, plan = entry
        y = plan(layer, x)
        if record is not None:
            record.count(route)
        return y

    @staticmethod
    def may_serve(x: torch.Tensor) -> bool:
        """Whether a planned call may serve ``x``: a plain tensor (no subclass), no gradient to record, no
        ``torch.compile`` trace."""
        return (type(x) is torch.Tensor and not (x.requires_grad and torch.is_grad_enabled())
                and not torch.compiler.is_compiling())

    def keep(self, x: torch.Tensor, route: str, plan: Callable) -> None:
        """Keep ``plan``, a function ``(layer, x) -> y``, as the route ``route`` of ``x``'s signature (for an ``x``
        that :meth:`may_serve`)."""
        self._drop_stale()
        if len(self.entries) >= PLANNED_SIGNATURES:
            self.entries.clear()
        self.entries[linear_signature(x)] = (route, plan)


class PlannedLinear(torch.nn.Module):
    """Base of the quantized linear layers: their :class:`LinearPlans` (``plans``), cleared on every attribute set
    (buffers assigned, ``load_state_dict(assign=True)``, ``activation``, ...) and by ``.to()`` and casts (``_apply``),
    so that a planned call never outlives what it was planned from."""

    def __init__(self) -> None:
        super().__init__()
        self.plans = LinearPlans()

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        plans = self.__dict__.get("plans")
        if plans is not None:
            plans.clear()

    def _apply(self, fn, recurse=True):
        self.plans.clear()
        return super()._apply(fn, recurse)


POLICIES = ("speed", "always")
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
        architecture = routing.arch(torch.device("cuda", device_index))
        table, source = routing.table_for(architecture)
        length = routing.table_length(table, key, head_dim, is_causal)
        kind = "causal" if is_causal else "non-causal"
        if table is None:
            why = f"no measured crossover for {architecture} (run `quantpatch tune`)"
        elif routing.entry_key(key, head_dim, is_causal) not in table:
            why = f"not measured on {architecture} (D={head_dim}, {kind}; {source})"
        elif length == float("inf"):
            why = (f"no crossover on {architecture}: SDPA as fast or faster at the longest length measured "
                   f"(D={head_dim}, {kind}; {source})")
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
    if not cfg.quantized:
        return "the mode leaves attention unquantized"
    if device.type != "cuda":
        return "SDPA is faster than the PyTorch reference off the GPU"
    length, why = crossover_lookup()(device.index or 0, routing.speed_key(cfg), head_dim, is_causal)
    return why if nq < length or nk < length else None


_TRACEABLE: list = []


def crossover_lookup():
    """The table lookup as a constant to ``torch.compile`` (``assume_constant_result``: no graph break), made on the
    first CUDA call or by :func:`preload_kernels`, not at import: the decorator imports ``torch._dynamo`` (and
    Triton), which ``import quantpatch`` must not."""
    if not _TRACEABLE:
        _TRACEABLE.append(torch.compiler.assume_constant_result(_crossover))
    return _TRACEABLE[0]


def speed_route(call: AttentionCall, lengths: tuple[int, int] | None = None
                ) -> tuple[Implementation | None, list[str], str | None]:
    """``policy="speed"``'s choice for ``call``: ``(implementation, declined, None)`` where a kernel takes it, or
    ``(None, declined, why)`` where SDPA runs instead: shorter than the crossover (:func:`speed_reason`), or no kernel
    takes it and only the PyTorch reference would (a mask, a dtype, a head dim).

    ``lengths``: the ``(Nq, Nk)`` the attention will run at where they are not the call's (context parallelism:
    Ulysses attends over the whole sequence after its all-to-all)."""
    q, k = call.q, call.k
    nq, nk = lengths or (q.shape[2], k.shape[2])
    why = speed_reason(call.config, q.device, q.shape[-1], nq, nk, call.is_causal)
    if why is not None:
        return None, [], why
    impl, declined = select("attention", call.config.numerics, call)
    if impl is None or impl.name == REFERENCE:
        return None, declined, f"only the PyTorch reference takes this call ({'; '.join(declined)})"
    return impl, declined, None


def attention_signature(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mode: Any, is_causal: bool,
                        scale: float | None, policy: str) -> tuple:
    """What a ``quantpatch.attention`` call with no mask and no LSE is decided by, from its inputs as BHSD views: their
    shapes, strides, dtypes, devices and 16-byte alignment (what the kernels specialize on), the mode as given,
    causality, scale and policy."""
    return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype, q.device,
            k.device, v.device, q.data_ptr() % 16, k.data_ptr() % 16, v.data_ptr() % 16, mode, is_causal, scale,
            policy)


def planned_attention(signature: tuple) -> tuple[str, AttentionConfig, Callable] | None:
    """The planned call of ``signature`` (None: none kept)."""
    return _PLANNED.get(signature)


def plan_attention(signature: tuple, impl: Implementation, call: AttentionCall) -> None:
    """Keep ``impl``'s plan for ``call`` (which ``impl`` just ran, chosen with no implementation declining it) under
    ``signature``, where it has one."""
    plan = None if impl.plan is None else impl.plan(call)
    if plan is not None:
        if len(_PLANNED) >= PLANNED_SIGNATURES:
            _PLANNED.clear()
        _PLANNED[signature] = (impl.name, call.config, plan)


def forget_crossovers() -> None:
    """Drop the cached routing decisions and the planned calls they made (after ``quantpatch tune``, and in
    tests)."""
    _CROSSOVERS.clear()
    _PLANNED.clear()
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


for _numerics in OPS["attention"]:
    register("attention", _numerics, Implementation(REFERENCE, 0, _reference_unsupported, _reference_run))
