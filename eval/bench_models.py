"""Model-level speed: real model configs with random bf16 weights, unpatched vs ``quantpatch.patch_model(model, mode)``.

The measure that matters to a user: how much faster their model runs after one ``patch_model`` line.
Each row builds a model from its public config (the dicts below: hidden sizes, heads, layers, head_dim,
patch sizes) with its parameters on the meta device, then materialises them on the GPU in bf16 with
random values (N(0, 0.02) weights, unit norm weights, zero biases; modules a model keeps in float32 stay
float32, as ``from_pretrained`` does): no download. Diffusion rows feed the transformer directly with
random latents and text embeddings of the pipeline's shapes (no VAE, text encoder or pipeline).

| row | model, input, what is timed |
| --- | --- |
| ``wan-1.3b`` | Wan2.1-T2V-1.3B, 480x832, 81 frames: latent 21x60x104, patch (1,2,2): 32,760 tokens; one step |
| ``wan-14b`` | Wan2.1-T2V-14B, 1280x720, 81 frames: latent 21x90x160: 75,600 tokens; one step |
| ``cogvideox-5b`` | CogVideoX-5B, 480x720, 49 frames: 17,550 video + 226 text tokens, D=64; one step |
| ``hunyuanvideo`` | HunyuanVideo, 544x960, 129 frames: 67,320 video + 256 text tokens (64 valid); one step |
| ``flux-dev`` | Flux.1-dev, 1024x1024: 4,096 image + 512 text tokens; one step |
| ``ltx-video`` | LTX-Video 2B, 704x480, 161 frames: latent 21x15x22, patch 1: 6,930 tokens, D=64; one step |
| ``llama3-8b-prefill-*`` | Llama-3-8B forward over B=1 / 8 prompts of 8k / 32k tokens, last token's logits |
| ``llama3-8b-decode-*`` | ``generate()`` ms per new token after a 4k (B=1) / 32k (B=8) prompt |

Wan rows also cross-attend to 512 text tokens, LTX-Video to 128; HunyuanVideo's joint attention has a key mask
(padded text).

Columns: ``sdpa`` (the unpatched model, PyTorch's SDPA backend choice: the baseline), ``sdpa-cudnn`` (unpatched,
``sdpa_kernel(CUDNN_ATTENTION)``), each quantpatch mode that runs without calibration (``--modes``), with
``--linear fp8`` each of them again as ``MODE+fp8`` (``patch_model(model, MODE, linear="fp8")``: the transformer
blocks' linears in FP8, cross-attention projections kept bf16; ``--linear-exclude`` keeps instead the linears whose
name contains one of its substrings in bf16, and given no substring swaps every block linear)
and ``off+fp8`` (FP8 linears, attention unpatched); ``--linear fp8-fast`` the same with the FP8 GEMMs' fast
accumulation (``LinearConfig(kind="fp8", fast_accum=True)``, columns ``MODE+fp8-fast``), and for
Diffusers rows ``diffusers-sage`` (``transformer.set_attention_backend("sage")``) when the ``sageattention``
package is importable (skipped with a note otherwise). Each column gives ``ms`` (median), ``speedup`` (the
``sdpa`` time over the column's) and the output's CosSim and relative L1 against the ``sdpa`` column's output
(the transformer's output for a step; the final hidden states for a prefill; for a decode, the logits of every
step, the same tokens forced into every column so that the steps stay comparable). A mode is applied with
``quantpatch.patch_model(model, mode)`` and removed with ``handle.remove()`` before the next column; the
handle's report (what each attention site ran, its fallbacks and remarks) is stored in the JSON. Under
``turbo``, ``generate()`` builds quantpatch's ``TurboCache`` (compressed KV cache) by itself where the call's
batch × context passes the turbo-cache crossover of ``policy="speed"`` (every call under ``--policy always``);
the other columns decode with Transformers' default ``DynamicCache``.

Timing: a step or prefill is called ``--warmup`` times (the first call's output is the one compared), then
``--reps`` calls are timed with CUDA events, median reported, with the host's time until each call returned
(``host ms``: where it comes close to ``ms``, the GPU waited on the host's launches). A decode row runs
``--warmup`` untimed ``generate()`` calls, then one timed ``generate()`` of ``--decode-tokens`` tokens; a logits
processor marks each step with a CUDA event and forces the next token; ms/token is the median interval between
steps (the prefill is not in it). ``--profile`` (GPU) runs each column once more under ``torch.profiler`` and
reports ``GPU busy ms`` (first round): the GPU's own time (its kernels and copies) a call, or a decode step (a
``generate()`` of ``--decode-tokens`` tokens less one of a single token, over the steps between): well below ``ms``,
the column waits on the host. ``--rounds R`` times every column of a row R times, the columns in turn
(forward, then backward, ...), and reports each column's median over the rounds (``ms_rounds`` in the JSON): a
host whose speed drifts within a run then weighs on every column alike. The output compared, the patch report and
``host ms`` are the first round's.

``--layers N`` (every row) or ``--layers ROW=N`` cuts a model to N transformer blocks (double / single stream
models keep their 1:2 ratio), e.g. to fit the memory or the time; each row says what it ran. ``--quick``: every
model cut to 2 blocks, one timed call, 8 decode tokens (a GPU smoke run). ``--device cpu``: tiny configs of the
same classes on tiny inputs (head_dim 32; with ``--policy always`` the modes run their PyTorch references), for
the tests. ``--policy`` is passed to ``patch_model`` when given (default: the library's, ``speed``).

Writes ``models.csv``, ``bench.json`` (machine, versions, git SHA, command line, rows with each column's
patch report), ``models.png`` (speedup per row and column) and ``summary.md`` under ``--out``, after every
row (a run stopped early, or by ``--budget-s``, keeps what it measured).

Usage::

    QP_GIT_SHA=$(git rev-parse HEAD) python eval/bench_models.py --out eval/results/bench_models    # GPU
    python eval/bench_models.py --rows wan-1.3b flux-dev --modes sage2-8b --layers wan-1.3b=10
    python eval/bench_models.py --device cpu --out /tmp/bench_models                                  # CPU smoke
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import importlib.util
import json
import logging
import math
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (the shared benchmark harness, beside this script)

from quantpatch.config import LinearConfig  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "eval" / "results" / "bench_models"
MODES = ("sage2-8b", "sage2-4b", "int8-flash", "turbo", "fireq")
BASELINE, CUDNN, SAGE = "sdpa", "sdpa-cudnn", "diffusers-sage"
# --linear: patch_model's linear argument of each choice (the MODE+CHOICE columns)
LINEAR_OPTIONS = {"fp8": "fp8", "fp8-fast": LinearConfig(kind="fp8", fast_accum=True)}
logger = logging.getLogger("quantpatch").getChild("eval.bench_models")

# --------------------------------------------------------------------------- configs (public config.json values)

# Wan-AI/Wan2.1-T2V-1.3B-Diffusers, transformer/config.json
WAN_1_3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
                text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, added_kv_proj_dim=None,
                rope_max_seq_len=1024)
# Wan-AI/Wan2.1-T2V-14B-Diffusers: dim 5120 = 40 heads x 128, ffn 13824, 40 layers
WAN_14B = WAN_1_3B | dict(num_attention_heads=40, ffn_dim=13824, num_layers=40)
# THUDM/CogVideoX-5b, transformer/config.json
COGVIDEOX_5B = dict(num_attention_heads=48, attention_head_dim=64, in_channels=16, out_channels=16,
                    flip_sin_to_cos=True, freq_shift=0, time_embed_dim=512, text_embed_dim=4096,
                    num_layers=42, dropout=0.0,
                    attention_bias=True, sample_width=90, sample_height=60, sample_frames=49, patch_size=2,
                    temporal_compression_ratio=4, max_text_seq_length=226, activation_fn="gelu-approximate",
                    timestep_activation_fn="silu", norm_elementwise_affine=True, norm_eps=1e-5,
                    spatial_interpolation_scale=1.875, temporal_interpolation_scale=1.0,
                    use_rotary_positional_embeddings=True, use_learned_positional_embeddings=False)
# hunyuanvideo-community/HunyuanVideo, transformer/config.json
HUNYUAN_VIDEO = dict(in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128, num_layers=20,
                     num_single_layers=40, num_refiner_layers=2, mlp_ratio=4.0, patch_size=2, patch_size_t=1,
                     qk_norm="rms_norm", guidance_embeds=True, text_embed_dim=4096, pooled_projection_dim=768,
                     rope_theta=256.0, rope_axes_dim=(16, 56, 56))
# black-forest-labs/FLUX.1-dev, transformer/config.json
FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                axes_dims_rope=(16, 56, 56))
# Lightricks/LTX-Video (2B), transformer/config.json
LTX_VIDEO = dict(in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32,
                 attention_head_dim=64, cross_attention_dim=2048, num_layers=28, activation_fn="gelu-approximate",
                 qk_norm="rms_norm_across_heads", norm_elementwise_affine=False, norm_eps=1e-6, caption_channels=4096,
                 attention_bias=True, attention_out_bias=True)
# meta-llama/Meta-Llama-3-8B, config.json
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
                 rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False, bos_token_id=128000,
                 eos_token_id=128001)

# Tiny configs of the same classes for --device cpu (2 heads of 32, 1-2 blocks).
TINY = {
    "wan": dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=32, in_channels=4, out_channels=4,
                text_dim=16, freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", rope_max_seq_len=32),
    "cogvideox": dict(num_attention_heads=2, attention_head_dim=32, in_channels=4, out_channels=4, time_embed_dim=8,
                      text_embed_dim=16, num_layers=2, sample_width=8, sample_height=8, sample_frames=9, patch_size=2,
                      temporal_compression_ratio=4, max_text_seq_length=8, use_rotary_positional_embeddings=True),
    "hunyuan": dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=32, num_layers=1,
                    num_single_layers=2, num_refiner_layers=1, patch_size=2, patch_size_t=1, text_embed_dim=16,
                    pooled_projection_dim=8, rope_axes_dim=(8, 12, 12)),
    "flux": dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=2, attention_head_dim=32,
                 num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=8, guidance_embeds=True,
                 axes_dims_rope=(8, 12, 12)),
    "ltx": dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=32, cross_attention_dim=64,
                num_layers=2, caption_channels=16),
    "llama": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False),
}


@dataclass(frozen=True)
class ModelSpec:
    """A model class and its config; ``layer_keys``: the config fields that count its transformer blocks."""

    family: str  # wan | cogvideox | hunyuan | flux | ltx | llama
    cls: str  # "diffusers.WanTransformer3DModel", "transformers.LlamaForCausalLM"
    config: dict
    layer_keys: tuple[str, ...]

    @property
    def library(self) -> str:
        return self.cls.split(".")[0]


MODELS = {
    "wan2.1-t2v-1.3b": ModelSpec("wan", "diffusers.WanTransformer3DModel", WAN_1_3B, ("num_layers",)),
    "wan2.1-t2v-14b": ModelSpec("wan", "diffusers.WanTransformer3DModel", WAN_14B, ("num_layers",)),
    "cogvideox-5b": ModelSpec("cogvideox", "diffusers.CogVideoXTransformer3DModel", COGVIDEOX_5B, ("num_layers",)),
    "hunyuanvideo": ModelSpec("hunyuan", "diffusers.HunyuanVideoTransformer3DModel", HUNYUAN_VIDEO,
                              ("num_layers", "num_single_layers")),
    "flux.1-dev": ModelSpec("flux", "diffusers.FluxTransformer2DModel", FLUX_DEV, ("num_layers", "num_single_layers")),
    "ltx-video": ModelSpec("ltx", "diffusers.LTXVideoTransformer3DModel", LTX_VIDEO, ("num_layers",)),
    "llama-3-8b": ModelSpec("llama", "transformers.LlamaForCausalLM", LLAMA3_8B, ("num_hidden_layers",)),
}


@dataclass(frozen=True)
class Row:
    """One benchmark row: a model, what is timed (``step``, ``prefill``, ``decode``) and its input shapes
    (``shape`` on a GPU, ``tiny`` with the tiny configs)."""

    name: str
    model: str
    kind: str
    what: str
    shape: dict
    tiny: dict = field(default_factory=dict)


ROWS = [
    Row("wan-1.3b", "wan2.1-t2v-1.3b", "step", "480x832, 81 frames: 32,760 tokens + 512 text, one step",
        dict(latent=(16, 21, 60, 104), text=512), dict(latent=(4, 3, 8, 8), text=7)),
    Row("wan-14b", "wan2.1-t2v-14b", "step", "1280x720, 81 frames: 75,600 tokens + 512 text, one step",
        dict(latent=(16, 21, 90, 160), text=512), dict(latent=(4, 3, 8, 12), text=7)),
    Row("cogvideox-5b", "cogvideox-5b", "step", "480x720, 49 frames: 17,550 + 226 text = 17,776 tokens, D=64, one step",
        dict(latent=(13, 16, 60, 90), height=480, width=720), dict(latent=(3, 4, 8, 8), height=64, width=64)),
    Row("flux-dev", "flux.1-dev", "step", "1024x1024: 4,096 image + 512 text tokens, one step",
        dict(grid=(64, 64), text=512), dict(grid=(6, 6), text=7)),
    Row("ltx-video", "ltx-video", "step", "704x480, 161 frames: 6,930 tokens + 128 text, one step",
        dict(latent=(21, 15, 22), text=128), dict(latent=(3, 4, 4), text=7)),
    Row("llama3-8b-prefill-2k-b1", "llama-3-8b", "prefill", "prefill B=1 x 2,048 tokens (a chat prompt)",
        dict(batch=1, seq=2048), dict(batch=1, seq=64)),
    Row("llama3-8b-prefill-8k-b1", "llama-3-8b", "prefill", "prefill B=1 x 8,192 tokens",
        dict(batch=1, seq=8192), dict(batch=1, seq=64)),
    Row("llama3-8b-prefill-8k-b8", "llama-3-8b", "prefill", "prefill B=8 x 8,192 tokens",
        dict(batch=8, seq=8192), dict(batch=2, seq=64)),
    Row("llama3-8b-prefill-32k-b1", "llama-3-8b", "prefill", "prefill B=1 x 32,768 tokens",
        dict(batch=1, seq=32768), dict(batch=1, seq=96)),
    Row("llama3-8b-prefill-32k-b8", "llama-3-8b", "prefill", "prefill B=8 x 32,768 tokens",
        dict(batch=8, seq=32768), dict(batch=2, seq=96)),
    Row("llama3-8b-decode-b1-4k", "llama-3-8b", "decode", "generate() B=1 after a 4,096-token prompt, ms/token",
        dict(batch=1, prompt=4096), dict(batch=1, prompt=70)),
    Row("llama3-8b-decode-b8-32k", "llama-3-8b", "decode", "generate() B=8 after a 32,768-token prompt, ms/token",
        dict(batch=8, prompt=32768), dict(batch=2, prompt=80)),
    Row("hunyuanvideo", "hunyuanvideo", "step",
        "544x960, 129 frames: 67,320 tokens + 256 text (64 valid), one step",
        dict(latent=(16, 33, 68, 120), text=256, valid=64), dict(latent=(4, 3, 8, 8), text=7, valid=5)),
]
ROW_NAMES = [r.name for r in ROWS]


# --------------------------------------------------------------------------- building


def cut_layers(spec: ModelSpec, config: dict, keep: int | None) -> tuple[dict, str]:
    """``config`` with at most ``keep`` transformer blocks (two stacks keep their ratio, at least one of each
    kept), and a note of what was kept (``""`` when nothing was cut)."""
    full = [config[k] for k in spec.layer_keys]
    if keep is None or keep >= sum(full):
        return config, ""
    if len(full) == 1:
        kept = [max(1, keep)]
    else:
        first = max(1, round(keep * full[0] / sum(full)))
        kept = [first, max(1, keep - first)]
    note = f"layers {'+'.join(map(str, kept))} of {'+'.join(map(str, full))}"
    return config | dict(zip(spec.layer_keys, kept)), note


@contextlib.contextmanager
def parameters_on_meta():
    """Modules built inside get their parameters on the meta device (no memory, no init) and their buffers
    (RoPE tables, ...) computed as usual: ``accelerate.init_empty_weights(include_buffers=False)``, which
    ``from_pretrained`` uses too."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        yield


