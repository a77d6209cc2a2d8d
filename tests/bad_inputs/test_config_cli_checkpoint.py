"""Bad input to configs, the command line and checkpoints: a correct result or a clear error naming the problem.

Configs check every field's type and range; the CLI checks every argument (and reads its data) before a model
loads and prints one ``quantpatch: error: ...`` line (exit 2: command line, 1: a failure while running);
checkpoints name a bad version, key or base model in a few words. Version-1 configs keep their meaning.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import quantpatch as qp
from quantpatch import checkpoint
from quantpatch.checkpoint import CheckpointError, info, load, save
from quantpatch.cli import main
from quantpatch.config import CONFIG_VERSION, AttentionConfig, KVCacheConfig, LinearConfig, ModeConfig
from tests.patches.conftest import TINY

NAN, INF = float("nan"), float("inf")

# --------------------------------------------------------------------------- config fields


@pytest.mark.parametrize("mode, options, message", [
    ("turbo", {"sas_threshold": NAN}, r"AttentionConfig.sas_threshold must be finite, got nan"),
    ("turbo", {"sas_threshold": -INF}, r"sas_threshold must be finite"),
    ("turbo", {"sas_threshold": -1e9}, r"sas_threshold must be negative and >= -745.0, got -1000000000.0"),
    ("turbo", {"sas_threshold": "-6"}, r"sas_threshold must be a number, got '-6' \(str\)"),
    ("sage2-8b", {"smooth_q": "false"}, r"AttentionConfig.smooth_q must be a bool \(True or False\), got 'false'"),
    ("sage2-8b", {"smooth_k": 1}, r"smooth_k must be a bool \(True or False\), got 1 \(int\)"),
    ("sage2-8b", {"two_level_accum": None}, r"two_level_accum must be a bool"),
    ("sage2-8b", {"block_q": 64.0}, r"AttentionConfig.block_q must be an int, got 64.0 \(float\)"),
    ("sage2-8b", {"block_k": True}, r"block_k must be an int, got True \(bool\)"),
    ("sage2-8b", {"warps": 0}, r"AttentionConfig.warps must be >= 1, got 0"),
    ("sage2-8b", {"qk_qmax": -1}, r"qk_qmax must be >= 1, got -1"),
    ("sage2-8b", {"qk_format": None}, r"qk_format must be a str, got None"),
    ("sage2-8b", {"pv_format": "fp4"}, r"pv_format='fp4' is not valid; choose one of \['fp8_e4m3'"),
    ("int8-flash", {"pv_qmax": 300}, r"pv_qmax=300 exceeds the INT8 range"),
    ("turbo", {"bits": 4.0}, r"KVCacheConfig.bits must be an int, got 4.0"),
    ("turbo", {"bits": 3}, r"bits=3 is not valid; choose one of \[2, 4, 8\]"),
    ("turbo", {"low_bits": "2"}, r"low_bits must be an int, got '2' \(str\)"),
    ("turbo", {"two_bit_heads": NAN}, r"two_bit_heads must be finite"),
    ("turbo", {"two_bit_heads": True}, r"two_bit_heads must be a number, got True \(bool\)"),
    ("turbo", {"two_bit_heads": -1}, r"two_bit_heads must be >= 0, got -1"),
    ("turbo", {"two_bit_heads": 1.5}, r"two_bit_heads=1.5: an int is a head count, a float a fraction"),
    ("turbo", {"buffer_tokens": 0}, r"buffer_tokens must be >= 1, got 0"),
    ("turbo", {"int8_qmax": 128}, r"int8_qmax must be >= 1 and <= 127, got 128"),
    ("fireq", {"crs_pairs": -1}, r"crs_pairs must be >= 0, got -1"),
    ("fireq", {"crs_pairs": 2.5}, r"crs_pairs must be an int"),
    ("fireq", {"group_size": 0}, r"LinearConfig.group_size must be >= 1, got 0"),
    ("fireq", {"cas": "yes"}, r"LinearConfig.cas must be a bool"),
    ("fireq", {"include": "q_proj"}, r"LinearConfig.include must be a list of str, got 'q_proj'"),
    ("fireq", {"include": ["q_proj", 3]}, r"include must be a list of str values only, got \['q_proj', 3\] \(list\)"),
])
def test_every_field_is_type_and_range_checked(mode, options, message):
    with pytest.raises(ValueError, match=message):
        qp.get_mode(mode, **options)


@pytest.mark.parametrize("build, message", [
    (lambda: AttentionConfig(exp="taylor"), r"exp='taylor' is not valid; choose one of \['exact', 'sas'\]"),
    (lambda: KVCacheConfig(kind=None), r"KVCacheConfig.kind must be a str, got None"),
    (lambda: LinearConfig(kind="w8a8"), r"kind='w8a8' is not valid"),
    (lambda: ModeConfig(name=""), r"ModeConfig.name must be a non-empty string"),
    (lambda: ModeConfig(name=3), r"ModeConfig.name must be a str, got 3 \(int\)"),
    (lambda: ModeConfig(name="x", attention={}), r"ModeConfig.attention must be an instance of AttentionConfig"),
    (lambda: ModeConfig(name="x", version=True), r"ModeConfig.version must be an int, got True \(bool\)"),
])
def test_direct_construction_checks_every_field(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_valid_values_are_normalized_to_builtin_types():
    """A numpy int is an int (stored as ``int``: the JSON round trip works); ints and floats of two_bit_heads
    keep their distinct meanings (a head count, a fraction)."""
    np = pytest.importorskip("numpy")
    mode = qp.get_mode("turbo", block_q=np.int64(64), two_bit_heads=np.float64(0.25), include=["q_proj"])
    assert type(mode.attention.block_q) is int and type(mode.kv_cache.two_bit_heads) is float
    assert mode.linear.include == ("q_proj",)
    assert ModeConfig.from_json(mode.to_json()) == mode
    assert qp.get_mode("turbo", two_bit_heads=1).kv_cache.two_bit_heads == 1
    assert type(qp.get_mode("turbo", two_bit_heads=1.0).kv_cache.two_bit_heads) is float


@pytest.mark.parametrize("data, message", [
    ([1, 2], r"ModeConfig must be a JSON object \(dict\), got list"),
    ({"name": "x", "attention": "sage2"}, r"AttentionConfig must be a JSON object \(dict\), got str"),
    ({"name": "x", "version": "1"}, r"ModeConfig.version must be an int, got '1' \(str\)"),
    ({"name": "x", "version": 1.0}, r"ModeConfig.version must be an int, got 1.0 \(float\)"),
    ({"name": "x", "version": None}, r"ModeConfig.version must be an int, got None"),
    ({"name": "x", "version": 0}, r"ModeConfig.version must be >= 1, got 0"),
    ({"name": "x", "version": -3}, r"ModeConfig.version must be >= 1, got -3"),
    ({"name": "x", "version": CONFIG_VERSION + 1}, r"newer than this quantpatch understands"),
])
def test_mode_config_dicts_are_checked(data, message):
    with pytest.raises(ValueError, match=message):
        ModeConfig.from_dict(data)


# --------------------------------------------------------------------------- sage2-8b default, versions


def test_sage2_8b_is_sageattention2_hopper_recipe_and_sage2_4b_keeps_smooth_q():
    s8, s4 = qp.get_mode("sage2-8b").attention, qp.get_mode("sage2-4b").attention
    assert (s8.qk_format, s8.qk_granularity, s8.smooth_k, s8.smooth_q) == ("int8", "thread", True, False)
    assert (s8.pv_format, s8.v_granularity, s8.two_level_accum) == ("fp8_e4m3", "channel", True)
    assert s4.smooth_q and s4.smooth_k
    assert qp.get_mode("sage2-8b", smooth_q=True).attention.smooth_q  # still an option
    assert CONFIG_VERSION == 2 and qp.get_mode("sage2-8b").version == 2


def _v1(name: str, **attention) -> dict:
    """A ModeConfig dict as version 1 wrote it (every field stored)."""
    data = qp.get_mode(name).to_dict()
    data["attention"].update(attention)
    return {**data, "version": 1}


@pytest.mark.parametrize("stored, expected", [(True, True), (False, False), ("absent", True)])
def test_version_1_sage2_8b_configs_keep_their_meaning(stored, expected):
    data = _v1("sage2-8b", smooth_q=stored)
    if stored == "absent":
        del data["attention"]["smooth_q"]  # a hand-written v1 file: the v1 preset had smooth Q on
    mode = ModeConfig.from_dict(data)
    assert mode.attention.smooth_q is expected and mode.version == CONFIG_VERSION
    assert mode == qp.get_mode("sage2-8b", smooth_q=expected)
    assert ModeConfig.from_json(mode.to_json()) == mode  # rewritten at version 2, same meaning


def test_version_2_files_and_other_modes_are_not_migrated():
    data = qp.get_mode("sage2-8b").to_dict()
    del data["attention"]["smooth_q"]
    assert not ModeConfig.from_dict(data).attention.smooth_q
    v1_turbo = _v1("turbo")
    del v1_turbo["attention"]["smooth_q"]
    assert ModeConfig.from_dict(v1_turbo) == qp.get_mode("turbo")


# --------------------------------------------------------------------------- checkpoints


def _tiny(hidden=64):
    import transformers as T

    torch.manual_seed(0)
    cfg = T.LlamaConfig(**{**TINY, "hidden_size": hidden}, num_key_value_heads=1)
    return T.AutoModelForCausalLM.from_config(cfg).eval()


def _checkpoint(directory: Path, mode: str) -> Path:
    from quantpatch.calibration import calibrate
    from quantpatch.conversion import convert

    model = _tiny()
    g = torch.Generator().manual_seed(0)
    stats = calibrate(model, [torch.randint(0, 128, (20,), generator=g) for _ in range(3)], mode, progress=False)
    convert(model, stats, mode, progress=False)
    return save(model, directory)


@pytest.fixture(scope="module")
def turbo_ckpt(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("turbo") / "ckpt", "turbo")


@pytest.fixture(scope="module")
def fireq_ckpt(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("fireq") / "ckpt", "fireq")


def _edited(src: Path, dest: Path, edit) -> Path:
    dest.mkdir()
    for f in src.iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    config = json.loads((dest / checkpoint.CONFIG_FILE).read_text())
    edit(config)
    (dest / checkpoint.CONFIG_FILE).write_text(json.dumps(config))
    return dest


def test_info_of_a_turbo_checkpoint(turbo_ckpt, capsys):
    summary = info(turbo_ckpt)
    assert summary["kv_cache"] == "turbo" and summary["crs_pairs_per_head"] == 0
    assert summary["kv_head_bits"] == {"k": {4: 1, 2: 1}, "v": {4: 1, 2: 1}}  # 2 layers × 1 KV head, n_h = 0.5
    assert main(["info", str(turbo_ckpt)]) == 0
    assert "KV cache turbo, KV heads per bit width: K {4: 1, 2: 1}" in capsys.readouterr().out
    assert main(["info", str(turbo_ckpt), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_head_bits"] == {"k": {"4": 1, "2": 1}, "v": {"4": 1, "2": 1}}


def test_info_of_a_fireq_checkpoint_counts_crs_pairs(fireq_ckpt):
    summary = info(fireq_ckpt)
    assert (summary["kv_cache"], summary["crs_pairs_per_head"], summary["kv_head_bits"]) == ("fireq", 8, None)


@pytest.mark.parametrize("version, message", [
    ("1", r"checkpoint version must be an integer, got '1' \(str\)"),
    (1.0, r"checkpoint version must be an integer, got 1.0 \(float\)"),
    (None, r"checkpoint version must be an integer, got None"),
    (True, r"checkpoint version must be an integer, got True \(bool\)"),
    (0, r"checkpoint version 0 is not valid \(versions start at 1\)"),
    (-3, r"checkpoint version -3 is not valid"),
    (checkpoint.CHECKPOINT_VERSION + 1, r"newer than this quantpatch reads \(1\); upgrade quantpatch"),
])
def test_checkpoint_version_must_be_a_known_int(fireq_ckpt, tmp_path, version, message):
    d = _edited(fireq_ckpt, tmp_path / "ckpt", lambda c: c.update(version=version))
    with pytest.raises(CheckpointError, match=message):
        load(d)
    with pytest.raises(CheckpointError, match=message):
        info(d)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.pop("linears"), r"'linears' must be a JSON object, got None"),
    (lambda c: c.update(quantized="yes"), r"'quantized' must be a JSON boolean"),
    (lambda c: c["base_model"].pop("arch_hash"), r"'base_model' lacks its 'config' \(object\) or 'arch_hash'"),
    (lambda c: c["files"].update({"model.safetensors": {"bytes": "9"}}), r"files entry 'model.safetensors' needs"),
    (lambda c: c["mode"]["attention"].update(smooth_q="false"), r"invalid mode or options: .*smooth_q must be a bool"),
    (lambda c: c["mode"]["kv_cache"].update(crs_pairs=None), r"invalid mode or options: .*crs_pairs must be an int"),
])
def test_malformed_checkpoint_configs_name_the_key(fireq_ckpt, tmp_path, edit, message):
    d = _edited(fireq_ckpt, tmp_path / "ckpt", edit)
    with pytest.raises(CheckpointError, match=message):
        load(d)


@pytest.mark.parametrize("content, message", [
    (b"[1, 2]", r"is not a quantpatch checkpoint config \(format 'list'\)"),
    (b"\xff\xfe\x00binary", r"is not valid JSON"),
])
def test_a_config_file_that_is_not_a_json_object(tmp_path, content, message):
    (tmp_path / checkpoint.CONFIG_FILE).write_bytes(content)
    with pytest.raises(CheckpointError, match=message):
        load(tmp_path)


def test_version_1_mode_in_a_checkpoint_loads_with_its_meaning(fireq_ckpt, tmp_path):
    def to_v1_sage(config):
        config["mode"] = _v1("sage2-8b")
        del config["mode"]["attention"]["smooth_q"]

    d = _edited(fireq_ckpt, tmp_path / "v1", lambda c: c["mode"].update(version=1))
    assert load(d)._quantpatch_state.mode == qp.get_mode("fireq")
    d = _edited(fireq_ckpt, tmp_path / "v1-sage", to_v1_sage)
    assert load(d)._quantpatch_state.mode.attention.smooth_q is True


def test_base_model_mismatch_is_named_in_a_few_words(fireq_ckpt):
    import transformers as T

    wrong = _tiny(hidden=128)
    with pytest.raises(CheckpointError) as err:
        load(fireq_ckpt, base_model=wrong)
    text = str(err.value)
    assert "base model LlamaForCausalLM (model_type 'llama') does not match the checkpoint, made from " \
           "LlamaForCausalLM (model_type 'llama'): hidden_size: checkpoint 64, base 128" in text
    assert "LlamaDecoderLayer" not in text and "\n" not in text and len(text) < 400
    with pytest.raises(CheckpointError, match=r"model_type: checkpoint 'llama', base 'gpt2'$"):
        load(fireq_ckpt, base_model=T.GPT2Config())
    with pytest.raises(CheckpointError, match=r"base_model is a LlamaDecoderLayer without a Transformers config"):
        load(fireq_ckpt, base_model=wrong.model.layers[0])
    with pytest.raises(CheckpointError, match=r"base_model must be a path or hub id, .*; got a int"):
        load(fireq_ckpt, base_model=3)


# --------------------------------------------------------------------------- CLI


def _main(argv: list[str]) -> int:
    """``main``'s exit status, also where argparse exits (a bad argument: status 2, its usage message)."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


