"""TurboAttention's KV cache: progressive INT8 → INT4/INT2 compression and decode attention over the compressed
cache (PyTorch reference, Triton and Gluon kernels)."""
