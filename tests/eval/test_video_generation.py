"""``quantpatch eval video`` (``eval/video_generation.py``) end to end on the tiny Wan pipeline built from config:
every output written, figures finite, fp deterministic (a repeat after the modes is identical), sage2-8b not."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from quantpatch.cli import main as cli_main

pytest.importorskip("diffusers")
pytestmark = pytest.mark.usefixtures("one_cpu_thread")  # tests/conftest.py


def _tiny_clip(directory: Path) -> Path:
    """A random CLIP model (32x32 images) with a letters-only tokenizer, saved to ``directory``."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab = {t: i for i, t in enumerate(["<|startoftext|>", "<|endoftext|>", *letters, *(c + "</w>" for c in letters)])}
    images = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=images, tokenizer=CLIPTokenizer(vocab=vocab, merges=[])).save_pretrained(directory)
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    config = CLIPConfig(text_config=dict(vocab_size=len(vocab), max_position_embeddings=32, bos_token_id=0,
                                         eos_token_id=1, pad_token_id=1, **small),
                        vision_config=dict(image_size=32, patch_size=8, **small), projection_dim=16)
    CLIPModel(config).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("video")
    prompts = tmp / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "a red fox running through snow"}) + "\n")
    out = tmp / "out"
    cli_main(["eval", "video", "--tiny", "wan", "--prompts", str(prompts), "--modes", "sage2-8b", "--steps", "2",
              "--frames", "9", "--height", "64", "--width", "64", "--repeat-fp", "--device", "cpu",
              "--clip-model", str(_tiny_clip(tmp / "clip")), "--out", str(out)])
    return json.loads((out / "run.json").read_text()), out


def test_outputs_written(tiny_run):
    report, out = tiny_run
    fmt = report["video_format"]
    assert fmt in ("mp4", "gif")
    for row in ("fp", "sage2-8b", "fp-repeat"):
        video = out / "videos" / f"{row}_p0_s0.{fmt}"
        assert video.is_file() and video.stat().st_size > 0, video
    assert (out / "strip_p0_s0.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| sage2-8b |" in (out / "summary.md").read_text()
    assert report["environment"]["git_sha"] and report["pipeline_class"] == "WanPipeline"
    assert report["strip_frames"] == [0, 2, 3, 5, 6, 8]


def test_metrics_finite_and_fp_deterministic(tiny_run):
    summary = tiny_run[0]["summary"]
    for row, s in summary.items():
        assert math.isfinite(s["latency_s"]) and s["latency_s"] > 0 and math.isfinite(s["speedup"]), row
        assert math.isfinite(s["clip_score"]) and 0 <= s["clip_score"] <= 100, row
    # fp generated again after sage2-8b was patched in and removed: bitwise the same video
    assert summary["fp-repeat"]["psnr_db"] == math.inf and summary["fp-repeat"]["ssim"] == 1.0
    quant = summary["sage2-8b"]
    assert math.isfinite(quant["psnr_db"]) and 0 < quant["ssim"] < 1
    assert quant["implementations"] == ["reference"] and quant["fallbacks"] == {}
