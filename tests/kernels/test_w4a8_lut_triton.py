"""FireQ's look-up-table weight operand as an FP8 matrix (``kernels/w4a8/w4a8_lut_triton.py``) and the ``"lut"``
layers' ``torch._scaled_mm`` path (``W4A8Linear`` with ``weight_operand="lut"``).

The matrix equals the reference's ``cast_fp8(ŵ σ)`` byte for byte (the Triton interpreter without CUDA); the path's
operands, scales and epilogue are checked on the CPU, whose torch has ``torch._scaled_mm`` too, against
``w4a8_linear_ref(operand="lut")``; the ``gpu`` tests run both compiled and the layer through its route.
"""

import pytest
import torch

from quantpatch import dispatch, w4a8_linear
from quantpatch.kernels.quant_ref import cast_fp8
from quantpatch.kernels.w4a8.w4a8_lut_triton import lut_weight_fp8
from quantpatch.kernels.w4a8.w4a8_ref import quantize_weight, unpack_weight, w4a8_linear_ref
from quantpatch.metrics import rel_l1
from quantpatch.w4a8_linear import ROUTE_LUT, W4A8Linear
from tests.gpu import DEVICE, needs_cuda

gpu = pytest.mark.gpu


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """``(n, k)`` weights with an outlier (PTS moves it into [224, 448)) and an all-zero group."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02
    w[n // 2, 3] = 0.7
    if n > 1:
        w[n - 1, :128] = 0.0
    return w


def _expected(packed) -> torch.Tensor:
    q, s = unpack_weight(packed, torch.float32)
    n = q.shape[0]
    return cast_fp8(q.reshape(n, -1, packed.group_size) * s.unsqueeze(-1), "fp8_e4m3").reshape(n, -1).to(
        torch.float8_e4m3fn)


@pytest.mark.parametrize("n, k", [(1, 128), (17, 256), (40, 384)])  # a partial row block, several groups
def test_lut_matrix_is_the_references_e4m3_of_code_times_scale(n, k):
    packed = quantize_weight(_weight(n, k, seed=n))
    got = lut_weight_fp8(packed.qweight, packed.scales)
    assert got.dtype == torch.float8_e4m3fn and got.shape == (n, k)
    assert torch.equal(got.view(torch.uint8), _expected(packed).view(torch.uint8))


def test_lut_matrix_rounds_and_saturates_the_products():
    packed = quantize_weight(_weight(8, 128))
    qweight = torch.full_like(packed.qweight, 0x8F)  # codes -1 (low nibble) and -8 (high nibble)
    scales = torch.tensor([448.0, 64.0, 1.125, 0.0, 2.0**-9, 3.0, 52.0, 0.25]).to(torch.float8_e4m3fn)[:, None]
    got = lut_weight_fp8(qweight, scales).float()
    assert got[0, :2].tolist() == [-448.0, -448.0]  # -8 · 448 saturates
    assert got[1, :2].tolist() == [-64.0, -448.0]  # -8 · 64 = -512 saturates
    assert got[2, :2].tolist() == [-1.125, -9.0]  # exact products stay
    assert got[6, :2].tolist() == [-52.0, -416.0]  # -416 is on the grid
    assert torch.equal(got.to(torch.float8_e4m3fn).view(torch.uint8),
                       _expected(packed._replace(qweight=qweight, scales=scales)).view(torch.uint8))


def test_bad_operands_raise():
    packed = quantize_weight(_weight(4, 256))
    with pytest.raises(ValueError, match="expected"):
        lut_weight_fp8(packed.qweight, packed.scales.float())
    with pytest.raises(ValueError, match="expected"):
        lut_weight_fp8(packed.qweight[:, :64], packed.scales)


def _lut_layer(n: int, k: int, bias: bool, dtype=torch.bfloat16, device="cpu") -> W4A8Linear:
    linear = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(_weight(n, k, seed=k))
    layer = W4A8Linear.from_linear(linear, weight_operand="lut").to(device)
    if bias:
        layer.bias = layer.bias.to(dtype)
    return layer


@pytest.mark.parametrize("bias", [False, True])
def test_the_scaled_mm_path_computes_the_lut_product(bias, monkeypatch):
    """The path's GPU code on the CPU (kernels in the interpreter, the CPU's ``torch._scaled_mm``): the reference's
    ``"lut"`` product up to the order of the float32 sums and the output's rounding."""
    monkeypatch.setattr("quantpatch.fp8_linear.scaled_mm_unsupported", lambda *args: None)
    layer = _lut_layer(48, 256, bias)
    x = torch.randn(2, 7, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    call = dispatch.LinearCall(x, layer)
    assert w4a8_linear._lut_unsupported(call) is None
    y = w4a8_linear._lut_run(call)
    ref = w4a8_linear_ref(x, layer.packed(), layer.bias, operand="lut", compute_dtype=torch.float32)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 7, 48)
    assert rel_l1(y.float(), ref.float()) <= 2e-3  # bf16 output: a few elements one bf16 ulp apart