def _is_norm(module: torch.nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


def materialize(model: torch.nn.Module, device: torch.device, dtype: torch.dtype, seed: int = 0) -> None:
    """Give every meta parameter storage on ``device``: ``dtype`` (float32 where the class lists the module in
    ``_keep_in_fp32_modules``), N(0, 0.02) values, ones for norm weights, zeros for biases; buffers moved."""
    keep_fp32 = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    gen = torch.Generator(device=device).manual_seed(seed)
    for module_name, module in model.named_modules():
        parts = set(module_name.split("."))
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            t = torch.empty(param.shape, device=device, dtype=torch.float32 if parts & keep_fp32 else dtype)
            if name == "bias":
                t.zero_()
            elif _is_norm(module) and t.dim() == 1:
                t.fill_(1.0)
            else:
                t.normal_(0.0, 0.02, generator=gen)
            module._parameters[name] = torch.nn.Parameter(t, requires_grad=False)
        for name, buf in list(module._buffers.items()):
            if buf is not None:
                module._buffers[name] = buf.to(device)


def build_model(spec: ModelSpec, config: dict, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The model of ``spec`` with ``config``, random weights on ``device`` in ``dtype``, in eval mode."""
    library, name = spec.cls.split(".")
    cls = getattr(importlib.import_module(library), name)
    with parameters_on_meta():
        if library == "transformers":
            from transformers import LlamaConfig

            model = cls(LlamaConfig(**config, attn_implementation="sdpa"))
        else:
            model = cls(**config)
    materialize(model, device, dtype)
    return model.eval()


# --------------------------------------------------------------------------- inputs


def _randn(gen: torch.Generator, *shape: int, device, dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)


def diffusion_inputs(spec: ModelSpec, config: dict, shape: dict, device: torch.device, dtype: torch.dtype) -> dict:
    """Keyword arguments of one transformer call, shaped as the family's pipeline makes them."""
    gen = torch.Generator(device=device).manual_seed(1)
    rand = lambda *s: _randn(gen, *s, device=device, dtype=dtype)  # noqa: E731
    t = torch.tensor([500], device=device)
    if spec.family == "wan":
        return dict(hidden_states=rand(1, *shape["latent"]), timestep=t,
                    encoder_hidden_states=rand(1, shape["text"], config["text_dim"]))
    if spec.family == "cogvideox":
        from diffusers.models.embeddings import get_3d_rotary_pos_embed
        from diffusers.pipelines.cogvideo.pipeline_cogvideox import get_resize_crop_region_for_grid

        frames, _, h, w = shape["latent"]
        grid = (h // config["patch_size"], w // config["patch_size"])
        base_w, base_h = config["sample_width"] // config["patch_size"], config["sample_height"] // config["patch_size"]
        rotary = get_3d_rotary_pos_embed(embed_dim=config["attention_head_dim"],
                                         crops_coords=get_resize_crop_region_for_grid(grid, base_w, base_h),
                                         grid_size=grid, temporal_size=frames, device=device)
        return dict(hidden_states=rand(1, *shape["latent"]), timestep=t, image_rotary_emb=rotary,
                    encoder_hidden_states=rand(1, config["max_text_seq_length"], config["text_embed_dim"]))
    if spec.family == "hunyuan":
        mask = torch.zeros(1, shape["text"], dtype=torch.long, device=device)
        mask[:, :shape["valid"]] = 1
        return dict(hidden_states=rand(1, *shape["latent"]), timestep=t,
                    encoder_hidden_states=rand(1, shape["text"], config["text_embed_dim"]), encoder_attention_mask=mask,
                    pooled_projections=rand(1, config["pooled_projection_dim"]),
                    guidance=torch.tensor([6000.0], device=device))
    if spec.family == "flux":
        h, w = shape["grid"]
        img_ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(float(h)), torch.arange(float(w)),
                                             indexing="ij"), -1).reshape(-1, 3)
        return dict(hidden_states=rand(1, h * w, config["in_channels"]), timestep=torch.tensor([0.5], device=device),
                    encoder_hidden_states=rand(1, shape["text"], config["joint_attention_dim"]),
                    pooled_projections=rand(1, config["pooled_projection_dim"]),
                    guidance=torch.tensor([3.5], device=device), img_ids=img_ids.to(device),
                    txt_ids=torch.zeros(shape["text"], 3, device=device))
    if spec.family == "ltx":  # latents packed (B, F·H·W, C), as LTXPipeline passes them; its RoPE scale
        frames, h, w = shape["latent"]
        return dict(hidden_states=rand(1, frames * h * w, config["in_channels"]), timestep=t,
                    encoder_hidden_states=rand(1, shape["text"], config["caption_channels"]),
                    encoder_attention_mask=torch.ones(1, shape["text"], dtype=torch.long, device=device),
                    num_frames=frames, height=h, width=w, rope_interpolation_scale=(8 / 25, 32, 32))
    raise ValueError(f"no inputs for family {spec.family!r}")


def token_ids(config: dict, batch: int, length: int, device: torch.device, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, config["vocab_size"], (batch, length), generator=gen, device=device)


class ForcedDecode:
    """A ``generate()`` logits processor: marks each step on a :class:`harness.StepClock`, keeps the step's
    logits and forces the next token to ``tokens[:, step]`` (so every column decodes the same sequence)."""

    def __init__(self, tokens: torch.Tensor, clock: harness.StepClock):
        self.tokens, self.clock, self.logits = tokens, clock, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.clock.tick()
        step = len(self.logits)
        self.logits.append(scores.detach().clone())
        forced = torch.full_like(scores, -math.inf)
        forced.scatter_(1, self.tokens[:, step:step + 1], 0.0)
        return forced


def make_call(row: Row, spec: ModelSpec, config: dict, model: torch.nn.Module, shape: dict, device: torch.device,
              dtype: torch.dtype, args: argparse.Namespace) -> Callable[[], Any]:
    """The callable a column times: ``() -> output`` for a step or prefill, ``(tokens=--decode-tokens) -> (logits,
    step ms)`` for a decode."""
    if spec.library == "diffusers":
        inputs = diffusion_inputs(spec, config, shape, device, dtype)
        return lambda: model(**inputs, return_dict=False)[0]
    if row.kind == "prefill":
        ids = token_ids(config, shape["batch"], shape["seq"], device, seed=2)

        def prefill():
            hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
            model.lm_head(hidden[:, -1:])  # the logits a generate() prefill computes
            return hidden

        return prefill
    from transformers import LogitsProcessorList

    prompt = token_ids(config, shape["batch"], shape["prompt"], device, seed=3)
    forced = token_ids(config, shape["batch"], args.decode_tokens, device, seed=4)

    def decode(tokens: int = args.decode_tokens):
        clock = harness.StepClock(device)
        processor = ForcedDecode(forced, clock)
        model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=tokens,
                       min_new_tokens=tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                       logits_processor=LogitsProcessorList([processor]))
        return torch.stack(processor.logits, 1), clock.intervals_ms()

    return decode