@pytest.fixture
def model_dir(tmp_path, monkeypatch):
    """A directory that looks like a model; loading one fails loudly, so a test sees whether a model was loaded."""
    import transformers

    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")

    def no_load(*args, **kwargs):
        raise AssertionError("MODEL LOADED")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_load)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_load)
    return d


def _calibrate(capsys, model_dir, data, *extra):
    code = _main(["calibrate", str(model_dir), "--data", str(data), "--out", str(model_dir.parent / "out"), *extra])
    err = capsys.readouterr().err
    assert "MODEL LOADED" not in err and "Traceback" not in err
    return code, err.strip().splitlines()[-1]


@pytest.mark.parametrize("lines, message", [
    ([b'{"text": "a b c"}', b"{not json"], r"calib.jsonl:2: not valid JSON \(Expecting property name"),
    ([b'{"text": "a"}', b"", b'["text"]'], r"calib.jsonl:3 has no 'text' field"),
    ([b'{"text": 5}'], r"calib.jsonl:1: 'text' must be a string, got int"),
    ([b'{"text": "a"}', b'{"text": "caf\xe9"}'], r"calib.jsonl:2: not UTF-8 text \(byte \d+\)"),
    ([b'{"text": ""}', b'{"text": "  "}'], r"calib.jsonl has no non-empty text to calibrate on"),
])
def test_calibrate_data_errors_name_file_and_line(capsys, model_dir, tmp_path, lines, message):
    data = tmp_path / "calib.jsonl"
    data.write_bytes(b"\n".join(lines))
    code, last = _calibrate(capsys, model_dir, data)
    assert code == 1 and last.startswith("quantpatch: error: ")
    assert re.search(message, last), last


