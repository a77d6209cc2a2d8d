"""Tiny models built from config with random weights, for tests and offline smoke runs of the eval scripts.

Nothing here is imported by ``import quantpatch``; each builder imports Diffusers/Transformers lazily.
"""
