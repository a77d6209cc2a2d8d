"""Launching a kernel Triton has already compiled without ``JITFunction.run``'s per-call work (argument binding,
specialization, cache lookup: ~80 µs of host time a call for a Gluon kernel on the H200's host), for decode-step
kernels whose GPU time is a few µs to a few tens of µs.

A caller keeps the ``CompiledKernel`` that a first ``kernel[grid](...)`` returned, keyed by everything Triton
specializes it on (:func:`specialization` of the runtime arguments, the constexprs and the launch options), and
passes later calls with the same key to :func:`relaunch`. :func:`cdiv` and :func:`next_pow2` are the launchers'
host integer arithmetic: ``triton.cdiv`` and ``triton.next_power_of_2`` are ``ConstexprFunction`` calls, a few µs
each on the host, which a decode step's launcher pays on every call.
"""

from __future__ import annotations

from triton import knobs
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend


def specialization(args: tuple) -> tuple:
    """What ``JITFunction.run`` specializes a kernel on for these runtime (non-constexpr) arguments: each one's type
    and 16-byte divisibility / alignment, and ints equal to 1 (which become constants)."""
    return tuple(native_specialize_impl(BaseBackend, a, False, True, True) for a in args)


def cdiv(a: int, b: int) -> int:
    """``⌈a / b⌉`` of host ints (``b > 0``)."""
    return -(-a // b)


def next_pow2(x: int) -> int:
    """The smallest power of two ≥ ``x`` (1 for ``x ≤ 1``), of a host int."""
    return 1 << max(x - 1, 0).bit_length()


def relaunch(kernel, grid: tuple[int, int, int], stream: int, args: tuple) -> None:
    """Launch the compiled ``kernel`` on ``grid`` and ``stream`` with ``args``: every kernel parameter in signature
    order, constexprs included (the launcher skips them). Triton's launch hooks (profilers) still run."""
    enter = knobs.runtime.launch_enter_hook
    meta = None if enter is None else kernel.launch_metadata(grid, stream, *args)
    kernel.run(*grid, stream, kernel.function, kernel.packed_metadata, meta, enter, knobs.runtime.launch_exit_hook,
               *args)