def test_calibrate_binary_text_file(capsys, model_dir, tmp_path):
    data = tmp_path / "calib.bin"
    data.write_bytes(b"ok\nstill ok\n\x80\x81 binary")
    code, last = _calibrate(capsys, model_dir, data)
    assert code == 1 and "calib.bin:3: not UTF-8 text" in last


@pytest.mark.parametrize("extra, message", [
    (["--samples", "0"], "argument --samples: must be >= 1, got 0"),
    (["--samples", "x"], "argument --samples: expected an integer, got 'x'"),
    (["--seq-len", "1"], "argument --seq-len: must be >= 2, got 1"),
    (["--mode", "sage2-8b"], "argument --mode: invalid choice: 'sage2-8b' (choose from"),
    (["--rpn-alpha", "nan"], "argument --rpn-alpha: must be a finite number > 0, got 'nan'"),
    (["--crs-beta", "-1"], "argument --crs-beta: must be a finite number > 0, got '-1'"),
    (["--device", "cuda:99"], "argument --device: cuda:99: no such CUDA device"),
    (["--device", "gpu0"], "argument --device: 'gpu0' is not a torch device"),
])
def test_calibrate_arguments_are_checked_before_loading(capsys, model_dir, tmp_path, extra, message):
    data = tmp_path / "calib.jsonl"
    data.write_text('{"text": "a b c"}')
    code, last = _calibrate(capsys, model_dir, data, *extra)
    assert code == 2 and last.startswith("quantpatch calibrate: error: ") and message in last, last


