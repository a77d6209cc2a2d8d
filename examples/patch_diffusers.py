"""Patch a Diffusers transformer and compare one denoising step with full precision.

    python examples/patch_diffusers.py [WAN_PIPELINE_DIR]

Without an argument a tiny Wan transformer with random weights is built from a config (nothing is
downloaded); with one, the pipeline's ``transformer`` subfolder is loaded. With a whole pipeline,
``quantpatch.patch_model(pipe, "sage2-8b")`` finds ``pipe.transformer`` and leaves the VAE and text encoders alone.
"""

import sys

import torch
from diffusers import WanTransformer3DModel

import quantpatch

# policy="speed" (the default) runs the quantized kernel only where it beats SDPA on this GPU, so on the CPU every
# call would run SDPA; there the example asks for the mode's numerics (the PyTorch reference) to show its accuracy
POLICY = "speed" if torch.cuda.is_available() else "always"

torch.manual_seed(0)
if len(sys.argv) > 1:
    model = WanTransformer3DModel.from_pretrained(sys.argv[1], subfolder="transformer").eval()
else:
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=64, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=32, ffn_dim=128, num_layers=2, cross_attn_norm=True, rope_max_seq_len=32,
    ).eval()
cfg = model.config
dtype = next(model.parameters()).dtype
latents = torch.randn(1, cfg.in_channels, 3, 16, 16, dtype=dtype)  # (B, C, frames, height, width) in latent space
timestep, text = torch.tensor([500]), torch.randn(1, 7, cfg.text_dim, dtype=dtype)
with torch.no_grad():
    reference = model(latents, timestep, text, return_dict=False)[0]
    with quantpatch.patch_model(model, "sage2-8b", policy=POLICY) as handle:
        out = model(latents, timestep, text, return_dict=False)[0]
print(handle.report())
print(f"CosSim vs full precision: {quantpatch.cos_sim(out, reference):.6f}")
