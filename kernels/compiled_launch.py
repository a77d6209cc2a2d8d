"""Launching a kernel Triton has already compiled without ``JITFunction.run``'s per-call work (argument binding,
specialization, cache lookup: ~80 µs of host time a call for a Gluon kernel on the H200's host, 25–60 µs a launch
for the prefill path's kernels, depending on the host), for kernels whose GPU time is a few µs to a few hundred
µs: decode steps, and prefill at 1k tokens, where four launches of host work outlast the GPU's.

A caller keeps the ``CompiledKernel`` that a first ``kernel[grid](...)`` returned, keyed by everything Triton
specializes it on (:func:`specialization` of the runtime arguments, the constexprs and the launch options), and
passes later calls with the same key to :func:`relaunch`; :class:`LaunchPlans` does both for one kernel.
:func:`relaunch` calls the launcher's C function itself where Triton's launcher has the form it knows
(:class:`DirectLaunch`): each TMA descriptor filled once per address, not on every call, and Triton's empty launch
hooks not called. :func:`current_stream` and :func:`stream_key` name the stream a launch goes to. :func:`cdiv` and
:func:`next_pow2` are the launchers' host integer arithmetic: ``triton.cdiv`` and
``triton.next_power_of_2`` are ``ConstexprFunction`` calls, a few µs each on the host, which a decode step's
launcher pays on every call.
"""

from __future__ import annotations

import inspect
import os

import torch
from triton import knobs
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend

# Read once, at import: Triton itself reads TRITON_INTERPRET when a ``@triton.jit`` kernel is defined, so a later
# change of the variable changes neither (and a launcher does not pay an environment lookup per call).
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreting() -> bool:
    """True under the Triton CPU interpreter (``TRITON_INTERPRET=1`` when this module was imported)."""
    return _INTERPRETING


def specialization(args: tuple) -> tuple:
    """What ``JITFunction.run`` specializes a kernel on for these runtime (non-constexpr) arguments: each one's type
    and 16-byte divisibility / alignment, and ints equal to 1 (which become constants)."""
    return tuple([native_specialize_impl(BaseBackend, a, False, True, True) for a in args])


