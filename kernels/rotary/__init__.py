"""Rotary position embedding over interleaved channel pairs, as Wan2.1 applies it to its queries and keys (PyTorch
reference, one Triton launch)."""
