"""Gluon names that differ between the Triton we run on the GPU (3.6) and later ones (3.7+); the Gluon kernels
import these instead of either spelling."""

from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import tma

# the CTA (or warp-specialized partition) barrier: gl.thread_barrier in 3.6, gl.barrier from 3.7 on (a bar.sync)
cta_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
# the TMA load: tma.async_copy_global_to_shared in 3.6, tma.async_load from 3.7 on
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
# cp.async global → shared: async_copy.async_copy_global_to_shared in 3.6, async_copy.async_load later
async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
