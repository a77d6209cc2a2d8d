"""Checkpoints: save → load gives bitwise-identical logits, meta-device rebuild, clear errors; the CLI commands."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from quantpatch import checkpoint
from quantpatch.calibration import calibrate
from quantpatch.checkpoint import CheckpointError, info, load, save
from quantpatch.cli_commands import add_subcommands
from quantpatch.conversion import convert
from quantpatch.crs import CRS_FACTORS
from quantpatch.w4a8_linear import W4A8Linear
from tests.patches.conftest import TINY

ROOT = Path(__file__).resolve().parents[2]
PYDOC = ROOT.parent / "shared" / "models" / "pydoc-llama-21m"


def _model(tied=False, hidden=64, inter=128, vocab=128, dtype=torch.float32):
    import transformers as T

    torch.manual_seed(0)
    cfg = T.LlamaConfig(**{**TINY, "hidden_size": hidden, "intermediate_size": inter, "vocab_size": vocab},
                        num_key_value_heads=1, tie_word_embeddings=tied)
    return T.AutoModelForCausalLM.from_config(cfg).to(dtype).eval()


def _texts(n=3, vocab=128):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (20,), generator=g) for _ in range(n)]


def _converted(**kw):
    model = _model(**kw)
    stats = calibrate(model, _texts(vocab=model.config.vocab_size), "fireq", progress=False)
    convert(model, stats, "fireq", progress=False)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = _converted(tied=True)
    directory = save(model, tmp_path_factory.mktemp("ckpt") / "tiny")
    return model, directory


IDS = torch.randint(0, 128, (2, 23), generator=torch.Generator().manual_seed(5))


def test_round_trip_logits_are_bitwise_identical(saved, eval_attention):
    model, directory = saved
    loaded = load(directory, base_model=model.config)
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, model(IDS).logits)
        with eval_attention(model) as m:  # full recipe: W4A8 linears + CRS + INT4 KV + FP8 Q/P
            a = m(IDS).logits
        with eval_attention(loaded) as m:
            b = m(IDS).logits
    assert torch.equal(a, b)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # tied weights stay tied
    assert torch.equal(getattr(loaded.model.layers[0].self_attn, CRS_FACTORS),
                       getattr(model.model.layers[0].self_attn, CRS_FACTORS))
    state = loaded._quantpatch_state
    assert state.linears == model._quantpatch_state.linears and state.stats.tensors.keys() == \
        model._quantpatch_state.stats.tensors.keys()


def test_round_trip_bf16_and_patched_attention(tmp_path):
    model = _converted(dtype=torch.bfloat16)
    save(model, tmp_path)
    loaded = load(tmp_path, patch_attention=True, policy="always")
    assert loaded.model.layers[0].mlp.up_proj.scales.dtype == torch.float8_e4m3fn
    assert loaded.model.norm.weight.dtype == torch.bfloat16
    assert getattr(loaded, "_quantpatch_handle", None) is not None
    import quantpatch

    with quantpatch.patch_model(model, "fireq", policy="always"), torch.no_grad():
        expect = model(IDS).logits
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, expect)


def test_load_rebuilds_on_the_meta_device(saved):
    _, directory = saved
    config = checkpoint.read_config(directory)
    skeleton = checkpoint._skeleton(config, checkpoint._base_config(config, None))
    params = dict(skeleton.named_parameters())
    assert params and all(p.is_meta for p in params.values())
    w4a8 = [m for m in skeleton.modules() if isinstance(m, W4A8Linear)]
    assert len(w4a8) == 14 and all(m.qweight.is_meta and m.scales.is_meta for m in w4a8)


def test_weight_memory_over_3_5x_smaller_than_bf16(tmp_path):
    model = _converted(hidden=256, inter=512)  # input dims multiples of the 128 group
    save(model, tmp_path)
    summary = info(tmp_path, verify=True)
    assert summary["compression_vs_bf16"] >= 3.5
    loaded = load(tmp_path)
    packed = sum(m.weight_nbytes() for m in loaded.modules() if isinstance(m, W4A8Linear))
    bf16 = sum(m.in_features * m.out_features * 2 for m in loaded.modules() if isinstance(m, W4A8Linear))
    assert packed == summary["weight_bytes"] and bf16 / packed >= 3.5


# --------------------------------------------------------------------------- errors


def _copy(directory: Path, dest: Path) -> Path:
    dest.mkdir()
    for f in directory.iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    return dest


def test_missing_truncated_corrupted_files_are_named(saved, tmp_path):
    _, directory = saved
    d = _copy(directory, tmp_path / "missing")
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors is missing"):
        load(d)
    d = _copy(directory, tmp_path / "truncated")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match="truncated or corrupted"):
        load(d)
    d = _copy(directory, tmp_path / "flipped")
    data = bytearray((d / "model.safetensors").read_bytes())
    data[-5] ^= 0xFF
    (d / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256"):
        load(d)
    d = _copy(directory, tmp_path / "badjson")
    (d / "quantpatch_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load(d)
    with pytest.raises(CheckpointError, match="not a quantpatch checkpoint"):
        load(tmp_path)


def test_newer_version_and_mismatched_base_model(saved, tmp_path):
    _, directory = saved
    d = _copy(directory, tmp_path / "newer")
    config = json.loads((d / "quantpatch_config.json").read_text())
    config["version"] = checkpoint.CHECKPOINT_VERSION + 1
    (d / "quantpatch_config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="newer"):
        load(d)
    with pytest.raises(CheckpointError, match="hidden_size: checkpoint 64, base 256"):
        load(directory, base_model=_model(hidden=256).config)


def test_save_needs_a_converted_model(tmp_path):
    with pytest.raises(ValueError, match="converted"):
        save(_model(), tmp_path)


# --------------------------------------------------------------------------- CLI


@pytest.mark.skipif(not (PYDOC / "tokenizer.json").exists(), reason="needs the pydoc tokenizer")
def test_cli_calibrate_then_info(tmp_path, capsys):
    from transformers import AutoTokenizer

    model_dir = tmp_path / "model"
    _model(vocab=8192).save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(PYDOC).save_pretrained(model_dir)
    data = tmp_path / "calib.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n"}) for i in range(4)))
    parser = argparse.ArgumentParser(prog="quantpatch")
    add_subcommands(parser.add_subparsers(dest="command"))
    out = tmp_path / "ckpt"
    args = parser.parse_args(["calibrate", str(model_dir), "--mode", "fireq", "--data", str(data), "--samples", "3",
                              "--seq-len", "16", "--out", str(out)])
    args.func(args)
    args = parser.parse_args(["info", str(out), "--verify"])
    summary = args.func(args)
    text = capsys.readouterr().out
    assert "W4A8 linears    14" in text and summary["calibration"]["samples"] == 3
    assert load(out, base_model=model_dir)._quantpatch_state.mode.name == "fireq"
