"""quantpatch.patches: per-library, per-model-family patchers (Transformers, Diffusers)."""
