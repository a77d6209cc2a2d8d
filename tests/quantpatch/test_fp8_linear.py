"""FP8 linear layers (``linear="fp8"``): the reference numerics, ``FP8Linear``, the mode option and the model walk.

The reference must round exactly as e4m3 does (hand-computed values, torch's own ``float8_e4m3fn`` cast);
scales are exact (per token, per output channel); ``FP8Linear`` against a float64 ``nn.Linear`` meets the
bounds of ``tests/tolerances.py``. ``patch_model(..., linear="fp8")`` swaps exactly the transformer blocks'
linears of a tiny Llama and of tiny Diffusers transformers, and ``remove()`` restores them bitwise.
"""

import math
from pathlib import Path

import pytest
import torch
from torch import nn

import quantpatch as qp
from quantpatch.cli_commands import load_eval_script
from quantpatch.config import CONFIG_VERSION, LinearConfig, ModeConfig
from quantpatch.fallback import ORIGINAL_LINEAR_ROUTE, UnsupportedError, reset_fallback_warnings
from quantpatch.fp8_linear import (
    FP8_MIN_TOKENS,
    FP8_MIN_TOKENS_WIDE,
    FP8_WIDE_OUT,
    ROUTE_GPU,
    ROUTE_REFERENCE,
    FP8Linear,
    original_reason,
    scaled_mm_unsupported,
)
from quantpatch.kernels.fp8_linear.fp8_linear_ref import fp8_linear_ref, quantize_rows_fp8_ref
from quantpatch.metrics import cos_sim, rel_l1
from quantpatch.modes import MODES
from tests.gpu import assert_planned_calls_follow_the_whole_path, needs_cuda
from tests.patches.conftest import no_leaks, tiny_model  # noqa: F401  (no_leaks: a fixture, used by name)
from tests.tolerances import FP8_LINEAR_RANDN_COS_FLOOR, FP8_LINEAR_RANDN_REL_L1_CEIL

pytestmark = pytest.mark.usefixtures("one_cpu_thread")  # tests/conftest.py
gpu = pytest.mark.gpu

