"""Adaptive layer norm of diffusion transformer blocks (the normalize-and-modulate and the gated residual around
each attention and feed-forward): PyTorch references and one Triton launch each."""
