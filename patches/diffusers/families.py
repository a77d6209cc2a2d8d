"""The one table of Diffusers transformers quantpatch patches.

Each maps a transformer class to how its processors reach attention: ``dispatch`` (the
processor module's ``dispatch_attention_fn``, ``(B, S, H, D)``) or ``sdpa``
(``torch.nn.functional.scaled_dot_product_attention``, ``(B, H, S, D)``).
"""

FAMILIES: dict[str, str] = {
    "CogVideoXTransformer3DModel": "sdpa",
    "HunyuanVideoTransformer3DModel": "dispatch",
    "WanTransformer3DModel": "dispatch",
    "MochiTransformer3DModel": "sdpa",
    "LTXVideoTransformer3DModel": "dispatch",
    "FluxTransformer2DModel": "dispatch",
    "SD3Transformer2DModel": "sdpa",
}
