"""The dispatch layer runs every implementation with the call's CUDA device current (Triton and Gluon launch on the
current device): a layer accelerate put on ``cuda:1`` while ``cuda:0`` is current. CUDA is mocked here; the real
two-GPU run is ``tests/multigpu/test_multigpu.py`` and ``eval/run_multigpu_checks.sh``.
"""

import contextlib
from types import SimpleNamespace

import pytest
import torch

import quantpatch as qp
from quantpatch import dispatch
from quantpatch.dispatch import Implementation, run_on_device


@pytest.fixture
def cuda(monkeypatch):
    """A fake current CUDA device: ``cuda.current`` is its index, ``cuda.entered`` the devices a guard made current."""
    state = SimpleNamespace(current=0, entered=[], asked=0)

    def current_device():
        state.asked += 1
        return state.current

    @contextlib.contextmanager
    def device(dev):
        before, state.current = state.current, torch.device(dev).index
        state.entered.append(state.current)
        try:
            yield
        finally:
            state.current = before

    monkeypatch.setattr(torch.cuda, "current_device", current_device)
    monkeypatch.setattr(torch.cuda, "device", device)
    return state


def _impl(cuda):
    return Implementation("kernel", 10, lambda call: None, lambda call: ("ran on", cuda.current))


def test_a_call_on_another_gpu_runs_with_its_device_current(cuda):
    call = SimpleNamespace(device=torch.device("cuda", 1))
    assert run_on_device(_impl(cuda), call) == ("ran on", 1)
    assert cuda.entered == [1] and cuda.current == 0  # entered for the call only


def test_no_guard_when_the_device_is_current(cuda):
    cuda.current = 1
    assert run_on_device(_impl(cuda), SimpleNamespace(device=torch.device("cuda", 1))) == ("ran on", 1)
    assert cuda.entered == []


@pytest.mark.parametrize("device", [torch.device("cpu"), torch.device("cuda")])  # CPU; CUDA with no index: current
def test_no_guard_nor_device_query_off_an_indexed_gpu(cuda, device):
    assert run_on_device(_impl(cuda), SimpleNamespace(device=device)) == ("ran on", 0)
    assert cuda.entered == [] and cuda.asked == 0


def test_no_guard_while_compiling(cuda, monkeypatch):
    """A torch.compile graph enters its own device guard; tracing must not see ours."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert run_on_device(_impl(cuda), SimpleNamespace(device=torch.device("cuda", 1))) == ("ran on", 0)
    assert cuda.entered == [] and cuda.asked == 0


def test_attention_and_run_op_go_through_the_guard(monkeypatch):
    """``quantpatch.attention`` and ``run_op`` (linears, the TurboCache kernels) both run implementations through
    :func:`run_on_device`."""
    ran = []

    def recording(impl, call):
        ran.append((impl.name, call.device))
        return impl.run(call)

    monkeypatch.setattr(qp.api, "run_on_device", recording)
    monkeypatch.setattr(dispatch, "run_on_device", recording)
    q = torch.randn(1, 2, 16, 32)
    qp.attention(q, q, q, mode="sage2-8b")
    from quantpatch.fp8_linear import FP8Linear

    FP8Linear.from_linear(torch.nn.Linear(32, 16))(torch.randn(3, 32))
    assert ran == [("reference", torch.device("cpu"))] * 2