# --------------------------------------------------------------------------- columns


def columns_for(spec: ModelSpec, modes: Sequence[str], linear: str | None = None) -> list[str]:
    """The baselines, each mode, with ``linear`` each mode again with those linears (``MODE+fp8``) and the linears
    alone (``off+fp8``), and Diffusers' sage backend."""
    cols = [BASELINE, CUDNN, *modes]
    if linear:
        cols += [f"{mode}+{linear}" for mode in ("off", *modes)]
    return cols + [SAGE] if spec.library == "diffusers" else cols


def report_summary(handle) -> dict:
    """What a patch handle's sites ran: ``{"policy", "sites", "runs", "routes", "implementations", "fallbacks",
    "remarks", "text"}``; ``routes`` counts calls per route over all sites, the others count sites."""
    impls, falls, runs, routes = Counter(), Counter(), Counter(), Counter()
    for site in handle.sites:
        runs[site.runs] += 1
        impls.update(site.implementations)
        falls.update(site.fallbacks)
        routes.update(getattr(site, "routes", {}))
    return {"policy": getattr(handle, "policy", None), "sites": len(handle.sites), "runs": dict(runs),
            "routes": dict(routes), "implementations": dict(impls), "fallbacks": dict(falls),
            "remarks": list(handle.remarks), "text": handle.report()}