LLAMA_BLOCK_LINEARS = [f"model.layers.{i}.{name}" for i in range(2) for name in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
# tiny Llama logits, patched ("off" + FP8 linears) vs unpatched, token seeds 0-3: measured CosSim 0.99902-0.99928
# (14 quantized layers in a row on random weights: each adds its ≈ 3.7 % rel-L1 noise to the residual stream)
LLAMA_LOGITS_COS_FLOOR = 0.998
# tiny Diffusers transformers' output, weight seeds 0-3: measured Wan 0.999959-0.999971, CogVideoX 0.999980-0.999983
DIFFUSERS_OUTPUT_COS_FLOOR = 0.9999


def _randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _linear(k: int, n: int, seed: int = 0, bias: bool = True, dtype=torch.float32) -> nn.Linear:
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(_randn(n, k, seed=seed, scale=0.02))
        if bias:
            lin.bias.copy_(_randn(n, seed=seed + 1, scale=0.02))
    return lin.to(dtype)


def _linear_sites(handle) -> dict[str, object]:
    return {s.name: s for s in handle.sites if s.kind == "linear"}


# --------------------------------------------------------------------------- reference numerics


def test_reference_rounds_as_e4m3_by_hand():
    # absmax 448 → scale exactly 1: the quantized values are e4m3 roundings of the inputs themselves
    x = torch.tensor([[448.0, 1.0625, 1.1875, 3.3, -17.0, -19.0, 300.0, 2.0**-10, 1.5 * 2.0**-10, 0.0]])
    q, s = quantize_rows_fp8_ref(x)
    assert s.item() == 1.0 and q.dtype == torch.float8_e4m3fn
    # ties to even (1.0625 → 1, 1.1875 → 1.25, 17 → 16, 19 → 20); step 0.25 in [2, 4), 32 in [256, 448];
    # 2⁻¹⁰ is half the smallest subnormal 2⁻⁹ (→ 0), 1.5·2⁻¹⁰ rounds up to it
    assert q.float().tolist() == [[448.0, 1.0, 1.25, 3.25, -16.0, -20.0, 288.0, 0.0, 2.0**-9, 0.0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reference_equals_torchs_e4m3_cast_with_absmax_scales(dtype):
    x = _randn(37, 96, seed=3, scale=5.0).to(dtype)
    x[4] = 0.0
    q, s = quantize_rows_fp8_ref(x)
    absmax = x.float().abs().amax(dim=1, keepdim=True)
    expect_s = torch.where(absmax == 0, torch.ones_like(absmax), absmax / 448)  # an all-zero row: scale 1
    assert torch.equal(s, expect_s) and s.dtype == torch.float32
    cast = (x.float() / expect_s).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(q.view(torch.uint8), cast.view(torch.uint8))
    assert q.float().abs().amax(dim=1)[[0, 1, 2]].tolist() == [448.0] * 3 and not q[4].float().any()


def test_scales_are_per_token_and_per_output_channel():
    x, lin = _randn(6, 64, seed=1), _linear(64, 32, bias=False)
    fp8 = FP8Linear.from_linear(lin)
    w_q, w_s = quantize_rows_fp8_ref(lin.weight)
    assert torch.equal(fp8.weight_fp8.view(torch.uint8), w_q.view(torch.uint8))
    assert torch.equal(fp8.weight_scale, lin.weight.abs().amax(dim=1) / 448)
    assert torch.equal(fp8.weight_scale, w_s[:, 0])
    y = fp8(x)
    # a token scaled by 2^5 quantizes to the same e4m3 values with a 2^5 scale: only its output row scales, exactly
    x2 = x.clone()
    x2[2] *= 32
    y2 = fp8(x2)
    assert torch.equal(y2[2], y[2] * 32) and torch.equal(y2[[0, 1, 3, 4, 5]], y[[0, 1, 3, 4, 5]])
    # an output channel's weights scaled by 2^-3: only that output column scales, exactly
    with torch.no_grad():
        lin.weight[7] /= 8
    y3 = FP8Linear.from_linear(lin)(x)
    cols = [c for c in range(32) if c != 7]
    assert torch.equal(y3[:, 7], y[:, 7] / 8) and torch.equal(y3[:, cols], y[:, cols])


def test_reference_product_is_the_dequantized_product_accumulated_in_float32():
    x, lin = _randn(3, 5, 48, seed=2), _linear(48, 16)
    fp8 = FP8Linear.from_linear(lin)
    y = fp8_linear_ref(x, fp8.weight_fp8, fp8.weight_scale, fp8.bias)
    x_q, x_s = quantize_rows_fp8_ref(x.reshape(-1, 48))
    exact = (x_q.double() * x_s.double()) @ (fp8.weight_fp8.double() * fp8.weight_scale.double()[:, None]).t()
    exact = (exact + lin.bias.double()).reshape(3, 5, 16)
    assert y.shape == (3, 5, 16) and y.dtype == torch.float32
    assert torch.allclose(y.double(), exact, rtol=1e-6, atol=1e-7)  # float32 sums of exact products


# --------------------------------------------------------------------------- FP8Linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k,n", [(1, 64, 48), (33, 256, 96), (128, 1024, 512)])
def test_fp8_linear_close_to_linear_on_randn(m, k, n, dtype):
    lin = _linear(k, n, seed=k)
    x = _randn(m, k, seed=m)
    ref = nn.functional.linear(x.double(), lin.weight.double(), lin.bias.double())
    y = FP8Linear.from_linear(lin)(x.to(dtype))
    assert y.dtype == dtype and y.shape == (m, n)
    assert rel_l1(y.double(), ref) <= FP8_LINEAR_RANDN_REL_L1_CEIL
    assert cos_sim(y.double(), ref) >= FP8_LINEAR_RANDN_COS_FLOOR


def test_fp8_linear_keeps_bias_dtype_and_output_dtype():
    lin = _linear(32, 16, dtype=torch.bfloat16)
    fp8 = FP8Linear.from_linear(lin)
    assert fp8.bias.dtype == torch.bfloat16 and torch.equal(fp8.bias, lin.bias)
    assert FP8Linear.from_linear(_linear(32, 16, bias=False)).bias is None
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert fp8(_randn(2, 3, 32).to(dtype)).dtype == dtype
    assert fp8(torch.zeros(0, 32)).shape == (0, 16)


def test_cast_and_state_dict_keep_the_fp8_weight_and_float32_scales():
    lin = _linear(64, 32)
    fp8 = FP8Linear.from_linear(lin)
    x = _randn(4, 64, seed=5)
    before = fp8(x)
    weight, scale = fp8.weight_fp8.clone(), fp8.weight_scale.clone()
    fp8.to(torch.bfloat16)
    assert fp8.weight_fp8.dtype == torch.float8_e4m3fn and fp8.weight_scale.dtype == torch.float32
    assert torch.equal(fp8.weight_fp8.view(torch.uint8), weight.view(torch.uint8))
    assert torch.equal(fp8.weight_scale, scale)
    assert fp8.bias.dtype == torch.bfloat16
    fp8.float()
    fresh = FP8Linear(64, 32)
    fresh.load_state_dict(fp8.state_dict())
    assert torch.equal(fresh(x), fp8(x))
    assert rel_l1(fp8(x), before) < 1e-2  # only the bias went through bf16


def test_cpu_route_is_the_reference():
    assert scaled_mm_unsupported(torch.device("cpu"), torch.bfloat16, True) == "inputs are not CUDA tensors"


# --------------------------------------------------------------------------- config and get_mode


def test_get_mode_linear_option_selects_fp8_and_round_trips():
    mode = qp.get_mode("sage2-8b", linear="fp8")
    assert mode.linear == LinearConfig(kind="fp8") and mode.attention == MODES["sage2-8b"].attention
    assert mode.version == CONFIG_VERSION
    assert ModeConfig.from_json(mode.to_json()) == mode
    assert LinearConfig.from_dict(LinearConfig(kind="fp8").to_dict()) == LinearConfig(kind="fp8")
    assert qp.get_mode("fireq", linear="fp8").linear == LinearConfig(kind="fp8")
    assert qp.get_mode("sage2-8b", linear=None) is MODES["sage2-8b"]
    assert qp.get_mode(mode, linear="fp8") is mode  # already fp8: kept, include and all
    assert qp.get_mode("fireq", linear="none").linear.kind == "none"
    include = qp.get_mode("off", linear="fp8", **{"linear.include": ["mlp"]}).linear.include
    assert include == ("mlp",)


@pytest.mark.parametrize("bad", ["fp4", "FP8", "", 8])
def test_bad_linear_values_raise(bad):
    with pytest.raises(ValueError, match="linear=.* is not valid"):
        qp.get_mode("sage2-8b", linear=bad)
    with pytest.raises(ValueError):
        qp.patch_model(tiny_model("llama"), "off", linear=bad)


def test_linear_config_kind_is_validated():
    with pytest.raises(ValueError, match="LinearConfig.kind='int8' is not valid"):
        LinearConfig(kind="int8")


def test_fast_accumulation_is_an_fp8_option_that_round_trips():
    fast = LinearConfig(kind="fp8", fast_accum=True)
    assert LinearConfig().fast_accum is False and LinearConfig.from_dict(fast.to_dict()) == fast
    mode = qp.get_mode("sage2-8b", linear=fast)
    assert mode.linear is fast and ModeConfig.from_json(mode.to_json()) == mode
    old = {k: v for k, v in LinearConfig(kind="fp8").to_dict().items() if k != "fast_accum"}
    assert LinearConfig.from_dict(old) == LinearConfig(kind="fp8")  # a config written before the option: float32
    with pytest.raises(ValueError, match="fast_accum is an option of kind 'fp8', not of 'w4a8_fp8'"):
        LinearConfig(kind="w4a8_fp8", fast_accum=True)
    with pytest.raises(ValueError, match="fast_accum must be a bool"):
        LinearConfig(kind="fp8", fast_accum=1)


# --------------------------------------------------------------------------- patch_model(..., linear="fp8")


@pytest.mark.usefixtures("no_leaks")
def test_llama_block_linears_swapped_and_restored_bitwise():
    model = tiny_model("llama")
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
    before = dict(model.named_modules())
    handle = qp.patch_model(model, "off", linear="fp8", policy="always")
    swapped = sorted(n for n, m in model.named_modules() if isinstance(m, FP8Linear))
    assert swapped == sorted(LLAMA_BLOCK_LINEARS)
    assert type(model.lm_head) is nn.Linear and model.lm_head is before["lm_head"]
    for name in ("model.embed_tokens", "model.norm", "model.layers.0.input_layernorm", "model.layers.1.mlp.act_fn"):
        assert model.get_submodule(name) is before[name]
    with torch.no_grad():
        out = model(ids).logits
    assert cos_sim(out, ref) >= LLAMA_LOGITS_COS_FLOOR and not torch.equal(out, ref)
    sites = _linear_sites(handle)
    assert list(sites) == LLAMA_BLOCK_LINEARS
    assert all(s.routes == {ROUTE_REFERENCE: 1} and not s.fallbacks for s in sites.values())
    report = handle.report()
    assert "linear    model.layers.1.mlp.down_proj: quantpatch FP8Linear" in report
    assert "only its attention numerics" not in report
    handle.remove()
    assert all(model.get_submodule(n) is before[n] for n in LLAMA_BLOCK_LINEARS)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref)


@pytest.mark.usefixtures("no_leaks")
def test_speed_policy_calls_the_original_linear_where_fp8_cannot_be_faster():
    """On the CPU (the FP8 path is the reference there) every call runs the original layer, bitwise, and the report
    counts the route with why; on a GPU, calls below FP8_MIN_TOKENS tokens do, or below FP8_MIN_TOKENS_WIDE for
    layers of at least FP8_WIDE_OUT outputs (their GEMM saves more per activation quantized)."""
    model = tiny_model("llama")
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
    with qp.patch_model(model, "off", linear="fp8") as handle, torch.no_grad():
        assert handle.policy == "speed"
        assert torch.equal(model(ids).logits, ref)
        route = ORIGINAL_LINEAR_ROUTE + "the FP8 path off CUDA is the PyTorch reference"
        assert all(s.routes == {route: 1} and not s.implementations for s in _linear_sites(handle).values())
        assert handle.report().count(f"1 calls: {route}") == len(LLAMA_BLOCK_LINEARS), handle.report()
    narrow, wide = FP8_WIDE_OUT - 1, FP8_WIDE_OUT
    assert original_reason(FP8_MIN_TOKENS - 1, narrow, is_cuda=True) == f"fewer than {FP8_MIN_TOKENS} tokens"
    assert original_reason(FP8_MIN_TOKENS, narrow, is_cuda=True) is None
    assert original_reason(FP8_MIN_TOKENS_WIDE - 1, wide, is_cuda=True) == f"fewer than {FP8_MIN_TOKENS_WIDE} tokens"
    assert original_reason(FP8_MIN_TOKENS_WIDE, wide, is_cuda=True) is None
    assert original_reason(FP8_MIN_TOKENS_WIDE, narrow, is_cuda=True) is not None


@pytest.mark.usefixtures("no_leaks")
def test_a_linear_config_with_fast_accumulation_marks_every_swapped_layer():
    """``patch_model(..., linear=LinearConfig(kind="fp8", fast_accum=True))``: every FP8 layer takes the option (its
    repr and report say so); on the CPU the path is the float32-accumulation reference either way."""
    model = tiny_model("llama")
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(0))
    with qp.patch_model(model, "off", linear="fp8", policy="always"), torch.no_grad():
        plain = model(ids).logits
    fast = LinearConfig(kind="fp8", fast_accum=True)
    with qp.patch_model(model, "off", linear=fast, policy="always") as handle, torch.no_grad():
        layers = [m for m in model.modules() if isinstance(m, FP8Linear)]
        assert len(layers) == len(LLAMA_BLOCK_LINEARS) and all(m.fast_accum for m in layers)
        assert "fast_accum=True" in repr(layers[0])
        assert handle.report().count("activations per token, fast accumulation)") == len(LLAMA_BLOCK_LINEARS)
        assert torch.equal(model(ids).logits, plain)
    with qp.patch_model(model, "off", linear="fp8", policy="always"):
        assert not any(m.fast_accum for m in model.modules() if isinstance(m, FP8Linear))
    with pytest.raises(ValueError, match="W4A8 linears are made by quantpatch.convert"):
        qp.patch_model(model, "off", linear=LinearConfig(kind="w4a8_fp8"))


@pytest.mark.usefixtures("no_leaks")
def test_attention_mode_and_fp8_linears_together():
    model = tiny_model("llama")
    with qp.patch_model(model, "sage2-8b", linear="fp8", policy="always") as handle:
        assert handle.mode.linear.kind == "fp8" and handle.mode.attention == MODES["sage2-8b"].attention
        kinds = sorted({s.kind for s in handle.sites})
        assert kinds == ["attention", "linear"] and len(_linear_sites(handle)) == 14
    mode = qp.get_mode("off", linear="fp8")  # the linear part of a ModeConfig alone also swaps
    with qp.patch_model(model, mode):
        assert isinstance(model.model.layers[0].mlp.up_proj, FP8Linear)
    with qp.patch_model(model, mode, linear="none") as handle:  # the keyword overrides the mode's field
        assert not _linear_sites(handle) and type(model.model.layers[0].mlp.up_proj) is nn.Linear


@pytest.mark.usefixtures("no_leaks")
def test_linear_filters_and_report():
    model = tiny_model("llama")
    with qp.patch_model(model, "off", linear="fp8", linear_include=["mlp"], linear_exclude=["layers.1"]) as handle:
        swapped = sorted(n for n, m in model.named_modules() if isinstance(m, FP8Linear))
        assert swapped == ["model.layers.0.mlp.down_proj", "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]
        runs = {n: s.runs for n, s in _linear_sites(handle).items()}
        assert runs["model.layers.0.self_attn.q_proj"] == "original nn.Linear (excluded)"
        assert runs["model.layers.1.mlp.up_proj"] == "original nn.Linear (excluded)"
        assert len(runs) == 14
    mode = qp.get_mode("off", linear="fp8", **{"linear.include": ["self_attn.o_proj"]})
    with qp.patch_model(model, mode):
        swapped = [n for n, m in model.named_modules() if isinstance(m, FP8Linear)]
        assert swapped == ["model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj"]


@pytest.mark.usefixtures("no_leaks")
def test_a_string_filter_is_one_substring_and_other_types_raise():
    """``linear_exclude="layers.1"`` (or ``include=...``) is the one substring, not its characters (which would match
    almost every name); a filter that is not strings raises ``TypeError`` naming the argument, patching nothing."""
    model = tiny_model("llama")
    with qp.patch_model(model, "off", linear="fp8", linear_exclude="layers.1") as handle:
        swapped = sorted(n for n, m in model.named_modules() if isinstance(m, FP8Linear))
        assert swapped and all(".layers.0." in n for n in swapped) and len(swapped) == 7
    with qp.patch_model(model, "sage2-8b", include="layers.1") as handle:
        attention = [s.name for s in handle.sites if s.kind == "attention" and "excluded" not in s.runs]
        assert attention == ["model.layers.1.self_attn"]
    for keyword, value, match in (("linear_exclude", 3, "linear_exclude takes a list"),
                                  ("include", ["layers.0", 1], "include takes name substrings")):
        with pytest.raises(TypeError, match=match):
            qp.patch_model(model, "off", linear="fp8", **{keyword: value})
    assert not any(isinstance(m, FP8Linear) for m in model.modules())


@pytest.mark.parametrize("kind", ["fp8", "w4a8"])
def test_an_input_of_the_wrong_width_raises_naming_the_layer(kind):
    """As ``nn.Linear`` refuses it, before any implementation reshapes it (which failed with a reshape error)."""
    from quantpatch.w4a8_linear import W4A8Linear

    layer = (FP8Linear if kind == "fp8" else W4A8Linear).from_linear(nn.Linear(128, 32))
    with pytest.raises(ValueError, match=r"Linear\(128->32\): input of shape \(4, 64\), the layer takes 128"):
        layer(torch.randn(4, 64))
    assert layer(torch.randn(3, 128)).shape == (3, 32) and layer(torch.randn(128)).shape == (32,)


def test_linear_keyword_misuse_raises():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="quantpatch.convert"):
        qp.patch_model(model, "off", linear="w4a8_fp8")
    with pytest.raises(ValueError, match="pass linear='fp8'"):
        qp.patch_model(model, "sage2-8b", linear_include=["mlp"])
    assert not any(isinstance(m, FP8Linear) for m in model.modules())


@pytest.mark.usefixtures("no_leaks")
def test_a_model_cast_while_patched_gets_its_original_linears_back_cast():
    """``model.to(...)`` while patched reaches the kept originals: ``remove()`` restores layers that match the model."""
    model = tiny_model("llama")
    handle = qp.patch_model(model, "off", linear="fp8", policy="always")
    model.to(torch.float64)
    handle.remove()
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    with torch.no_grad():
        assert model(torch.randint(0, 128, (1, 5))).logits.dtype == torch.float64


@pytest.mark.usefixtures("no_leaks")
def test_a_linear_with_forward_hooks_keeps_its_module_and_hooks():
    model = tiny_model("llama")
    calls = []
    layer = model.model.layers[0].mlp.up_proj
    hook = layer.register_forward_hook(lambda module, args, out: calls.append(out.shape))
    reset_fallback_warnings()
    with pytest.warns(qp.QuantpatchFallbackWarning, match="model.layers.0.mlp.up_proj: forward hooks on the layer"):
        handle = qp.patch_model(model, "off", linear="fp8", policy="always")
    with handle, torch.no_grad():
        assert model.model.layers[0].mlp.up_proj is layer and isinstance(model.model.layers[0].mlp.down_proj, FP8Linear)
        model(torch.randint(0, 128, (1, 5)))
    assert calls == [torch.Size([1, 5, 128])]
    hook.remove()


def test_block_without_plain_linears_is_noted():
    model = tiny_model("gpt2")  # GPT-2's projections are Conv1D modules
    with qp.patch_model(model, "off", linear="fp8") as handle:
        assert not _linear_sites(handle)
        assert any("no nn.Linear" in note for note in handle.remarks)


# --------------------------------------------------------------------------- Diffusers


def _diffusers(name):
    pytest.importorskip("diffusers")
    from quantpatch.testing.diffusers_tiny import tiny_transformer

    return tiny_transformer(name)


def test_wan_block_linears_swapped_and_restored_bitwise():
    """Every linear of Wan's blocks but those of its text cross-attention (``attn2``, kept bf16 by default) becomes
    FP8; ``linear_exclude=[]`` swaps those too; ``remove()`` gives the original bits back."""
    model, call = _diffusers("WanTransformer3DModel")
    ref = call()
    linears = {n for n, m in model.named_modules() if type(m) is nn.Linear}
    blocks = {n for n in linears if n.startswith("blocks.")}
    cross = {n for n in blocks if ".attn2." in n}
    assert len(blocks) == 20 and len(cross) == 8 and "proj_out" in linears - blocks
    for exclude, expected in ((None, blocks - cross), ([], blocks)):
        handle = qp.patch_model(model, "off", linear="fp8", policy="always", linear_exclude=exclude)
        assert {n for n, m in model.named_modules() if isinstance(m, FP8Linear)} == expected
        sites = _linear_sites(handle)
        assert set(sites) == blocks
        assert {n for n, s in sites.items() if "cross-attention: kept bf16" in s.runs} == blocks - expected
        out = call()
        assert cos_sim(out, ref) >= DIFFUSERS_OUTPUT_COS_FLOOR
        handle.remove()
        assert torch.equal(call(), ref)


def test_feed_forward_gelu_moves_into_the_second_fp8_linear(monkeypatch):
    """Wan's feed-forwards (``net = [GELU(proj, tanh), Dropout(0), Linear]``): ``net[0].gelu`` becomes the identity
    and ``net[2]`` applies the GELU as it quantizes; names and state-dict keys stay; the output is bitwise the
    unfused FP8 model's (the reference path applies the same ``F.gelu``); ``remove()`` takes both changes back.
    Under ``policy="speed"`` the CPU calls each original layer, the GELU before the second: the unpatched bits."""
    from quantpatch.patches import linears

    model, call = _diffusers("WanTransformer3DModel")
    ref, keys = call(), set(model.state_dict())
    with monkeypatch.context() as unfused:
        unfused.setattr(linears, "fuse_feed_forward_gelus", lambda root, handle: 0)
        with qp.patch_model(model, "off", linear="fp8", policy="always"):
            expected = call()
    with qp.patch_model(model, "off", linear="fp8", policy="always") as handle:
        for i in range(2):
            ff = model.blocks[i].ffn
            assert ff.net[0].gelu is linears._pre_activation and isinstance(ff.net[0].proj, FP8Linear)
            assert ff.net[2].activation == "gelu_tanh" and ff.net[0].proj.activation is None
        assert "the GELU of 2 feed-forwards runs in their second FP8 linear's activation" in handle.report()
        assert {k.removesuffix("_fp8") for k in model.state_dict() if "weight_scale" not in k} == keys
        assert torch.equal(call(), expected) and not torch.equal(expected, ref)
    assert all("gelu" not in vars(model.blocks[i].ffn.net[0]) for i in range(2))
    assert torch.equal(call(), ref)
    with qp.patch_model(model, "off", linear="fp8") as handle:
        assert model.blocks[0].ffn.net[2].activation == "gelu_tanh"
        assert torch.equal(call(), ref)


@pytest.mark.parametrize("name, fused", [("CogVideoXTransformer3DModel", 2), ("FluxTransformer2DModel", 2),
                                         ("HunyuanVideoTransformer3DModel", 2), ("LTXVideoTransformer3DModel", 2),
                                         ("SD3Transformer2DModel", 3),
                                         pytest.param("MochiTransformer3DModel", 0, marks=pytest.mark.filterwarnings(
                                             "ignore:In CPU autocast", "ignore:FP8 linear transformer_blocks"))])
def test_other_diffusers_feed_forwards_fuse_their_gelu_with_the_unfused_output(name, fused, monkeypatch):
    """Every tiny Diffusers transformer whose feed-forwards are GELU ones fuses them (Mochi's tiny ones are odd-sized
    and stay bf16: none), and its FP8 output is bitwise the unfused one's on the reference path."""
    from quantpatch.patches import linears

    model, call = _diffusers(name)
    with monkeypatch.context() as unfused:
        unfused.setattr(linears, "fuse_feed_forward_gelus", lambda root, handle: 0)
        with qp.patch_model(model, "off", linear="fp8", policy="always"):
            expected = call()
    with qp.patch_model(model, "off", linear="fp8", policy="always") as handle:
        assert sum(m.activation is not None for m in model.modules() if isinstance(m, FP8Linear)) == fused
        assert (f"the GELU of {fused} feed-forwards" in handle.report()) == bool(fused)
        assert torch.equal(call(), expected)


@pytest.mark.parametrize("change", ["exclude the second linear", "a hook on the GELU", "dropout"])
def test_feed_forwards_that_do_not_match_keep_their_gelu(change):
    """No fusion where the second linear stays bf16, where a hook would see the GELU's output, or where the dropout
    between them is not the identity; the FP8 output then is the unfused one."""
    model, call = _diffusers("WanTransformer3DModel")
    exclude = ["ffn.net.2"] if change == "exclude the second linear" else None
    if change == "a hook on the GELU":
        model.blocks[0].ffn.net[0].register_forward_hook(lambda module, args, out: None)
    if change == "dropout":
        model.blocks[0].ffn.net[1].p = 0.1
    with qp.patch_model(model, "off", linear="fp8", policy="always", linear_exclude=exclude) as handle:
        ff = model.blocks[0].ffn
        assert "gelu" not in vars(ff.net[0])
        assert not isinstance(ff.net[2], FP8Linear) or ff.net[2].activation is None
        fused = 0 if exclude else 1  # block 1 keeps its plain feed-forward except when every second linear is bf16
        assert (f"the GELU of {fused} feed-forwards" in handle.report()) == bool(fused)


def test_norm_and_embedding_linears_are_kept():
    model, call = _diffusers("CogVideoXTransformer3DModel")
    ref = call()
    with qp.patch_model(model, "off", linear="fp8", policy="always") as handle:
        swapped = {n for n, m in model.named_modules() if isinstance(m, FP8Linear)}
        kept = {n for n, m in model.named_modules() if type(m) is nn.Linear}
        assert swapped == {f"transformer_blocks.{i}.{s}" for i in range(2) for s in (
            "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "ff.net.0.proj", "ff.net.2")}
        assert {"transformer_blocks.0.norm1.linear", "patch_embed.text_proj", "time_embedding.linear_1",
                "norm_out.linear", "proj_out"} <= kept
        assert set(_linear_sites(handle)) == swapped
        assert cos_sim(call(), ref) >= DIFFUSERS_OUTPUT_COS_FLOOR
    assert torch.equal(call(), ref)


def test_pipeline_patches_only_the_transformer_linears():
    pytest.importorskip("diffusers")
    from quantpatch.testing.diffusers_tiny import tiny_wan_pipeline

    pipe, _, _, _ = tiny_wan_pipeline()
    others = {part: dict(getattr(pipe, part).named_modules()) for part in ("text_encoder", "vae")}
    with qp.patch_model(pipe, "off", linear="fp8") as handle:
        assert len(_linear_sites(handle)) == 20
        assert sum(isinstance(m, FP8Linear) for m in pipe.transformer.modules()) == 12  # cross-attention kept bf16
        for part, modules in others.items():
            assert dict(getattr(pipe, part).named_modules()) == modules
            assert not any(isinstance(m, FP8Linear) for m in getattr(pipe, part).modules())
    assert not any(isinstance(m, FP8Linear) for m in pipe.transformer.modules())


@pytest.mark.filterwarnings("ignore:In CPU autocast")  # Mochi's own RoPE autocast
def test_shapes_scaled_mm_cannot_take_keep_their_linear_with_a_warning_or_raise_under_strict():
    model, call = _diffusers("MochiTransformer3DModel")
    ref = call()
    reset_fallback_warnings()
    with pytest.warns(qp.QuantpatchFallbackWarning) as warned:
        handle = qp.patch_model(model, "off", linear="fp8")
    messages = [str(w.message) for w in warned]
    assert len(messages) == 6 and "FP8 linear transformer_blocks.0.ff.net.2: in_features=170 is not a multiple of 16 " \
        "(torch._scaled_mm); falling back to the original nn.Linear" in messages
    sites = _linear_sites(handle)
    kept = {n: s for n, s in sites.items() if s.runs == "original nn.Linear"}
    assert set(kept) == {f"transformer_blocks.{i}.{s}" for i in range(2) for s in ("ff.net.0.proj", "ff.net.2")} | {
        "transformer_blocks.0.ff_context.net.0.proj", "transformer_blocks.0.ff_context.net.2"}
    assert kept["transformer_blocks.1.ff.net.0.proj"].fallbacks == {
        "out_features=340 is not a multiple of 16 (torch._scaled_mm)"}
    assert all(type(model.get_submodule(n)) is nn.Linear for n in kept)
    assert "fallback: in_features=170 is not a multiple of 16" in handle.report()
    assert handle.fallbacks()["transformer_blocks.0.ff.net.2"]
    handle.remove()
    assert torch.equal(call(), ref)
    with pytest.raises(UnsupportedError, match="transformer_blocks.0.ff.net.0.proj"):
        qp.patch_model(model, "off", linear="fp8", strict=True)
    assert not any(isinstance(m, FP8Linear) for m in model.modules())  # the failed call undid its swaps
    assert torch.equal(call(), ref)


# --------------------------------------------------------------------------- eval/perplexity.py --linear fp8

SHARED = Path(__file__).resolve().parents[2].parent / "shared"


def test_perplexity_script_scores_every_mode_again_with_fp8_linears(tmp_path):
    script = load_eval_script("perplexity.py")
    assert script.rows(["off", "turbo:turbo4"], "fp8") == [
        ("off", None), ("turbo:turbo4", None), ("off+fp8", "fp8"), ("turbo+fp8:turbo4", "fp8")]
    assert script.rows(["off"], None) == [("off", None)]
    model, data = SHARED / "models" / "pydoc-llama-21m", SHARED / "data" / "pydoc-val.jsonl"
    if not (model.is_dir() and data.is_file()):
        pytest.skip(f"needs {model} and {data} (../shared)")
    report = script.main(["--model", str(model), "--data", str(data), "--max-tokens", "512", "--window", "256",
                          "--device", "cpu", "--modes", "off", "--linear", "fp8", "--out", str(tmp_path / "p.json")])
    results = report["results"]
    assert list(results) == ["off", "off+fp8"]
    # 16k tokens (the README's setting) measured +0.29 %; 512 tokens are noisier
    assert 0 < abs(results["off+fp8"]["delta_pct"]) < 2


# --------------------------------------------------------------------------- GPU path


@gpu
@needs_cuda
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m", [1, 7, 33, 512])
def test_gpu_scaled_mm_path_matches_the_reference(m, bias):
    lin = _linear(4096, 1408, seed=m, bias=bias, dtype=torch.bfloat16).cuda()
    fp8 = FP8Linear.from_linear(lin)
    x = _randn(m, 4096, seed=m).to("cuda", torch.bfloat16)
    assert scaled_mm_unsupported(x.device, x.dtype, bias) is None, scaled_mm_unsupported(x.device, x.dtype, bias)
    y = fp8(x)
    ref = fp8_linear_ref(x, fp8.weight_fp8, fp8.weight_scale, fp8.bias)
    assert y.dtype == torch.bfloat16 and y.shape == (m, 1408)
    # the same products summed in another order, both rounded to bf16 at the end: a few elements one bf16 ulp apart
    assert rel_l1(y.float(), ref.float()) <= 1e-3


@gpu
@needs_cuda
@pytest.mark.parametrize("activation", [None, "gelu_tanh"])
@pytest.mark.parametrize("shape", [(1, 1536), (2, 300, 1536), (4096, 8960)])
def test_gpu_planned_calls_give_the_general_paths_bits(shape, activation, monkeypatch):
    """From the second call of an input signature on, ``FP8Linear`` runs that signature's planned call
    (``dispatch.LinearPlans``: the quantization's bound launch and ``torch._scaled_mm``, no dispatch): on new input
    contents the bits of the whole path, counted on the layer's site."""
    from quantpatch import fp8_linear
    from quantpatch.fallback import SiteRecord

    k = shape[-1]
    fp8 = FP8Linear.from_linear(_linear(k, 1024, seed=k, bias=True, dtype=torch.bfloat16).cuda())
    fp8.activation = activation
    fp8.site = SiteRecord("layer", "linear", "fp8")
    xs = [_randn(math.prod(shape[:-1]), k, seed=i).view(shape).to("cuda", torch.bfloat16) for i in range(3)]
    assert_planned_calls_follow_the_whole_path(fp8, xs, fp8_linear, monkeypatch)
    assert fp8.site.routes == {ROUTE_GPU: 6}


@gpu
@needs_cuda
@pytest.mark.parametrize("k", [1536, 4096, 14336])
def test_gpu_fast_accumulation_stays_within_its_documented_error(k):
    """``fast_accum=True`` runs ``torch._scaled_mm`` with the tensor cores' own accumulation: not the reference's
    bits, but within the error ``LinearConfig`` documents: on rows of mixed signs near the float32 reference (measured
    on an H100: relative L1 +4e-4 at K = 1536 up to +1.7e-3 at K = 14336, before the bf16 output rounding); on a sum
    whose K products all have one sign, low by up to K / 2^15 of it (measured: 5 % at K = 4096, 17 % at 14336)."""
    lin = _linear(k, 1024, seed=k, dtype=torch.bfloat16).cuda()
    fp8 = FP8Linear.from_linear(lin)
    x = _randn(512, k, seed=k + 7).to("cuda", torch.bfloat16)
    x[0] = lin.weight[0].detach()  # row 0, output 0: a sum of squares (no gradient to record: the kernels run)
    exact = fp8(x)
    fp8.fast_accum = True
    fast = fp8(x)
    ref = fp8_linear_ref(x, fp8.weight_fp8, fp8.weight_scale, fp8.bias).float()
    assert rel_l1(exact.float(), ref) <= 1e-3
    assert rel_l1(fast[1:].float(), ref[1:]) <= 4e-3
    coherent = ref[0, 0] - lin.bias[0].float()
    assert coherent > 0 and abs(fast[0, 0].float() - ref[0, 0]) <= k / 2**15 * coherent
    assert not torch.equal(fast, exact)


@gpu
@needs_cuda
def test_gpu_patched_llama_routes_to_scaled_mm_and_compiles_without_graph_breaks():
    model = tiny_model("llama").to("cuda", torch.bfloat16)
    ids = torch.randint(0, 128, (1, 64), device="cuda")
    with qp.patch_model(model, "off", linear="fp8", policy="always") as handle:
        with torch.no_grad():
            model(ids)
        assert all(s.routes == {ROUTE_GPU: 1} for s in _linear_sites(handle).values()), handle.report()
        layer = model.model.layers[0].mlp.down_proj
        x = torch.randn(3, 17, 128, device="cuda", dtype=torch.bfloat16)
        compiled = torch.compile(layer, fullgraph=True)
        assert torch.equal(compiled(x), layer(x))


@gpu
@needs_cuda
def test_gpu_feed_forward_with_its_gelu_in_the_quantization_matches_the_unfused_one():
    """A Wan2.1-1.3B-sized Diffusers feed-forward (1,536 → 8,960 → 1,536, tanh GELU) in bf16 on 4,096 tokens, both
    linears FP8: with the GELU moved into the second layer's quantization kernel (one launch), the output is the
    unfused one's up to the GELUs' last-bit differences, and the fused layer also compiles without graph breaks."""
    pytest.importorskip("diffusers")
    from diffusers.models.attention import FeedForward

    from quantpatch.patches.linears import _pre_activation

    torch.manual_seed(0)
    ff = FeedForward(1536, inner_dim=8960, activation_fn="gelu-approximate").to("cuda", torch.bfloat16).eval()
    ff.net[0].proj, ff.net[2] = (FP8Linear.from_linear(ff.net[0].proj), FP8Linear.from_linear(ff.net[2]))
    x = torch.randn(1, 4096, 1536, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        unfused = ff(x)
        ff.net[0].gelu, ff.net[2].activation = _pre_activation, "gelu_tanh"
        fused = ff(x)
        pre = ff.net[0](x)
        assert torch.equal(torch.compile(ff.net[2], fullgraph=True)(pre), ff.net[2](pre))
    # an element whose GELU differs in its last bit may round to the next e4m3 value: its row's products move
    assert cos_sim(fused.float(), unfused.float()) >= 0.99999 and rel_l1(fused.float(), unfused.float()) <= 1e-3
