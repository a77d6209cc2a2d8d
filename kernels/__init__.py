"""quantpatch.kernels: Triton kernels and their pure-PyTorch references.

Importing this package never imports Triton or initialises CUDA; the Triton modules load
lazily when a fast path is first used.
"""