def short_note(report: dict) -> str:
    """One line for the table: calls per route (else implementations per site) and fallbacks per site."""
    if report["routes"]:
        parts = [f"{k}: {v} calls" for k, v in sorted(report["routes"].items())]
    else:
        parts = [f"{k} x{v}" for k, v in sorted(report["implementations"].items())]
    parts += [f"fallback '{k}' x{v}" for k, v in sorted(report["fallbacks"].items())]
    return "; ".join(parts)


@contextlib.contextmanager
def column_setup(column: str, model: torch.nn.Module, record: dict, policy: str | None = None,
                 linear_exclude: Sequence[str] | None = None):
    """Put ``model`` in the state of ``column`` for the block (patched, a forced SDPA backend, Diffusers' sage
    backend) and restore it after; ``record`` receives the patch report. ``linear_exclude``: the
    ``patch_model`` filter of the FP8 columns' linears."""
    if column == BASELINE:
        yield
    elif column == CUDNN:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            yield
    elif column == SAGE:
        from diffusers.models.attention_dispatch import attention_backend

        # set_attention_backend also makes "sage" Diffusers' process-wide active backend, which
        # reset_attention_backend leaves: the context manager puts the previous one back for the next columns
        with attention_backend("sage"):
            model.set_attention_backend("sage")
            try:
                yield
            finally:
                model.reset_attention_backend()
    else:
        import quantpatch

        mode, _, linear = column.partition("+")
        options = {} if policy is None else {"policy": policy}
        if linear:
            options["linear"] = LINEAR_OPTIONS[linear]
            if linear_exclude is not None:
                options["linear_exclude"] = list(linear_exclude)
        with quantpatch.patch_model(model, mode, **options) as handle:
            try:
                yield
            finally:
                record["report"] = report_summary(handle)


