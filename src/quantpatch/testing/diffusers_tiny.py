"""Tiny Diffusers transformers of every patched family, built from config (CPU, float32, head_dim 32).

Each builder returns ``(model, call)``: ``call()`` runs one forward on fixed inputs and returns
the output tensor. Head dim 32 is the smallest quantpatch's quantized paths take, so the
attention really runs quantized; 2 heads and 1-2 layers keep each forward in milliseconds.
:func:`tiny_wan_pipeline` puts the tiny Wan transformer into a whole video pipeline.
"""

from __future__ import annotations

from typing import Callable

import torch

HEADS, HEAD_DIM = 2, 32
INNER = HEADS * HEAD_DIM


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _forward(model: torch.nn.Module, **inputs) -> Callable[[], torch.Tensor]:
    def call() -> torch.Tensor:
        with torch.no_grad():
            return model(**inputs, return_dict=False)[0]

    return call


def cogvideox():
    from diffusers import CogVideoXTransformer3DModel

    model = CogVideoXTransformer3DModel(
        num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, in_channels=4, out_channels=4, time_embed_dim=8,
        text_embed_dim=16, num_layers=2, sample_width=8, sample_height=8, sample_frames=9, patch_size=2,
        temporal_compression_ratio=4, max_text_seq_length=8,
    )
    # (B, F, C, H, W) latents: 3 latent frames of 4x4 patches = 48 video tokens + 8 text tokens
    return model, _forward(model, hidden_states=_randn(1, 3, 4, 8, 8, seed=1),
                           encoder_hidden_states=_randn(1, 8, 16, seed=2), timestep=torch.tensor([500]))


def hunyuan_video():
    from diffusers import HunyuanVideoTransformer3DModel

    model = HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, patch_size=2, patch_size_t=1, text_embed_dim=16,
        pooled_projection_dim=8, rope_axes_dim=(8, 12, 12),
    )
    mask = torch.ones(1, 7, dtype=torch.long)
    mask[:, 5:] = 0  # two padded text tokens: exercises the boolean key mask of every attention
    return model, _forward(model, hidden_states=_randn(1, 4, 3, 8, 8, seed=1), timestep=torch.tensor([500]),
                           encoder_hidden_states=_randn(1, 7, 16, seed=2), encoder_attention_mask=mask,
                           pooled_projections=_randn(1, 8, seed=3), guidance=torch.tensor([3500.0]))


def wan(head_dim: int = HEAD_DIM):
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=HEADS, attention_head_dim=head_dim, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True, rope_max_seq_len=32,
    )
    return model, _forward(model, hidden_states=_randn(1, 4, 3, 8, 8, seed=1), timestep=torch.tensor([500]),
                           encoder_hidden_states=_randn(1, 7, 16, seed=2))


def mochi():
    from diffusers import MochiTransformer3DModel

    model = MochiTransformer3DModel(
        patch_size=2, num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, num_layers=2, pooled_projection_dim=16,
        in_channels=4, text_embed_dim=16, time_embed_dim=4, max_sequence_length=8,
    )
    mask = torch.ones(1, 8, dtype=torch.long)
    mask[:, 6:] = 0  # Mochi drops padded text tokens per sample before its SDPA
    return model, _forward(model, hidden_states=_randn(1, 4, 3, 8, 8, seed=1),
                           encoder_hidden_states=_randn(1, 8, 16, seed=2), timestep=torch.tensor([500]),
                           encoder_attention_mask=mask)


def ltx_video():
    from diffusers import LTXVideoTransformer3DModel

    model = LTXVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=HEADS, attention_head_dim=HEAD_DIM,
        cross_attention_dim=INNER, num_layers=2, caption_channels=16,
    )
    # (B, F*H*W, C) latents already patchified: 3 frames of 4x4
    return model, _forward(model, hidden_states=_randn(1, 48, 4, seed=1),
                           encoder_hidden_states=_randn(1, 7, 16, seed=2), timestep=torch.tensor([500]),
                           encoder_attention_mask=torch.ones(1, 7, dtype=torch.long), num_frames=3, height=4, width=4)