def cdiv(a: int, b: int) -> int:
    """``⌈a / b⌉`` of host ints (``b > 0``)."""
    return -(-a // b)


def next_pow2(x: int) -> int:
    """The smallest power of two ≥ ``x`` (1 for ``x ≤ 1``), of a host int."""
    return 1 << max(x - 1, 0).bit_length()


def current_stream(device: int) -> int:
    """The raw handle of ``device``'s current CUDA stream (what a launcher takes)."""
    return torch._C._cuda_getCurrentRawStream(device)


def stream_key(device: torch.device) -> tuple:
    """``(device, raw handle of its current stream)``, the key of per-stream scratch memory (launches on one stream
    run one after the other and may share it; on two they may overlap and must not); stream 0 for CPU tensors (the
    interpreter)."""
    return (device, current_stream(device.index) if device.type == "cuda" else 0)


class DevicePointer(int):
    """A device address passed where a kernel takes a pointer: Triton's launcher reads an int as the address itself
    (no ``data_ptr()`` call, no driver query), and a TMA descriptor reads it through :meth:`data_ptr`. Only a
    launch plan made with tensors of the same specialization may take it (:class:`LaunchPlans` raises otherwise)."""

    __slots__ = ()

    def data_ptr(self) -> int:
        return int(self)


def _active(hooks):
    """A launch hook as the launcher takes it: None for Triton's hook chain with no hook in it (the launcher then calls
    nothing, and no launch metadata is made for it)."""
    return None if hooks is None or getattr(hooks, "calls", True) == [] else hooks


class DirectLaunch:
    """The C launch function of one compiled kernel, called without Triton's Python launcher around it (Triton 3.5 /
    3.6's ``CudaLauncher``: its scratch allocations, which this kernel has none of, and its per-call argument walk).
    A TMA descriptor argument is expanded as Triton's wrapper expands it (``make_tensordesc_arg``) once per base
    address, shape and strides, and kept (:data:`DESCRIPTORS_KEPT` a kernel): the same 128 bytes that the wrapper
    fills on every call (7 µs of host time for the sm90 attention kernel's three; with the rest of the Python
    launcher, its call's three launches took 56 µs through Triton's launcher and 38 µs direct, on one H200 host).

    :meth:`of` gives None where the launcher is not of that form (another Triton version, a kernel with scratch
    memory or a cooperative / PDL launch); :func:`relaunch` then calls Triton's launcher."""

    DESCRIPTORS_KEPT = 64  # expansions kept per kernel; past it, all are dropped (one call's are made again)

    def __init__(self, kernel, c_launch, descriptor_meta: dict[int, object], expand):
        self.kernel, self.c_launch, self.descriptor_meta, self.expand = kernel, c_launch, descriptor_meta, expand
        self._expanded: dict[tuple, list] = {}

    @classmethod
    def of(cls, kernel) -> DirectLaunch | None:
        """The direct launch of ``kernel`` (a ``CompiledKernel``), or None where its launcher is not of the known
        form."""
        run = kernel.run
        try:
            from triton.backends.nvidia import driver
        except ImportError:
            return None
        expand = getattr(driver, "make_tensordesc_arg", None)
        if (type(run) is not getattr(driver, "CudaLauncher", None) or getattr(driver, "_BASE_ARGS_FORMAT", None)
                != "iiiKKppOOOOOO" or expand is None or len(inspect.signature(expand).parameters) != 2
                or list(inspect.signature(type(run).__call__).parameters)
                != ["self", "gridX", "gridY", "gridZ", "stream", "function", "args"]
                or run.global_scratch_size or run.profile_scratch_size or run.launch_cooperative_grid
                or run.launch_pdl):
            return None
        launch = run.launch
        if getattr(launch, "__closure__", None) is None:  # no descriptor argument: the C function itself
            return cls(kernel, launch, {}, expand)
        names = inspect.getclosurevars(launch).nonlocals
        if not {"launcher", "tensordesc_indices", "tensordesc_meta"} <= names.keys():
            return None
        indices = sorted(names["tensordesc_indices"])
        return cls(kernel, names["launcher"], dict(zip(indices, names["tensordesc_meta"])), expand)

    def _descriptor(self, i: int, desc) -> list:
        key = (i, desc.base.data_ptr(), *desc.shape, *desc.strides, desc.padding)
        expanded = self._expanded.get(key)
        if expanded is None:
            if len(self._expanded) >= self.DESCRIPTORS_KEPT:
                self._expanded.clear()
            expanded = self._expanded[key] = self.expand(desc, self.descriptor_meta[i])
        return expanded

    def __call__(self, grid: tuple[int, int, int], stream: int, args: tuple, enter, exit_) -> None:
        """As ``kernel.run``: ``args`` every kernel parameter (descriptors as ``TensorDescriptor`` s); ``enter`` and
        ``exit_`` the launch hooks, or None."""
        kernel = self.kernel
        meta = None if enter is None else kernel.launch_metadata(grid, stream, *args)
        if self.descriptor_meta:
            args = list(args)
            for i in reversed(self.descriptor_meta):  # from the last, so that earlier positions stay put
                args[i:i + 1] = self._descriptor(i, args[i])
        self.c_launch(*grid, stream, kernel.function, False, False, None, None, kernel.packed_metadata, meta, enter,
                      exit_, *args)


_DIRECT: dict[object, DirectLaunch | None] = {}  # by compiled kernel (a few tens a process: one a launch plan)


def _direct_launch(kernel) -> DirectLaunch | None:
    """:meth:`DirectLaunch.of` ``kernel``, made once per compiled kernel."""
    try:
        return _DIRECT[kernel]
    except KeyError:
        direct = _DIRECT[kernel] = DirectLaunch.of(kernel)
        return direct


def _launch(kernel, direct: DirectLaunch | None, grid: tuple[int, int, int], stream: int, args: tuple) -> None:
    """``kernel`` through ``direct`` where it applies, else Triton's launcher; Triton's launch hooks (profilers) run
    when any is set."""
    enter, exit_ = _active(knobs.runtime.launch_enter_hook), _active(knobs.runtime.launch_exit_hook)
    if direct is not None:
        direct(grid, stream, args, enter, exit_)
        return
    meta = None if enter is None else kernel.launch_metadata(grid, stream, *args)
    kernel.run(*grid, stream, kernel.function, kernel.packed_metadata, meta, enter, exit_, *args)


def relaunch(kernel, grid: tuple[int, int, int], stream: int, args: tuple) -> None:
    """Launch the compiled ``kernel`` on ``grid`` and ``stream`` with ``args``: every kernel parameter in signature
    order, constexprs included (the launcher skips them), through :class:`DirectLaunch` where it applies, else
    Triton's launcher."""
    _launch(kernel, _direct_launch(kernel), grid, stream, args)


class BoundLaunch:
    """One launch plan's compiled kernel on one grid, with its constexprs (:meth:`LaunchPlans.bound`): a call takes
    only the runtime arguments and the stream, no plan key is made or looked up. It keeps its kernel launchable
    after :meth:`LaunchPlans.clear` (the kernel it names is the one the plan had)."""

    __slots__ = ("kernel", "direct", "grid", "consts")

    def __init__(self, kernel, grid: tuple[int, ...], consts: tuple):
        self.kernel, self.direct = kernel, _direct_launch(kernel)
        self.grid, self.consts = tuple(grid) + (1,) * (3 - len(grid)), consts

    def __call__(self, stream: int, args: tuple) -> None:
        """Launch on ``stream`` (a raw handle, :func:`current_stream`) with the runtime ``args`` of the plan's
        specialization (tensors or :class:`DevicePointer` s)."""
        _launch(self.kernel, self.direct, self.grid, stream, args + self.consts)


def _no_addresses(kernel, args: tuple) -> None:
    """``LookupError`` where ``args`` hold a :class:`DevicePointer` but no launch plan takes them: Triton (or its
    interpreter) would read the address as an integer argument."""
    if any(type(a) is DevicePointer for a in args):
        raise LookupError(f"{kernel.__name__}: no launch plan for this key; addresses need one made with tensors "
                          "first")


class LaunchPlans:
    """Launch plans of one ``@triton.jit`` / ``@gluon.jit`` kernel: for each (device, constexprs, launch options,
    :func:`specialization` of the runtime arguments) the ``CompiledKernel`` that ``JITFunction.run`` picked on the
    first call with that key; later calls go to its launcher (:func:`relaunch`). Under the interpreter every call
    goes through ``kernel[grid]``."""

    def __init__(self, kernel):
        self.kernel = kernel
        self._plans: dict[tuple, object] = {}

    def __len__(self) -> int:
        return len(self._plans)

    def clear(self) -> None:
        """Drop every plan (and their kernels' direct launches): the next call of each key compiles again."""
        for compiled in self._plans.values():
            _DIRECT.pop(compiled, None)
        self._plans.clear()

    def __call__(self, grid: tuple[int, ...], args: tuple, constexprs: dict, *, plan_key: tuple | None = None,
                 device: int | None = None, **options) -> None:
        """Launch on ``grid`` (1 to 3 dims) and the current stream of ``args[0]``'s device. ``args``: the kernel's
        runtime parameters, in signature order, first a tensor; ``constexprs``: the parameters after them, by name
        in signature order (checked on a plan's first launch); ``options``: ``num_warps``, ``num_stages``, ...

        ``plan_key`` stands in for :func:`specialization` of ``args`` (one tuple hashed, not every argument
        inspected) where the caller knows it determines that: the shapes, strides, dtypes and 16-byte alignment of
        the caller's input tensors and whatever else its int arguments derive from, every other tensor argument
        allocated by the caller in the same way for the same key (the CUDA caching allocator aligns each allocation
        to 512 bytes, so their alignment follows from the key too). ``device``: the CUDA device index, where
        ``args[0]`` is a :class:`DevicePointer`; a call with one finds its plan made, or raises ``LookupError``
        (Triton would compile the address as an integer argument)."""
        if _INTERPRETING:
            _no_addresses(self.kernel, args)
            self.kernel[grid](*args, **constexprs, **options)
            return
        if device is None:
            device = args[0].device.index
        consts = tuple(constexprs.values())
        key = (device, consts, tuple(options.items()), specialization(args) if plan_key is None else plan_key)
        compiled = self._plans.get(key)
        if compiled is not None:
            relaunch(compiled, tuple(grid) + (1,) * (3 - len(grid)), current_stream(device), args + consts)
            return
        _no_addresses(self.kernel, args)
        if list(constexprs) != self.kernel.arg_names[len(args):]:
            raise ValueError(f"{self.kernel.__name__}: constexprs {list(constexprs)} are not the parameters after the "
                             f"{len(args)} runtime ones, {self.kernel.arg_names[len(args):]}")
        self._plans[key] = self.kernel[grid](*args, **constexprs, **options)

    def bound(self, grid: tuple[int, ...], constexprs: dict, *, plan_key: tuple, device: int,
              **options) -> BoundLaunch | None:
        """The plan of ``(device, constexprs, options, plan_key)`` as a :class:`BoundLaunch` on ``grid``, for a caller
        that launches one signature many times; None where no launch made that plan (or under the interpreter)."""
        if _INTERPRETING:
            return None
        consts = tuple(constexprs.values())
        compiled = self._plans.get((device, consts, tuple(options.items()), plan_key))
        return None if compiled is None else BoundLaunch(compiled, grid, consts)
