"""The FP8 linear: e4m3 weights per output channel times per-token e4m3 activations (PyTorch reference, the Triton
activation quantization)."""