def skip_reason(column: str) -> str | None:
    if column == SAGE and importlib.util.find_spec("sageattention") is None:
        return "sageattention is not installed"
    return None


def run_column(row: Row, column: str, call: Callable[[], Any], device: torch.device, ref: Any,
               args: argparse.Namespace, model: torch.nn.Module, profile: bool = False) -> tuple[dict, Any]:
    """Time ``call`` under ``column`` (and with ``profile``, on a GPU, measure its busy time); returns ``(record,
    output)``."""
    record: dict = {"column": column}
    reason = skip_reason(column)
    if reason:
        return record | {"skipped": reason}, None
    try:
        with torch.no_grad(), column_setup(column, model, record, args.policy, args.linear_exclude):
            if row.kind == "decode":
                for _ in range(args.warmup):  # untimed: the first generate() of a process runs cold (allocator)
                    call()
                out, steps = call()
                ms = harness.median(steps)
                record["steps"] = len(steps)
            else:
                host: list[float] = []
                out, times = harness.time_calls(call, device, warmup=args.warmup, reps=args.reps, host_ms=host)
                ms = harness.median(times)
                record["times_ms"] = [round(t, 3) for t in times]
                record["host_ms"] = harness.median(host)
            if profile and device.type == "cuda":
                record["gpu_busy_ms"] = profiled_busy_ms(call, row.kind, args.decode_tokens, device)
    except torch.cuda.OutOfMemoryError:
        free(device)
        return record | {"skipped": "out of GPU memory"}, None
    except Exception as err:  # noqa: BLE001 (one column failing must not stop the run: say why, go on)
        logger.exception("%s / %s failed", row.name, column)
        message = str(err).splitlines()[0][:100] if str(err) else ""
        return record | {"skipped": f"{type(err).__name__}: {message}"}, None
    record |= {"ms": ms, "finite": bool(torch.isfinite(out).all())}
    if ref is not None:
        record |= harness.similarity(out, ref)
    return record, out


