"""Video generation with a Diffusers pipeline, full-precision attention vs quantpatch modes.

    python eval/video_generation.py --pipeline DIR --prompts prompts.txt --modes sage2-8b sage2-4b \
        --frames 49 --height 480 --width 720 --steps 50 --dtype bfloat16 --out eval/results/video_generation/NAME
    python eval/video_generation.py --tiny wan --prompts prompts.txt --modes sage2-8b --steps 3 --out /tmp/video
    quantpatch eval video ... (the same arguments)

``--pipeline`` is any Diffusers video pipeline directory (CogVideoX, HunyuanVideo, Wan, Mochi, LTX:
``DiffusionPipeline.from_pretrained``); ``--tiny wan`` builds a tiny Wan pipeline from config with
random weights instead (``quantpatch.testing.diffusers_tiny``: no download, seconds on a CPU; it has
no tokenizer, so each prompt's UTF-8 bytes stand in for token ids). Prompts: a text file (one per
non-empty line) or a jsonl file (``prompt`` field, else ``text``).

Every (prompt, seed) is generated with the pipeline's own attention (``fp``) and with each mode
(``quantpatch.patch_model(pipe, mode, policy="always")``, removed before the next), the initial noise from a CPU
generator seeded with the seed, so all rows start from the same latents. ``--repeat-fp`` generates
``fp`` once more after all modes: its PSNR against the first is ``inf`` when generation is
deterministic and the patches left nothing behind. Before each row's timed calls, ``--warmup``
one-step calls of the same shape absorb one-time costs (kernel compilation, allocator growth).

Per row: latency (mean seconds per video), speedup (fp latency / latency), PSNR (dB, one MSE over
all its frames against fp's, pixels in [0, 1]) and SSIM (``quantpatch.metrics.ssim``: Wang et al.
2004, 11x11 Gaussian window with sigma 1.5, each RGB channel of each frame, averaged) against
the fp video of the same prompt and seed; with ``--clip-model DIR`` (a local CLIP model) the CLIP
score ``100 * max(cos(image, text), 0)`` averaged over the strip frames, otherwise "not available".

Written to ``--out``: ``videos/ROW_pP_sS.mp4`` (imageio-ffmpeg installed) or ``.gif`` (PIL), the
frame strips ``strip_pP_sS.png`` (rows = fp and the modes, columns = ``--strip-frames`` frames
evenly spaced), ``run.json`` (machine, versions, git SHA, settings, per-video and per-row figures)
and ``summary.md`` (the table).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import time
from pathlib import Path

import torch

import quantpatch
from quantpatch.environment import environment_info, write_json
from quantpatch.metrics import psnr, ssim

logger = logging.getLogger("quantpatch.eval")

REPO = Path(__file__).resolve().parents[1]
TINY = ("wan",)


def load_prompts(path: str | Path) -> list[str]:
    """Prompts of a ``.jsonl`` file (``prompt`` field, else ``text``) or of a text file (non-empty lines)."""
    path = Path(path)
    lines = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if path.suffix != ".jsonl":
        return lines
    records = [json.loads(line) for line in lines]
    return [r["prompt"] if "prompt" in r else r["text"] for r in records]


def load_pipeline(args: argparse.Namespace):
    """``(pipe, conditioning)``: the pipeline on ``args.device`` in ``args.dtype`` and ``prompt -> call kwargs``."""
    dtype = getattr(torch, args.dtype)
    if args.tiny:
        from quantpatch.testing.diffusers_tiny import tiny_prompt_embeds, tiny_wan_pipeline

        pipe = tiny_wan_pipeline(head_dim=args.tiny_head_dim)[0].to(args.device, dtype)

        def conditioning(prompt: str) -> dict:
            return {"prompt_embeds": tiny_prompt_embeds(pipe, prompt),
                    "negative_prompt_embeds": tiny_prompt_embeds(pipe, args.negative_prompt or "")}

        return pipe, conditioning
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(args.pipeline, torch_dtype=dtype).to(args.device)
    pipe.set_progress_bar_config(disable=True)
    negative = {"negative_prompt": args.negative_prompt} if args.negative_prompt else {}
    return pipe, lambda prompt: {"prompt": prompt, **negative}


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def generate(pipe, kwargs: dict, seed: int, args: argparse.Namespace, steps: int | None = None):
    """``(frames, seconds)``: one video ``(F, C, H, W)`` float32 in [0, 1] on the CPU, and its wall time."""
    generator = torch.Generator().manual_seed(seed)
    _sync(args.device)
    start = time.perf_counter()
    out = pipe(**kwargs, height=args.height, width=args.width, num_frames=args.frames,
               num_inference_steps=steps or args.steps, guidance_scale=args.guidance, generator=generator,
               output_type="pt")
    _sync(args.device)
    return out.frames[0].float().cpu(), time.perf_counter() - start


def video_writer() -> str:
    """``"mp4"`` when imageio with its ffmpeg binary is installed, else ``"gif"`` (PIL)."""
    have_mp4 = all(importlib.util.find_spec(m) is not None for m in ("imageio", "imageio_ffmpeg"))
    return "mp4" if have_mp4 else "gif"


def save_video(frames: torch.Tensor, path: Path, fps: int) -> Path:
    """Write ``(F, C, H, W)`` frames in [0, 1] to ``path`` (its suffix picks mp4 or gif)."""
    from diffusers.utils import export_to_gif, export_to_video
    from PIL import Image

    pixels = (frames.clamp(0, 1).permute(0, 2, 3, 1) * 255).round().to(torch.uint8).numpy()  # (F, H, W, C)
    if path.suffix == ".mp4":
        export_to_video([p / 255.0 for p in pixels], str(path), fps=fps)
    else:
        export_to_gif([Image.fromarray(p) for p in pixels], str(path), fps=fps)
    return path


def strip_indices(num_frames: int, count: int) -> list[int]:
    """``count`` frame indices evenly spaced over ``num_frames`` (first and last included)."""
    count = min(count, num_frames)
    return sorted({round(i * (num_frames - 1) / max(count - 1, 1)) for i in range(count)})


def save_strip(videos: dict[str, torch.Tensor], labels: dict[str, str], indices: list[int], path: Path) -> Path:
    """A PNG grid: one row per video of ``videos`` (``(F, C, H, W)`` each), one column per frame index."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, cols = len(videos), len(indices)
    fig, axes = plt.subplots(rows, cols, figsize=(1.6 * cols + 1.2, 1.6 * rows), squeeze=False)
    for r, (name, frames) in enumerate(videos.items()):
        for c, index in enumerate(indices):
            ax = axes[r][c]
            ax.imshow(frames[index].clamp(0, 1).permute(1, 2, 0).numpy())
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_title(f"frame {index}", fontsize=8)
            if c == 0:
                ax.set_ylabel(labels[name], fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)
    return path