def test_the_path_is_one_scaled_mm_of_its_operands():
    """``_lut_run`` on ``(B, S, K)`` is the row-wise ``torch._scaled_mm`` of the activation quantizer's ``x̂, β``, the
    FP8 matrix and ``2⁻ⁿ`` per channel, bit for bit (the CPU's ``_scaled_mm``)."""
    from quantpatch.kernels.w4a8.w4a8_act_quant_triton import quantize_activation_fp8

    layer = _lut_layer(48, 256, True)
    x = torch.randn(2, 7, 256, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    x_hat, beta = quantize_activation_fp8(x.reshape(14, 256))
    weight = lut_weight_fp8(layer.qweight, layer.scales)
    scale_row = torch.full((1, 48), 2.0 ** -int(layer.pts_exp))
    expected = torch._scaled_mm(x_hat, weight.t(), scale_a=beta.float().view(-1, 1), scale_b=scale_row,
                                bias=layer.bias, out_dtype=torch.bfloat16)
    assert torch.equal(w4a8_linear._lut_run(dispatch.LinearCall(x, layer)), expected.view(2, 7, 48))


def test_the_scale_row_is_made_once_per_pts_exp_buffer_and_version():
    """``2⁻ⁿ (1, O)`` is kept between calls, made anew when ``pts_exp`` is written in place or replaced, and is no
    buffer: ``state_dict`` does not carry it."""
    layer = _lut_layer(48, 256, False)
    n = int(layer.pts_exp)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    call = dispatch.LinearCall(x, layer)
    y = w4a8_linear._lut_run(call)
    row = w4a8_linear._pts_scale_row(layer)
    assert row.shape == (1, 48) and row.dtype == torch.float32 and torch.equal(row, torch.full((1, 48), 2.0 ** -n))
    assert w4a8_linear._pts_scale_row(layer) is row  # kept
    layer.pts_exp.fill_(n + 1)  # in place: a new version
    assert torch.equal(w4a8_linear._pts_scale_row(layer), torch.full((1, 48), 2.0 ** -(n + 1)))
    assert torch.equal(w4a8_linear._lut_run(call), y / 2)  # a power of two: exact in bf16
    layer.load_state_dict({**layer.state_dict(), "pts_exp": torch.tensor(n - 1, dtype=torch.int32)}, assign=True)
    assert torch.equal(w4a8_linear._lut_run(call), y * 2)  # a new buffer
    layer.pts_exp.data = torch.tensor(n, dtype=torch.int32)  # new storage, same version
    assert torch.equal(w4a8_linear._lut_run(call), y)
    assert set(layer.state_dict()) == {"qweight", "scales", "pts_exp"}


def test_the_path_takes_lut_layers_only_and_says_why_not(monkeypatch):
    x = torch.randn(3, 256).to(torch.bfloat16)
    group = W4A8Linear.from_linear(torch.nn.Linear(256, 48, bias=False))
    assert "this path takes 'lut'" in w4a8_linear._lut_unsupported(dispatch.LinearCall(x, group))
    lut = dispatch.LinearCall(x, _lut_layer(48, 256, False))
    cpu = w4a8_linear._lut_unsupported(lut)
    assert isinstance(cpu, dispatch.Quiet) and "CUDA" in cpu  # the CPU's path is the reference, quietly
    monkeypatch.setattr("quantpatch.fp8_linear.scaled_mm_unsupported", lambda *args: None)
    assert w4a8_linear._lut_unsupported(dispatch.LinearCall(x, _lut_layer(40, 256, False))).startswith("W4A8Linear")
    assert "bias" in w4a8_linear._lut_unsupported(dispatch.LinearCall(x, _lut_layer(48, 256, True, torch.float32)))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert "torch.compile" in w4a8_linear._lut_unsupported(lut)


@gpu
@needs_cuda
@pytest.mark.parametrize("n, k", [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336)])
def test_gpu_lut_matrix_is_the_references_bit_for_bit(n, k):
    packed = quantize_weight(_weight(n, k).to(DEVICE))
    got = lut_weight_fp8(packed.qweight, packed.scales)
    assert torch.equal(got.view(torch.uint8).cpu(), _expected(packed).view(torch.uint8).cpu())


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 16, 1024])
def test_gpu_lut_layers_run_scaled_mm_and_match_the_reference(m):
    layer = _lut_layer(1024, 4096, False, device=DEVICE)
    x = torch.randn(m, 4096, device=DEVICE).to(torch.bfloat16)
    impl, _ = dispatch.select(w4a8_linear.OP, w4a8_linear.KEY, dispatch.LinearCall(x, layer))
    assert impl.name == ROUTE_LUT
    ref = w4a8_linear_ref(x, layer.packed(), None, operand="lut", compute_dtype=torch.float32)
    assert rel_l1(layer(x).float(), ref.float()) <= 2e-3