def gpu_busy_ms(averages) -> float:
    """The GPU's own time in ``torch.profiler``'s ``key_averages()``: the self times of its device events (kernels,
    copies, fills), user annotations left out, as the profiler's table sums them; ms."""
    from torch.autograd import DeviceType

    return sum(e.self_device_time_total for e in averages
               if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False)) / 1e3


def profiled_busy_ms(call: Callable[..., Any], kind: str, tokens: int, device: torch.device) -> float:
    """The GPU's busy time of one ``call`` (a step or prefill), or of one decode step: a ``generate()`` of ``tokens``
    tokens less one of a single token (the prefill and the first token's logits), over the ``tokens - 1`` steps
    between."""
    from torch.profiler import ProfilerActivity, profile

    def busy(*call_args) -> float:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            call(*call_args)
            torch.cuda.synchronize(device)
        return gpu_busy_ms(prof.key_averages())

    if kind != "decode":
        return busy()
    return (busy(tokens) - busy(1)) / (tokens - 1)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- the run


def layer_cuts(entries: Sequence[str]) -> dict[str | None, int]:
    """``--layers`` entries ``N`` (every row) or ``ROW=N``: ``{None or row name: N}``."""
    cuts: dict[str | None, int] = {}
    for entry in entries:
        row, _, n = entry.rpartition("=")
        if row and row not in ROW_NAMES:
            raise ValueError(f"--layers {entry!r}: unknown row {row!r}; rows are {ROW_NAMES}")
        cuts[row or None] = int(n)
    return cuts


