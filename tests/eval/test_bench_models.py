"""``eval/bench_models.py`` on the CPU: tiny configs of every family through the whole machinery (build on meta,
materialise, every column, files written), the layer cuts, and the token counts the real rows claim."""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch

from quantpatch.cli_commands import load_eval_script
from tests.gpu import needs_cuda

pytest.importorskip("diffusers")

ROWS = ["wan-1.3b", "cogvideox-5b", "flux-dev", "ltx-video", "llama3-8b-prefill-8k-b1", "llama3-8b-decode-b1-4k",
        "hunyuanvideo"]
MODES = ["sage2-8b", "turbo"]
DECODE_TOKENS = 4


@pytest.fixture(scope="module")
def bench():
    return load_eval_script("bench_models.py")


@pytest.fixture(scope="module")
def quick_run(bench, tmp_path_factory):
    pytest.importorskip("matplotlib")
    out = tmp_path_factory.mktemp("bench_models")
    # policy "always": the modes' PyTorch references run (under "speed" a CPU call takes SDPA)
    result = bench.main(["--device", "cpu", "--rows", *ROWS, "--modes", *MODES, "--reps", "1", "--policy", "always",
                         "--decode-tokens", str(DECODE_TOKENS), "--layers", "hunyuanvideo=2", "--out", str(out)])
    return result, out


