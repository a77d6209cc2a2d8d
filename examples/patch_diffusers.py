"""Patch a Diffusers transformer (a tiny Wan built from config here) and compare with full precision.

With a real pipeline: ``quantpatch.patch_model(pipe, "sage2-8b")`` finds ``pipe.transformer``
and leaves the VAE and text encoders alone.

    python examples/patch_diffusers.py
"""

import torch
from diffusers import WanTransformer3DModel

import quantpatch

torch.manual_seed(0)
model = WanTransformer3DModel(
    patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=64, in_channels=4, out_channels=4,
    text_dim=16, freq_dim=32, ffn_dim=128, num_layers=2, cross_attn_norm=True, rope_max_seq_len=32,
).eval()
latents, timestep, text = torch.randn(1, 4, 3, 16, 16), torch.tensor([500]), torch.randn(1, 7, 16)
with torch.no_grad():
    reference = model(latents, timestep, text, return_dict=False)[0]
    with quantpatch.patch_model(model, "sage2-8b") as handle:
        out = model(latents, timestep, text, return_dict=False)[0]
print(handle.report())
print(f"CosSim vs full precision: {quantpatch.cos_sim(out, reference):.6f}")
