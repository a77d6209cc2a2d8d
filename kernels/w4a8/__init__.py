"""FireQ's W4A8-FP linear: INT4 weights with FP8 group scales times FP8 activations (PyTorch reference, Triton
and Gluon GEMMs, the activation quantization)."""