def test_files_written(quick_run):
    result, out = quick_run
    for name in ("models.csv", "bench.json", "models.png", "summary.md"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert (out / "models.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    record = json.loads((out / "bench.json").read_text())
    machine = record["machine"]
    assert machine["git_sha"] and machine["torch"] and machine["diffusers"] and "bench_models" in machine["command"]
    assert record["config"]["modes"] == MODES
    assert "Command:" in (out / "summary.md").read_text()
    with (out / "models.csv").open(newline="") as f:
        assert len(list(csv.DictReader(f))) == len(result["rows"])


def test_every_row_and_column(bench, quick_run):
    result, _ = quick_run
    got = {(r["row"], r["column"]) for r in result["rows"]}
    diffusers_rows = {"wan-1.3b", "cogvideox-5b", "flux-dev", "ltx-video", "hunyuanvideo"}
    want = {(row, col) for row in ROWS for col in ["sdpa", "sdpa-cudnn", *MODES]}
    want |= {(row, "diffusers-sage") for row in diffusers_rows}
    assert got == want


def test_baseline_and_modes_measured(quick_run):
    result, _ = quick_run
    for r in result["rows"]:
        if r["kind"] != "decode" and "ms" in r:  # the host's time of a call: on the CPU, the call's own time
            assert 0 < r["host_ms"] <= r["ms"] * 1.001 + 1e-3, r
        if r["column"] == "sdpa":
            assert r["ms"] > 0 and r["speedup"] == 1.0 and r["finite"], r
        elif r["column"] in MODES:
            assert r["ms"] > 0 and r["speedup"] > 0 and r["finite"], r
            # the PyTorch references (or SDPA) in float32: the same function as the unpatched model
            assert r["cos_sim"] > 0.999 and r["rel_l1"] < 0.05, r
            report = r["report"]
            assert report["sites"] > 0 and report["text"].startswith(f"quantpatch mode '{r['column']}'")
            attention = [run for run in report["runs"] if not run.startswith("TurboCache")]  # turbo: its generate site
            assert attention and all(run.startswith(f"quantpatch {r['column']} attention") for run in attention), report
            assert r["column"] == "turbo" or attention == list(report["runs"]), report
            assert report["policy"] == "always" and report["routes"], report


def test_unavailable_columns_say_why(quick_run):
    result, _ = quick_run
    for r in result["rows"]:
        if r["column"] == "sdpa-cudnn":  # no cuDNN attention on a CPU
            assert "ms" not in r and r["skipped"], r
        if r["column"] == "diffusers-sage":
            try:
                import sageattention  # noqa: F401
            except ImportError:
                assert r["skipped"] == "sageattention is not installed"


def test_decode_times_steps_and_turbo_builds_its_cache(quick_run):
    result, _ = quick_run
    decode = {r["column"]: r for r in result["rows"] if r["row"] == "llama3-8b-decode-b1-4k"}
    assert decode["sdpa"]["steps"] == DECODE_TOKENS - 1  # intervals between the DECODE_TOKENS logits steps
    assert any("TurboCache" in note for note in decode["turbo"]["report"]["remarks"])
    # the INT4 cache changes the logits, the forced tokens keep them comparable step by step
    assert 0.99 < decode["turbo"]["cos_sim"] < 1.0


def test_layer_cut_is_reported(quick_run):
    result, _ = quick_run
    layers = {r["row"]: r["layers"] for r in result["rows"]}
    assert layers["hunyuanvideo"] == "layers 1+1 of 1+2"  # tiny HunyuanVideo: 1 double + 2 single blocks
    assert layers["wan-1.3b"] == "all"


def test_cut_layers(bench):
    wan, hunyuan = bench.MODELS["wan2.1-t2v-14b"], bench.MODELS["hunyuanvideo"]
    config, note = bench.cut_layers(wan, wan.config, 10)
    assert config["num_layers"] == 10 and note == "layers 10 of 40"
    config, note = bench.cut_layers(hunyuan, hunyuan.config, 6)
    assert (config["num_layers"], config["num_single_layers"]) == (2, 4) and note == "layers 2+4 of 20+40"
    assert bench.cut_layers(wan, wan.config, 40) == (wan.config, "")
    assert bench.cut_layers(wan, wan.config, None) == (wan.config, "")


def test_layer_cut_arguments(bench):
    assert bench.layer_cuts(["4", "wan-14b=10"]) == {None: 4, "wan-14b": 10}
    with pytest.raises(ValueError, match="unknown row"):
        bench.layer_cuts(["wan-99b=3"])


def test_real_rows_token_counts(bench):
    """The sequence lengths the rows claim, from the configs' patch sizes and the latent shapes."""
    rows = {r.name: r for r in bench.ROWS}

    def video_tokens(row) -> int:
        spec = bench.MODELS[row.model]
        patch = spec.config["patch_size"]
        pt, ph, pw = patch if isinstance(patch, tuple) else (spec.config.get("patch_size_t") or 1, patch, patch)
        latent = row.shape["latent"]
        frames, h, w = (latent[0], latent[2], latent[3]) if spec.family == "cogvideox" else latent[1:]
        return frames // pt * (h // ph) * (w // pw)

    assert video_tokens(rows["wan-1.3b"]) == 32760
    assert video_tokens(rows["wan-14b"]) == 75600
    assert video_tokens(rows["cogvideox-5b"]) + bench.COGVIDEOX_5B["max_text_seq_length"] == 17776
    assert video_tokens(rows["hunyuanvideo"]) == 67320
    assert math.prod(rows["flux-dev"].shape["grid"]) == 4096
    assert math.prod(rows["ltx-video"].shape["latent"]) == 6930  # packed latents: patch size 1
    for name, width in [("wan2.1-t2v-1.3b", 1536), ("wan2.1-t2v-14b", 5120), ("hunyuanvideo", 3072),
                        ("flux.1-dev", 3072), ("cogvideox-5b", 3072), ("ltx-video", 2048)]:
        config = bench.MODELS[name].config
        assert config["num_attention_heads"] * config["attention_head_dim"] == width, name


def test_materialize_gives_every_parameter_storage(bench):
    spec = bench.MODELS["wan2.1-t2v-1.3b"]
    model = bench.build_model(spec, bench.TINY["wan"], torch.device("cpu"), torch.bfloat16)
    assert not any(p.is_meta for p in model.parameters()) and not any(b.is_meta for b in model.buffers())
    for name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if pname == "bias":
                assert not p.any(), f"{name}.{pname}"
            elif bench._is_norm(module) and p.dim() == 1:
                assert (p == 1).all(), f"{name}.{pname}"
    kept = {n for n, p in model.named_parameters() if p.dtype == torch.float32}
    assert kept and all(set(n.split(".")) & set(model._keep_in_fp32_modules) for n in kept)  # as from_pretrained


def test_merge_keeps_earlier_rows(bench, quick_run, tmp_path):
    _, first = quick_run
    result = bench.main(["--device", "cpu", "--rows", "wan-1.3b", "--modes", "sage2-8b", "--reps", "1",
                         "--merge", str(first / "bench.json"), "--out", str(tmp_path)])
    rows = {r["row"] for r in result["rows"]}
    assert rows == set(ROWS)
    assert {r["column"] for r in result["rows"] if r["row"] == "wan-1.3b"} == {
        "sdpa", "sdpa-cudnn", "sage2-8b", "diffusers-sage"}  # the re-run row replaces the merged one
    merged = result["machine"]["merged"]
    assert len(merged) == 1 and "wan-1.3b" not in merged[0]["rows"] and "flux-dev" in merged[0]["rows"]


def test_rounds_time_every_column_in_turn_and_report_the_median(bench, tmp_path, monkeypatch):
    """``--rounds 3``: each column is timed three times, the columns in turn (forward, backward, forward); its ms is
    the median of the three, the CosSim the first round's; ``--profile`` profiles the first round only."""
    pytest.importorskip("matplotlib")
    order, profiled, timings = [], [], iter(range(1, 100))

    def fake_run_column(row, column, call, device, ref, args, model, profile=False):
        order.append(column)
        profiled.append(profile)
        out = torch.zeros(2)
        return {"column": column, "ms": float(next(timings)), "finite": True}, out

    monkeypatch.setattr(bench, "run_column", fake_run_column)
    result = bench.main(["--device", "cpu", "--rows", "llama3-8b-prefill-8k-b1", "--modes", "sage2-8b",
                         "--rounds", "3", "--profile", "--out", str(tmp_path)])
    columns = [bench.BASELINE, bench.CUDNN, "sage2-8b"]
    assert order == columns + columns[::-1] + columns
    assert profiled == [True] * 3 + [False] * 6
    rows = {r["column"]: r for r in result["rows"]}
    assert rows[bench.BASELINE]["ms_rounds"] == [1.0, 6.0, 7.0] and rows[bench.BASELINE]["ms"] == 6.0
    assert rows["sage2-8b"]["ms_rounds"] == [3.0, 4.0, 9.0] and rows["sage2-8b"]["ms"] == 4.0
    assert rows["sage2-8b"]["speedup"] == 6.0 / 4.0
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--rounds", "0", "--out", str(tmp_path)])


@pytest.mark.parametrize("exclude, kept, fp8", [
    (["ffn"], "excluded", ".attn2."),  # the named linears bf16, cross-attention FP8 (a filter replaces the default)
    ([], None, "both"),  # no substring: every block linear FP8
    (None, "cross-attention", ".ffn."),  # the library's default: cross-attention bf16
])
def test_linear_exclude_keeps_the_named_linears_of_the_fp8_columns(bench, tmp_path, exclude, kept, fp8):
    """``--linear-exclude``: the FP8 columns keep the named linears of Wan's blocks in bf16 (the report lists them as
    excluded) and swap the others, cross-attention included; with no substring every block linear is FP8; without
    the flag the cross-attention projections stay bf16 (``patch_model``'s default). It needs ``--linear``."""
    pytest.importorskip("matplotlib")
    flag = [] if exclude is None else ["--linear-exclude", *exclude]
    result = bench.main(["--device", "cpu", "--rows", "wan-1.3b", "--modes", "sage2-8b", "--reps", "1", "--policy",
                         "always", "--linear", "fp8", *flag, "--out", str(tmp_path)])
    reports = {r["column"]: r["report"]["text"] for r in result["rows"] if "report" in r}
    for column in ("off+fp8", "sage2-8b+fp8"):
        lines = [line for line in reports[column].splitlines()
                 if line.lstrip().startswith("linear") and (".attn2." in line or ".ffn." in line)]
        swapped = [line for line in lines if "FP8Linear" in line]
        assert lines and swapped == [line for line in lines if fp8 == "both" or fp8 in line], reports[column]
        assert all(kept and kept in line for line in lines if line not in swapped), reports[column]
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--linear-exclude", "attn2", "--out", str(tmp_path)])


def test_sage_column_restores_the_process_wide_backend(bench, monkeypatch):
    """``set_attention_backend`` also sets Diffusers' process-wide active backend: after the ``diffusers-sage``
    column every processor of every model (including ones built later) is back on the backend it had before."""
    import diffusers.models.attention_dispatch as dispatch
    from diffusers import WanTransformer3DModel

    monkeypatch.setattr(dispatch, "_check_attention_backend_requirements", lambda backend: None)  # no sageattention
    model = WanTransformer3DModel(num_layers=1, num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                  out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, rope_max_seq_len=32)
    before = dispatch._AttentionBackendRegistry._active_backend
    processors = [m.processor for m in model.modules() if hasattr(getattr(m, "processor", None), "_attention_backend")]
    assert processors
    with bench.column_setup(bench.SAGE, model, {}):
        assert dispatch._AttentionBackendRegistry._active_backend == dispatch.AttentionBackendName.SAGE
        assert all(p._attention_backend == dispatch.AttentionBackendName.SAGE for p in processors)
    assert dispatch._AttentionBackendRegistry._active_backend == before
    assert all(p._attention_backend is None for p in processors)


def test_gpu_busy_time_sums_the_device_events_only(bench):
    """``--profile``'s busy time is the device events' own time (kernels, copies), as the profiler's table sums it:
    not a CPU op's (its kernels' time again), not a user annotation's."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    averages = [SimpleNamespace(device_type=DeviceType.CUDA, self_device_time_total=1500.0, is_user_annotation=False),
                SimpleNamespace(device_type=DeviceType.CUDA, self_device_time_total=500.0, is_user_annotation=False),
                SimpleNamespace(device_type=DeviceType.CPU, self_device_time_total=2000.0, is_user_annotation=False),
                SimpleNamespace(device_type=DeviceType.CUDA, self_device_time_total=9000.0, is_user_annotation=True)]
    assert bench.gpu_busy_ms(averages) == 2.0


def test_profile_off_the_gpu_measures_nothing_more(bench, tmp_path):
    """``--profile`` on the CPU: no busy time (there is no GPU timeline), the table keeps its column blank."""
    result = bench.main(["--device", "cpu", "--rows", "llama3-8b-prefill-8k-b1", "--modes", "sage2-8b", "--reps", "1",
                         "--profile", "--out", str(tmp_path)])
    assert result["rows"] and not any("gpu_busy_ms" in r for r in result["rows"])
    assert "| GPU busy ms |" in (tmp_path / "summary.md").read_text()


@pytest.mark.gpu
@needs_cuda
def test_gpu_profile_gives_each_column_a_busy_time_within_its_time(bench, tmp_path):
    """On a GPU every measured column of a step / prefill row and of a decode row gets a busy time, positive and at
    most its time (the GPU cannot be busier than the wall clock), with a margin for the profiler's own clock."""
    result = bench.main(["--quick", "--rows", "llama3-8b-prefill-8k-b1", "llama3-8b-decode-b1-4k", "--modes",
                         "sage2-8b", "--profile", "--out", str(tmp_path)])
    measured = [r for r in result["rows"] if "ms" in r]
    assert {r["kind"] for r in measured} == {"prefill", "decode"}
    for r in measured:
        assert 0 < r["gpu_busy_ms"] <= r["ms"] * 1.1, r
