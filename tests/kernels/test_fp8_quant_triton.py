"""Per-token FP8 activation quantization (Triton) against ``fp8_linear_ref.quantize_rows_fp8_ref``, bit for bit.

Without CUDA the kernel runs in the Triton interpreter (``conftest.py``) on small shapes; the ``gpu``-marked
tests run it compiled on the device machine. Both the e4m3 bytes and the float32 scales must be identical:
the kernel's quotient is the IEEE one and its cast rounds to nearest even with saturation, as the reference.
"""

import pytest
import torch

from quantpatch import fp8_linear
from quantpatch.dispatch import LinearCall
from quantpatch.fp8_linear import FP8Linear
from quantpatch.kernels.fp8_linear.fp8_linear_ref import (
    ACTIVATIONS,
    activate_ref,
    fp8_linear_ref,
    quantize_rows_fp8_ref,
)
from quantpatch.kernels.fp8_linear.fp8_quant_triton import ROW_BLOCK, fp8_quantize_rows_op, quantize_rows_fp8
from quantpatch.metrics import rel_l1
from tests.gpu import DEVICE, needs_cuda

gpu = pytest.mark.gpu
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _rows(m: int, k: int, dtype: torch.dtype, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    """``(m, k)`` N(0, 3²) rows with a channel outlier, an all-zero row and a tiny row when there is room."""
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 3
    x[:, k // 3] *= 40  # a large channel: the other channels of each token land near e4m3's subnormals
    if m > 2:
        x[1] = 0.0
        x[2] *= 1e-3
    return x.to(device=device, dtype=dtype)


def _assert_same(got: tuple[torch.Tensor, torch.Tensor], ref: tuple[torch.Tensor, torch.Tensor]) -> None:
    (q, s), (q_ref, s_ref) = got, ref
    assert q.dtype == q_ref.dtype == torch.float8_e4m3fn and s.dtype == s_ref.dtype == torch.float32
    assert q.shape == q_ref.shape and s.shape == s_ref.shape == (q.shape[0], 1)
    assert torch.equal(q.view(torch.uint8).cpu(), q_ref.view(torch.uint8).cpu())
    assert torch.equal(s.cpu(), s_ref.cpu())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [16, 48, ROW_BLOCK + 20])  # one load, a masked tail, two passes
@pytest.mark.parametrize("m", [1, 7, 33])
def test_kernel_equals_reference_bit_for_bit(m, k, dtype):
    x = _rows(m, k, dtype, seed=m * 1000 + k)
    _assert_same(quantize_rows_fp8(x), quantize_rows_fp8_ref(x))


def test_programs_of_several_tokens_with_a_partial_last_one():
    x = _rows(301, 48, torch.bfloat16, seed=5)  # 64 channels a load: 64 tokens a program, the last one 45
    _assert_same(quantize_rows_fp8(x), quantize_rows_fp8_ref(x))


def test_rounding_ties_saturation_signed_and_zero_rows():
    # row 0: absmax 448 → scale 1, so the kernel casts these values themselves; ties go to the even neighbour
    ties = [448.0, 1.0625, 1.1875, -17.0, -19.0, 300.0, 2.0**-10, 1.5 * 2.0**-10, -0.0, -2.0**-12]
    x = torch.zeros(3, 16)
    x[0, : len(ties)] = torch.tensor(ties)
    x[1] = torch.linspace(-5.0, 7.288096904754639, 16)  # absmax / s = 448.00003: saturated to 448
    q, s = quantize_rows_fp8(x)
    assert (x[1, -1] / s[1]).item() > 448.0
    _assert_same((q, s), quantize_rows_fp8_ref(x))
    expected = [448.0, 1.0, 1.25, -16.0, -20.0, 288.0, 0.0, 2.0**-9, -0.0, -0.0]
    assert q[0, : len(ties)].float().tolist() == expected
    assert q[0, len(ties) - 2:len(ties)].view(torch.uint8).tolist() == [0x80, 0x80]  # negative zeros keep their sign
    assert q[1].float().abs().max() == 448.0 and s[2].item() == 1.0 and not q[2].float().any()


def test_strided_rows_and_empty_inputs():
    x = _rows(9, 64, torch.bfloat16)
    wide = torch.zeros(9, 80, dtype=torch.bfloat16)
    wide[:, :64] = x
    _assert_same(quantize_rows_fp8(wide[:, :64]), quantize_rows_fp8_ref(x))  # row stride 80
    q, s = quantize_rows_fp8(torch.zeros(0, 32))
    assert q.shape == (0, 32) and s.shape == (0, 1)


def _assert_gelu_quantized_as_reference(x: torch.Tensor, activation: str) -> None:
    """The kernel's GELU + quantization against ``quantize_rows_fp8_ref(activate_ref(x))``: the two GELUs agree but
    where their float32 values straddle a rounding boundary of ``x``'s dtype (module docstring of the kernel), so
    all but a few e4m3 values are equal (a GELU that underflows may keep another sign of zero), and each dequantized
    value is the reference's within that one ulp of the GELU plus the two roundings to e4m3."""
    g = activate_ref(x, activation)
    (q, s), (q_ref, s_ref) = quantize_rows_fp8(x, activation), quantize_rows_fp8_ref(g)
    assert q.shape == q_ref.shape and s.shape == s_ref.shape
    same = (q.float() == q_ref.float()).float().mean().item()
    assert same >= 0.999, f"{1 - same:.2%} of the e4m3 values differ"
    # the absmax's GELU one ulp of x's dtype apart at most (float32: a few ulps, the GPU's exp and division)
    assert torch.allclose(s, s_ref, rtol=max(2 * torch.finfo(x.dtype).eps, 2**-20), atol=0)
    q, q_ref = q.float(), q_ref.float()
    # one ulp of the GELU in x's dtype (subnormal ones too: in a row of tiny values that is several e4m3 steps),
    # then each side's rounding to e4m3: at most half a step each, a step ≤ 2⁻³·|value| (normal) or 2⁻⁹ (subnormal)
    g = g.cpu().abs()
    ulp = (torch.nextafter(g, torch.full_like(g, float("inf"))) - g).float().to(q.device)
    steps = (2**-3 * torch.maximum(q.abs(), q_ref.abs()) + 2**-9) * torch.maximum(s, s_ref)
    excess = (q * s - q_ref * s_ref).abs() - (ulp + steps)
    assert (excess <= 0).all(), f"{(excess > 0).sum().item()} values beyond their bound, by up to {excess.max()}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("k", [48, ROW_BLOCK + 20])  # one load with a masked tail; two passes, GELU in each
def test_gelu_then_quantization_matches_the_two_steps(k, activation, dtype):
    x = _rows(9, k, dtype, seed=k + len(activation)) / 4  # N(0, 0.75²): the GELU's curved part, and the outlier
    _assert_gelu_quantized_as_reference(x, activation)


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_gelu_absmax_of_long_rows_from_the_largest_input_or_every_gelu(activation):
    """Past its first load a long row's absmax is taken from its largest input (the GELU increases from -0.75 on);
    a row whose GELUs all stay below 0.1875 takes every GELU again, since a negative input may then hold the
    absmax: row 0 (top past the first load), row 1 (absmax -0.17 at x = -0.75 past the first load), row 2 (all
    small but for the first load). Scales and bytes are the reference's."""
    k = ROW_BLOCK + 20
    x = torch.full((3, k), 0.01)
    x[0, ROW_BLOCK + 5], x[0, 7] = 2.5, -3.0
    x[1, ROW_BLOCK + 3], x[1, ROW_BLOCK + 9], x[1, 2] = -0.75, 0.1, 0.05
    x[2, 11], x[2, ROW_BLOCK + 1] = 0.15, -0.5
    x = x.to(torch.bfloat16)
    got, ref = quantize_rows_fp8(x, activation), quantize_rows_fp8_ref(activate_ref(x, activation))
    assert ref[1][1, 0] * 448 == -activate_ref(x[1, ROW_BLOCK + 3], activation).float()  # a negative GELU's absmax
    _assert_same(got, ref)


def test_gelu_of_infinities_and_nan_gives_the_references_nan_rows():
    """GELU(-inf) is NaN and GELU(+inf) inf: a row holding either (or a NaN) comes out of the layer as NaN, as from
    the reference (whose absmax is NaN; the kernel's max skips NaN, but the NaN itself still reaches the GEMM); the
    other rows are finite. The GPU path's wiring runs here with the CPU's ``torch._scaled_mm``."""
    fp8 = FP8Linear.from_linear(torch.nn.Linear(16, 16).to(torch.bfloat16))
    x = _rows(5, 16, torch.bfloat16, seed=3) / 4
    x[0, 3], x[3, 0], x[4, 9] = float("inf"), -float("inf"), float("nan")
    for activation in ACTIVATIONS:
        fp8.activation = activation
        y = fp8_linear._gpu_run(LinearCall(x, fp8))
        ref = fp8_linear_ref(x, fp8.weight_fp8, fp8.weight_scale, fp8.bias, activation)
        assert torch.equal(y.isnan().any(-1), torch.tensor([True, False, False, True, True]))
        assert torch.equal(ref.isnan().any(-1), y.isnan().any(-1)) and y[1:3].isfinite().all()
    with pytest.raises(ValueError, match="activation 'relu'"):
        quantize_rows_fp8(x, "relu")


@pytest.mark.parametrize("bad", [torch.zeros(4, 8, 2), torch.zeros(8, 4).t(), torch.zeros(4, 8, dtype=torch.float64)])
def test_bad_inputs_raise(bad):
    with pytest.raises((ValueError, TypeError)):
        quantize_rows_fp8(bad)


def test_custom_op_matches_the_launcher_and_has_a_fake():
    x = _rows(5, 32, torch.bfloat16)
    _assert_same(fp8_quantize_rows_op(x), quantize_rows_fp8(x))
    _assert_same(fp8_quantize_rows_op(x, "gelu_tanh"), quantize_rows_fp8(x, "gelu_tanh"))
    torch.library.opcheck(fp8_quantize_rows_op, (x,), test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(fp8_quantize_rows_op, (x, "gelu"), test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_path_wiring_runs_on_cpu_scaled_mm(dtype):
    """FP8Linear's GPU path (this kernel, then row-wise ``torch._scaled_mm`` with a bias, ``scaled_mm_rowwise``) on
    the CPU, whose torch has ``_scaled_mm`` too: the one ``_scaled_mm`` of these operands, bit for bit; operand
    layouts, scale shapes and the epilogue agree with the reference; ``(..., K)`` inputs and rows with a strided
    last dim give the same rows as ``(M, K)`` ones."""
    lin = torch.nn.Linear(64, 48).to(dtype)
    with torch.no_grad():  # seeded operands
        lin.weight.copy_(_rows(48, 64, dtype, seed=12) / 24)
        lin.bias.copy_(_rows(1, 48, dtype, seed=13).view(48))
    fp8 = FP8Linear.from_linear(lin)
    x = _rows(14, 64, dtype, seed=11)
    y = fp8_linear._gpu_run(LinearCall(x, fp8))
    x_fp8, x_scale = quantize_rows_fp8(x)
    assert torch.equal(y, torch._scaled_mm(x_fp8, fp8.weight_fp8.t(), scale_a=x_scale,
                                           scale_b=fp8.weight_scale.view(1, -1), bias=fp8.bias, out_dtype=dtype))
    ref = fp8_linear_ref(x, fp8.weight_fp8, fp8.weight_scale, fp8.bias)
    assert y.dtype == dtype and y.shape == (14, 48)
    # the same exact products summed in another order (measured on these seeded operands: fp32 rel-L1 1.3e-7, bf16 /
    # fp16 identical); a half output may round to the neighbour of the reference's where the two fp32 sums straddle a
    # rounding boundary (an unseeded run once gave one such fp16 element), so halves are held to one ulp
    if dtype == torch.float32:
        assert rel_l1(y, ref) <= 1e-6
    else:
        ulp = torch.finfo(dtype).eps * ref.float().abs().clamp_min(torch.finfo(dtype).tiny)
        assert ((y.float() - ref.float()).abs() <= ulp).all()
    batched = fp8_linear._gpu_run(LinearCall(x.view(2, 7, 64), fp8))
    assert batched.shape == (2, 7, 48) and torch.equal(batched.view(14, 48), y)
    strided = x.t().contiguous().t()  # the same rows, channel stride 14
    assert strided.stride(-1) != 1 and torch.equal(fp8_linear._gpu_run(LinearCall(strided, fp8)), y)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k", [(1, 4096), (257, 4096), (33, 14336), (4096, 1408)])
def test_gpu_kernel_equals_reference_bit_for_bit(m, k, dtype):
    x = _rows(m, k, dtype, seed=k, device=DEVICE)
    _assert_same(quantize_rows_fp8(x), quantize_rows_fp8_ref(x))


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("m,k", [(4096, 8960), (257, 1536)])  # Wan2.1-1.3B's feed-forward; a short row
def test_gpu_gelu_then_quantization_matches_the_two_steps(m, k, activation, dtype):
    _assert_gelu_quantized_as_reference(_rows(m, k, dtype, seed=k, device=DEVICE) / 4, activation)