def test_calibrate_paths_are_checked_before_loading(capsys, model_dir, tmp_path):
    data = tmp_path / "calib.jsonl"
    data.write_text('{"text": "a b c"}')
    taken = tmp_path / "a-file"
    taken.write_text("x")
    cases = [
        ([str(model_dir), "--data", str(data), "--out", str(taken)], f"argument --out: {taken} exists and is not a"),
        ([str(model_dir), "--data", str(data), "--out", str(taken / "sub")], f"cannot create {taken / 'sub'}: "),
        ([str(model_dir), "--data", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "o")], "does not exist"),
        ([str(model_dir), "--data", str(tmp_path), "--out", str(tmp_path / "o")], "is a directory (expected a file)"),
        ([str(tmp_path / "nomodel"), "--data", str(data), "--out", str(tmp_path / "o")], "model directory"),
        ([str(tmp_path), "--data", str(data), "--out", str(tmp_path / "o")], "is not a model directory (it has no"),
    ]
    for argv, message in cases:
        assert _main(["calibrate", *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and "MODEL LOADED" not in err, err


def test_calibrate_offers_only_the_modes_it_runs(capsys):
    from quantpatch.cli_commands import calibration_modes

    assert calibration_modes() == ["fireq", "turbo"]
    assert _main(["calibrate", "--help"]) == 0
    assert "--mode {fireq,turbo}" in capsys.readouterr().out


def test_fireq_options_with_turbo_are_a_usage_error(capsys, model_dir, tmp_path):
    data = tmp_path / "calib.jsonl"
    data.write_text('{"text": "a b c"}')
    code, last = _calibrate(capsys, model_dir, data, "--mode", "turbo", "--rpn-alpha", "0.5", "--no-rpn")
    assert code == 2
    assert last == "quantpatch: error: --no-rpn, --rpn-alpha apply to --mode fireq only (got --mode turbo)"


def test_debug_keeps_the_traceback(model_dir, tmp_path):
    data = tmp_path / "calib.jsonl"
    data.write_text("{oops")
    for argv in (["--debug", "calibrate"], ["calibrate", "--debug"]):
        with pytest.raises(ValueError, match="calib.jsonl:1: not valid JSON"):
            main([*argv, str(model_dir), "--data", str(data), "--out", str(tmp_path / "o")])


def test_info_errors_are_one_line(capsys, tmp_path):
    assert _main(["info", str(tmp_path / "missing")]) == 2
    assert "argument directory: " in capsys.readouterr().err
    assert main(["info", str(tmp_path)]) == 1
    assert capsys.readouterr().err == (f"quantpatch: error: {tmp_path / checkpoint.CONFIG_FILE} is missing: "
                                       f"{tmp_path} is not a quantpatch checkpoint\n")


@pytest.mark.parametrize("argv, message", [
    (["compare", "--heads", "3", "--kv-heads", "2"], "quantpatch: error: --heads 3 must be a multiple of --kv-heads 2"),
    (["compare", "--modes", "sage3"], "argument --modes: invalid choice: 'sage3'"),
    (["compare", "--seq-len", "0"], "argument --seq-len: must be >= 1, got 0"),
])
def test_compare_arguments(capsys, argv, message):
    assert _main(argv) == 2
    assert message in capsys.readouterr().err