class ClipScorer:
    """CLIP score of video frames against a prompt, from a local CLIP model directory."""

    def __init__(self, directory: str | Path, device: str):
        from transformers import CLIPModel, CLIPProcessor

        self.model = CLIPModel.from_pretrained(directory).to(device).eval()
        self.processor = CLIPProcessor.from_pretrained(directory)
        self.device = device

    @torch.no_grad()
    def __call__(self, frames: torch.Tensor, prompt: str) -> float:
        """``100 * max(cos(image, text), 0)`` averaged over ``frames`` ``(N, C, H, W)`` in [0, 1]."""
        inputs = self.processor(text=[prompt], images=list(frames.clamp(0, 1)), return_tensors="pt", padding=True,
                                do_rescale=False, truncation=True).to(self.device)
        out = self.model(**inputs)  # image_embeds (N, P), text_embeds (1, P): projected and L2-normalized
        return float(100 * (out.image_embeds @ out.text_embeds.T).clamp_min(0).mean())


def run(args: argparse.Namespace) -> dict:
    """Generate every (row, prompt, seed), save videos and strips, measure; returns the JSON record."""
    out = Path(args.out)
    (out / "videos").mkdir(parents=True, exist_ok=True)
    prompts = load_prompts(args.prompts)[: args.max_prompts]
    pipe, conditioning = load_pipeline(args)
    writer = video_writer()
    clip = ClipScorer(args.clip_model, args.device) if args.clip_model else None
    jobs = [(p, seed) for p in range(len(prompts)) for seed in args.seeds]
    rows = ["fp", *args.modes] + (["fp-repeat"] if args.repeat_fp else [])
    videos: dict[tuple[str, int, int], torch.Tensor] = {}
    per_video, row_info = [], {}
    for row in rows:
        mode = None if row.startswith("fp") else row
        handle = quantpatch.patch_model(pipe, mode, policy="always") if mode else None
        try:
            for _ in range(args.warmup):
                generate(pipe, conditioning(prompts[0]), args.seeds[0], args, steps=1)
            for p, seed in jobs:
                frames, seconds = generate(pipe, conditioning(prompts[p]), seed, args)
                videos[row, p, seed] = frames
                path = save_video(frames, out / "videos" / f"{row}_p{p}_s{seed}.{writer}", args.fps)
                per_video.append({"row": row, "prompt": p, "seed": seed, "seconds": seconds,
                                  "video": str(path.relative_to(out))})
        finally:
            if handle is not None:
                row_info[row] = {"implementations": sorted({i for s in handle.sites for i in s.implementations}),
                                 "fallbacks": {site: sorted(why) for site, why in handle.fallbacks().items()}}
                handle.remove()
    indices = strip_indices(args.frames if not videos else next(iter(videos.values())).shape[0], args.strip_frames)
    for record in per_video:
        frames, ref = videos[record["row"], record["prompt"], record["seed"]], videos["fp", record["prompt"],
                                                                                      record["seed"]]
        record.update(psnr_db=psnr(frames, ref), ssim=ssim(frames, ref))
        if clip is not None:
            record["clip_score"] = clip(frames[indices], prompts[record["prompt"]])
    summary = {}
    fp_latency = _mean(r["seconds"] for r in per_video if r["row"] == "fp")
    for row in rows:
        mine = [r for r in per_video if r["row"] == row]
        latency = _mean(r["seconds"] for r in mine)
        stacked = torch.stack([videos[row, r["prompt"], r["seed"]] for r in mine])
        reference = torch.stack([videos["fp", r["prompt"], r["seed"]] for r in mine])
        summary[row] = {
            "latency_s": latency,
            "speedup": fp_latency / latency,
            "psnr_db": psnr(stacked, reference),
            "ssim": _mean(r["ssim"] for r in mine),
            "clip_score": _mean(r["clip_score"] for r in mine) if clip is not None else "not available",
            **row_info.get(row, {}),
        }
    for p, seed in jobs:
        shown = [r for r in rows if r != "fp-repeat"]
        labels = {r: r if r == "fp" else f"{r}\n{summary[r]['psnr_db']:.1f} dB" for r in shown}
        save_strip({r: videos[r, p, seed] for r in shown}, labels, indices, out / f"strip_p{p}_s{seed}.png")
    return {
        "environment": environment_info(args.device, REPO),
        "diffusers": __import__("diffusers").__version__,
        "pipeline": f"tiny {args.tiny} (random weights, built from config)" if args.tiny else str(args.pipeline),
        "pipeline_class": type(pipe).__name__,
        "config": {k: v for k, v in vars(args).items() if k != "func"},
        "video_format": writer,
        "strip_frames": indices,
        "prompts": prompts,
        "summary": summary,
        "videos": per_video,
    }


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def markdown(report: dict) -> str:
    """The summary table of ``report`` with the pipeline, sizes, machine and command."""
    cfg, env = report["config"], report["environment"]
    lines = [
        f"# Video generation: {report['pipeline']} ({report['pipeline_class']})",
        "",
        f"{len(report['prompts'])} prompt(s) x seeds {cfg['seeds']}, {cfg['frames']} frames of {cfg['height']}x"
        f"{cfg['width']}, {cfg['steps']} steps, guidance {cfg['guidance']}, {cfg['dtype']} on {env['device']} "
        f"({env['machine']}); torch {env['torch']}, diffusers {report['diffusers']}, git {env['git_sha']}. "
        f"Videos written as {report['video_format']}.",
        "",
        "| row | latency s | speedup vs fp | PSNR dB vs fp | SSIM vs fp | CLIP score | attention ran |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for row, s in report["summary"].items():
        clip = s["clip_score"] if isinstance(s["clip_score"], str) else f"{s['clip_score']:.2f}"
        ran = ", ".join(s.get("implementations", [])) or "pipeline's own"
        if s.get("fallbacks"):
            ran += f" (fallbacks at {len(s['fallbacks'])} sites)"
        db = "inf" if math.isinf(s["psnr_db"]) else f"{s['psnr_db']:.2f}"
        cells = [row, f"{s['latency_s']:.3f}", f"{s['speedup']:.2f}x", db, f"{s['ssim']:.5f}", clip, ran]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Command: `{env['command']}`"]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="quantpatch eval video", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--pipeline", help="Diffusers video pipeline directory")
    source.add_argument("--tiny", choices=TINY, help="a tiny pipeline built from config with random weights")
    parser.add_argument("--tiny-head-dim", type=int, default=32, help="--tiny: attention head dim (64: GPU kernels)")
    parser.add_argument("--prompts", required=True, help="text file (one prompt a line) or jsonl ('prompt' field)")
    parser.add_argument("--max-prompts", type=int, default=None)
    parser.add_argument("--negative-prompt", default=None)
    parser.add_argument("--modes", nargs="*", default=["sage2-8b", "sage2-4b"],
                        choices=[m for m in quantpatch.available_modes() if m != "off"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--frames", type=int, default=9)
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--guidance", type=float, default=5.0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--warmup", type=int, default=1, help="one-step calls before each row's timed calls")
    parser.add_argument("--repeat-fp", action="store_true", help="generate fp again last (determinism check)")
    parser.add_argument("--clip-model", default=None, help="local CLIP model directory for CLIP scores")
    parser.add_argument("--strip-frames", type=int, default=6, help="frames per row of the strip PNGs")
    parser.add_argument("--fps", type=int, default=8)
    parser.add_argument("--out", required=True, help="output directory")
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    report = run(args)
    write_json(Path(args.out) / "run.json", report)
    text = markdown(report)
    (Path(args.out) / "summary.md").write_text(text)
    print(text)
    return report


if __name__ == "__main__":
    main()