def flux():
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=HEAD_DIM,
        num_attention_heads=HEADS, joint_attention_dim=16, pooled_projection_dim=8, axes_dims_rope=(8, 12, 12),
    )
    img_ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(6.0), torch.arange(6.0), indexing="ij"), -1)
    return model, _forward(model, hidden_states=_randn(1, 36, 4, seed=1),
                           encoder_hidden_states=_randn(1, 7, 16, seed=2), pooled_projections=_randn(1, 8, seed=3),
                           timestep=torch.tensor([0.5]),
                           img_ids=img_ids.reshape(-1, 3), txt_ids=torch.zeros(7, 3))


def sd3():
    from diffusers import SD3Transformer2DModel

    # layer 0 is an SD3.5 MMDiT-X block (extra self-attention attn2); the last block is context_pre_only
    model = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=HEAD_DIM,
        num_attention_heads=HEADS, joint_attention_dim=16, caption_projection_dim=INNER, pooled_projection_dim=8,
        out_channels=4, pos_embed_max_size=16, dual_attention_layers=(0,), qk_norm="rms_norm",
    )
    return model, _forward(model, hidden_states=_randn(1, 4, 12, 12, seed=1),
                           encoder_hidden_states=_randn(1, 7, 16, seed=2), pooled_projections=_randn(1, 8, seed=3),
                           timestep=torch.tensor([500]))


BUILDERS = {
    "CogVideoXTransformer3DModel": cogvideox,
    "HunyuanVideoTransformer3DModel": hunyuan_video,
    "WanTransformer3DModel": wan,
    "MochiTransformer3DModel": mochi,
    "LTXVideoTransformer3DModel": ltx_video,
    "FluxTransformer2DModel": flux,
    "SD3Transformer2DModel": sd3,
}


def tiny_transformer(name: str):
    """``(model, call)`` for the Diffusers transformer class ``name``, weights from seed 0, in eval mode."""
    torch.manual_seed(0)
    model, call = BUILDERS[name]()
    return model.eval(), call


def tiny_wan_pipeline(head_dim: int = HEAD_DIM):
    """``(pipe, ids, prompt_embeds, negative_prompt_embeds)``: a WanPipeline of tiny parts (CPU, float32).

    There is no tokenizer offline: the tiny UMT5 text encoder (built from config) embeds fixed token
    ids and the pipeline gets the embeddings. The VAE's mid-block attention has head dim 32 (one head
    of ``8 * 4`` channels) and calls SDPA itself, so a leaked SDPA swap would change its output.
    """
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 4], num_res_blocks=1,
                           temperal_downsample=[False, True, True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                                               relative_attention_num_buckets=8))
    transformer, _ = wan(head_dim)  # in_channels 4 = the VAE's z_dim, text_dim 16 = the encoder's d_model
    pipe = WanPipeline(tokenizer=None, text_encoder=text_encoder.eval(), vae=vae.eval(),
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), transformer=transformer.eval())
    pipe.set_progress_bar_config(disable=True)
    ids = torch.randint(1, 64, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        embeds = text_encoder(ids).last_hidden_state
    return pipe, ids, embeds[:1], embeds[1:]


def tiny_prompt_embeds(pipe, text: str, length: int = 7) -> torch.Tensor:
    """``(1, length, 16)`` embeddings of ``text`` by the tiny pipeline's text encoder (no tokenizer offline).

    The token ids stand in for a tokenizer: the text's first ``length`` UTF-8 bytes mapped to
    ``1 + byte % (vocab - 1)`` (0 pads a shorter text), so equal texts give equal embeddings.
    """
    vocab = pipe.text_encoder.config.vocab_size
    ids = [1 + b % (vocab - 1) for b in text.encode()[:length]]
    ids = torch.tensor([ids + [0] * (length - len(ids))], device=pipe.text_encoder.device)
    with torch.no_grad():
        return pipe.text_encoder(ids).last_hidden_state