def bench_rows(args: argparse.Namespace, write: Callable[[list[dict]], None], results: list[dict]) -> list[dict]:
    """Run the selected rows, appending one record per column to ``results`` and calling ``write`` after each row."""
    device = torch.device(args.device)
    tiny = device.type != "cuda"
    dtype = getattr(torch, args.dtype) if args.dtype else torch.float32 if tiny else torch.bfloat16
    cuts = layer_cuts(args.layers)
    start = time.perf_counter()
    built: tuple[tuple, torch.nn.Module] | None = None
    for row in (r for r in ROWS if r.name in args.rows):
        spec = MODELS[row.model]
        config = TINY[spec.family] if tiny else spec.config
        config, cut = cut_layers(spec, config, cuts.get(row.name, cuts.get(None)))
        shape = row.tiny if tiny else row.shape
        base = {"row": row.name, "model": row.model, "kind": row.kind, "what": row.what + (" (tiny)" if tiny else ""),
                "layers": cut or "all"}
        key = (row.model, tuple(config[k] for k in spec.layer_keys))
        if built is None or built[0] != key:
            model = built = None  # one model in memory at a time
            free(device)
            built = (key, build_model(spec, config, device, dtype))
        model = built[1]
        call = make_call(row, spec, config, model, shape, device, dtype, args)
        ref = None
        logger.info("row %s (%s, %s)", row.name, row.what, cut or "all layers")
        columns = columns_for(spec, args.modes, args.linear)
        records: dict[str, dict] = {}
        for round_ in range(args.rounds):
            for column in columns if round_ % 2 == 0 else columns[::-1]:
                if round_ and "ms" not in records[column]:  # skipped in the first round: skipped
                    continue
                if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
                    if not round_:
                        records[column] = base | {"column": column,
                                                  "skipped": f"time budget ({args.budget_s:.0f} s) spent"}
                    continue
                record, out = run_column(row, column, call, device, ref if not round_ else None, args, model,
                                         profile=args.profile and not round_)
                if round_ == 0 and column == BASELINE:
                    ref = out
                del out
                if round_ == 0:
                    records[column] = base | record | ({"ms_rounds": [record["ms"]]} if "ms" in record else {})
                elif "ms" in record:
                    records[column]["ms_rounds"].append(record["ms"])
                logger.info("  %-12s %s", column, f"{record['ms']:.2f} ms" if "ms" in record else record.get("skipped"))
        for column in columns:
            record = records[column]
            if "ms_rounds" in record:
                record["ms"] = harness.median(record["ms_rounds"])
            results.append(record)
        del ref, call
        add_speedups(results)
        write(results)
    model = built = None
    free(device)
    return results


def add_speedups(results: list[dict]) -> None:
    base = {r["row"]: r["ms"] for r in results if r["column"] == BASELINE and "ms" in r}
    for r in results:
        if "ms" in r and r["row"] in base:
            r["speedup"] = base[r["row"]] / r["ms"]


TABLE = [("row", "row", "s"), ("layers", "layers", "s"), ("column", "column", "s"), ("ms", "ms", ".2f"),
         ("host_ms", "host ms", ".2f"), ("gpu_busy_ms", "GPU busy ms", ".2f"), ("speedup", "x unpatched", ".3f"),
         ("cos_sim", "CosSim", ".6f"), ("rel_l1", "rel L1", ".4f"), ("note", "note", "s")]
CSV_FIELDS = ["row", "model", "kind", "what", "layers", "column", "ms", "host_ms", "gpu_busy_ms", "speedup", "cos_sim",
              "rel_l1", "finite", "steps", "note"]


def table_rows(results: list[dict]) -> list[dict]:
    """Flat rows for the CSV and the table: the patch report reduced to a note, a skip reason as the note."""
    flat = []
    for r in results:
        note = r.get("skipped") or (short_note(r["report"]) if "report" in r else "")
        if r.get("finite") is False:
            note = "non-finite output; " + note
        flat.append({k: r.get(k) for k in CSV_FIELDS if k != "note"} | {"note": note})
    return flat


def summary_md(meta: dict, results: list[dict]) -> str:
    versions = ", ".join(f"{k} {meta.get(k)}" for k in ("torch", "triton", "transformers", "diffusers", "cuda"))
    lines = [f"# Model benchmark ({meta['device']})", "",
             f"{versions}; commit {meta['git_sha']}; {meta['date']}", "",
             f"Command: `{meta['command']}`", ""]
    for earlier in meta.get("merged", []):
        lines += [f"Rows {', '.join(earlier['rows'])} from an earlier run on the same GPU ({earlier['date']}, commit "
                  f"{earlier['git_sha']}): `{earlier['command']}`", ""]
    lines += [
             "ms: median of the timed calls (decode: ms per new token); host ms: median time until a step or prefill "
             "call returned on the host, its launches enqueued (first round; near ms: the column waited on the "
             "host); GPU busy ms (`--profile`): the GPU's own time a call or decode step (well below ms: the column "
             "waited on the host); x unpatched: the `sdpa` column's ms over the column's; CosSim / rel L1: the output "
             "against the `sdpa` column's; layers: blocks kept when cut.",
             "", harness.markdown_table(table_rows(results), TABLE), ""]
    return "\n".join(lines)


