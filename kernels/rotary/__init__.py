"""Rotary position embedding of queries and keys, in the forms Wan2.1, Diffusers and Transformers use (PyTorch
reference, one Triton launch)."""
