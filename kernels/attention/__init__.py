"""Quantized attention: the PyTorch references of every mode's numerics (exact, blocked, SAS), the Triton
quantization pass and attention kernel, the sm_90 Gluon kernels, and the custom ops that route calls to them
(``fast_paths``)."""