def merged_rows(path: Path, args: argparse.Namespace, meta: dict) -> list[dict]:
    """The records of an earlier ``bench.json`` for the rows this run does not select (so that one result set
    can be completed in several runs); that run's command is added to ``meta["merged"]``.

    Raises ``ValueError`` when the earlier run was on another device (its times would not compare)."""
    earlier = json.loads(path.read_text())
    if earlier["machine"]["device"] != meta["device"]:
        raise ValueError(f"--merge {path}: measured on {earlier['machine']['device']}, this run is on {meta['device']}")
    kept = [r for r in earlier["rows"] if r["row"] not in args.rows]
    previous = earlier["machine"].get("merged", [])
    meta["merged"] = previous + [{k: earlier["machine"][k] for k in ("command", "date", "git_sha")}
                                 | {"rows": list(dict.fromkeys(r["row"] for r in kept
                                                               if not any(r["row"] in m["rows"] for m in previous)))}]
    return kept


def plot(results: list[dict], path: Path, meta: dict) -> None:
    values: dict[str, dict[str, float]] = {}
    for r in results:
        if "speedup" in r:
            label = r["row"] + (f" ({r['layers']})" if r["layers"] != "all" else "")
            values.setdefault(label, {})[r["column"]] = r["speedup"]
    harness.bar_chart(path, values, ylabel="x unpatched (SDPA)",
                      title=f"quantpatch.patch_model speedup per model ({meta['device']}, eval/bench_models.py)")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", nargs="+", default=ROW_NAMES, choices=ROW_NAMES)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--layers", nargs="+", default=[], metavar="[ROW=]N",
                   help="keep N transformer blocks (every row, or ROW=N for one row)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu (or any non-CUDA device): tiny configs and inputs")
    p.add_argument("--linear", choices=list(LINEAR_OPTIONS), default=None,
                   help="also run each mode (and the unpatched attention, 'off') with the blocks' linears in FP8 "
                        "(fp8-fast: with the GEMMs' fast accumulation)")
    p.add_argument("--linear-exclude", nargs="*", default=None, metavar="SUBSTRING",
                   help="with --linear: linears whose name contains one of these stay bf16 (patch_model's "
                        "linear_exclude, e.g. ffn), instead of the cross-attention projections; with no substring "
                        "every block linear is FP8")
    p.add_argument("--policy", choices=["speed", "always"], default=None,
                   help="patch_model's policy (default: the library's default)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                   help="weights and inputs (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed calls before the timed ones (a decode row: whole generate() calls)")
    p.add_argument("--reps", type=int, default=3, help="timed calls (step, prefill)")
    p.add_argument("--rounds", type=int, default=1,
                   help="time each row's columns this many times, in turn; report each column's median")
    p.add_argument("--decode-tokens", type=int, default=32, help="tokens generate() makes in a decode row")
    p.add_argument("--profile", action="store_true",
                   help="GPU: each column once more under torch.profiler, for its GPU busy ms (a call / decode step)")
    p.add_argument("--budget-s", type=float, default=None, help="start no column after this many seconds")
    p.add_argument("--quick", action="store_true", help="2 blocks a model, 1 timed call, 8 decode tokens")
    p.add_argument("--merge", type=Path, default=None, metavar="BENCH_JSON",
                   help="keep the rows not selected now from an earlier run's bench.json (same GPU)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if args.quick:
        args.layers = ["2"] + [e for e in args.layers if "=" in e]
        args.reps, args.decode_tokens = 1, 8
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.linear_exclude is not None and not args.linear:
        p.error("--linear-exclude filters the FP8 columns' linears: pass --linear fp8 (or fp8-fast)")
    if args.decode_tokens < 3:
        p.error("--decode-tokens must be at least 3 (two decode steps to time)")
    layer_cuts(args.layers)  # validate now, not after the first rows
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    meta = harness.machine_record(args.device, REPO_ROOT)
    if argv is not None:  # called as a function (quantpatch bench models, tests): the arguments it got
        meta["command"] = " ".join(["eval/bench_models.py", *argv])
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}

    def write(results: list[dict]) -> None:
        harness.write_json(args.out / "bench.json", {"machine": meta, "config": config, "rows": results})
        harness.write_csv(args.out / "models.csv", table_rows(results))
        (args.out / "summary.md").write_text(summary_md(meta, results))
        try:
            plot(results, args.out / "models.png", meta)
        except ImportError:
            logger.warning("matplotlib missing: no plot")

    results = merged_rows(args.merge, args, meta) if args.merge else []
    results = bench_rows(args, write, results)
    print(harness.markdown_table(table_rows(results), TABLE))
    return {"machine": meta, "config": config, "rows": results}


if __name__ == "__main__":
    main()
