"""quantpatch.attention: dispatch, layouts, fallbacks, and bad input."""

import warnings

import pytest
import torch

import quantpatch as qp
from quantpatch.fallback import reset_fallback_warnings
from quantpatch.kernels.attention.attention_ref import attention_exact
from quantpatch.kernels.attention.quant_attention_ref import quant_attention_ref
from quantpatch.synthetic import attention_inputs


@pytest.fixture(autouse=True)
def _fresh_warnings():
    reset_fallback_warnings()
    yield
    reset_fallback_warnings()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_output_dtype_shape_and_reference_numerics(dtype):
    q, k, v = attention_inputs("randn", heads=4, kv_heads=2, seq_q=113, head_dim=64, dtype=dtype)
    o, lse = qp.attention(q, k, v, mode="sage2-8b", is_causal=True, return_lse=True)
    assert o.dtype == dtype and o.shape == q.shape and lse.dtype == torch.float32
    ref, ref_lse = quant_attention_ref(q, k, v, qp.get_mode("sage2-8b").attention, is_causal=True, return_lse=True)
    torch.testing.assert_close(o, ref.to(dtype))
    torch.testing.assert_close(lse, ref_lse)


def test_bshd_layout_matches_bhsd():
    q, k, v = attention_inputs("randn", heads=4, seq_q=70, head_dim=32, dtype=torch.bfloat16)
    bhsd = qp.attention(q, k, v, mode="int8-flash")
    bshd = qp.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mode="int8-flash", layout="BSHD")
    assert torch.equal(bshd.transpose(1, 2), bhsd)


def test_off_mode_is_sdpa_with_bottom_right_causal():
    q, k, v = attention_inputs("randn", heads=2, seq_q=5, seq_k=12, head_dim=32)
    o = qp.attention(q, k, v, mode="off", is_causal=True)
    torch.testing.assert_close(o, attention_exact(q, k, v, is_causal=True).float(), rtol=1e-5, atol=1e-5)


def test_unsupported_head_dim_warns_once_and_falls_back_to_sdpa():
    q, k, v = attention_inputs("randn", heads=2, seq_q=20, head_dim=16)
    with pytest.warns(qp.QuantpatchFallbackWarning, match="head_dim 16 outside"):
        o = qp.attention(q, k, v, mode="sage2-8b")
    torch.testing.assert_close(o, attention_exact(q, k, v).float(), rtol=1e-5, atol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qp.attention(q, k, v, mode="sage2-8b")  # the same fallback does not warn twice


def test_strict_raises_instead_of_falling_back():
    q, k, v = attention_inputs("randn", heads=2, seq_q=20, head_dim=16)
    with pytest.raises(qp.UnsupportedError, match="head_dim 16"):
        qp.attention(q, k, v, mode="sage2-8b", strict=True)


def test_empty_inputs_give_empty_or_zero_outputs():
    q, k, v = attention_inputs("randn", heads=2, seq_q=0, seq_k=10, head_dim=32)
    assert qp.attention(q, k, v, mode="turbo").shape == (1, 2, 0, 32)
    q, k, v = attention_inputs("randn", heads=2, seq_q=3, seq_k=0, head_dim=32)
    o, lse = qp.attention(q, k, v, mode="turbo", return_lse=True)
    assert torch.all(o == 0) and torch.all(lse == float("-inf"))


@pytest.mark.parametrize(
    "change, error, message",
    [
        (lambda q, k, v: (q.flatten(0, 1), k, v), ValueError, "must be 4-D"),
        (lambda q, k, v: (q.long(), k, v), TypeError, "dtype torch.int64"),
        (lambda q, k, v: (q, k.half(), v), TypeError, "dtypes differ"),
        (lambda q, k, v: (q, k[:, :1].expand(-1, 3, -1, -1), v[:, :1].expand(-1, 3, -1, -1)), ValueError, "multiple"),
        (lambda q, k, v: (q, k[..., :16], v), ValueError, "head_dim 32 != k head_dim 16"),
        (lambda q, k, v: (q, k, v[:, :, :5]), ValueError, "disagree"),
        (lambda q, k, v: (q, k, v[:1].expand(2, -1, -1, -1)), ValueError, "batch sizes differ"),
    ],
)
def test_bad_shapes_and_dtypes_raise_clear_errors(change, error, message):
    q, k, v = attention_inputs("randn", heads=4, kv_heads=2, seq_q=8, head_dim=32)
    with pytest.raises(error, match=message):
        qp.attention(*change(q, k, v), mode="sage2-8b")


def test_nan_input_raises_instead_of_spreading_through_scales():
    q, k, v = attention_inputs("randn", heads=2, seq_q=8, head_dim=32)
    k[0, 1, 3, 0] = float("nan")
    with pytest.raises(ValueError, match="k contains NaN"):
        qp.attention(q, k, v, mode="sage2-8b")


def test_mask_that_does_not_broadcast_raises():
    q, k, v = attention_inputs("randn", heads=2, seq_q=8, head_dim=32)
    with pytest.raises(ValueError, match="does not broadcast"):
        qp.attention(q, k, v, mode="sage2-8b", attn_mask=torch.ones(3, 8, dtype=torch.bool))


def test_bad_layout_and_mode_raise():
    q, k, v = attention_inputs("randn", heads=2, seq_q=8, head_dim=32)
    with pytest.raises(ValueError, match="layout='SBHD'"):
        qp.attention(q, k, v, mode="sage2-8b", layout="SBHD")
    with pytest.raises(ValueError, match="valid modes are"):
        qp.attention(q, k, v, mode="nope")


def test_config_objects_are_accepted_as_mode():
    q, k, v = attention_inputs("randn", heads=2, seq_q=64, head_dim=64)
    cfg = qp.get_mode("sage2-4b", smooth_q=False)
    assert torch.equal(qp.attention(q, k, v, mode=cfg), qp.attention(q, k, v, mode=cfg.attention))


def test_a_kernel_module_that_cannot_import_warns_once_and_the_reference_serves(caplog):
    from quantpatch import dispatch

    missing = "quantpatch.kernels._no_such_kernels_module"
    with caplog.at_level("WARNING", logger="quantpatch"):
        dispatch.load_kernels(missing)
        dispatch.load_kernels(missing)
    warned = [r for r in caplog.records if missing in r.getMessage()]
    assert len(warned) == 1 and "using the PyTorch reference" in warned[0].getMessage()
