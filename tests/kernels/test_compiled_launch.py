"""The key of a compiled-kernel launch plan (``kernels/compiled_launch.py``): what Triton specializes on."""

import pytest
import torch

from quantpatch.kernels.compiled_launch import specialization


def test_specialization_tells_apart_what_triton_compiles_apart():
    aligned = torch.zeros(64, dtype=torch.float32)
    offset = aligned[1:]  # 4 bytes past a 16-byte boundary
    one, sixteen, seventeen, big = specialization((1, 16, 17, 2**31))
    assert one == ("constexpr", 1)  # an int 1 becomes a constant of the compiled kernel
    assert sixteen[1] == "D" and seventeen[1] != "D" and sixteen[0] == seventeen[0] == "i32"
    assert big[0] == "i64"
    a, b, c = specialization((aligned, offset, aligned.to(torch.bfloat16)))
    assert a[1] == "D" and b[1] != "D" and a[0] != c[0]
    assert specialization((32, aligned)) == specialization((48, torch.ones(8)))  # same class: one plan


def test_host_arithmetic_matches_triton_helpers():
    import triton

    from quantpatch.kernels.compiled_launch import cdiv, next_pow2

    for a in (1, 2, 15, 16, 17, 4096, 14337):
        for b in (1, 3, 16, 64):
            assert cdiv(a, b) == triton.cdiv(a, b)
        assert next_pow2(a) == triton.next_power_of_2(a)
    assert cdiv(0, 16) == 0 and next_pow2(0) == 1  # (an empty count still gets a 1-wide tile)


class _RecordingKernel:
    """Stands in for a ``JITFunction``: ``kernel[grid](...)`` records the call and returns a new "compiled kernel"."""

    __name__ = "recording"
    arg_names = ["X_ptr", "n", "BLOCK", "FLAG"]

    def __init__(self):
        self.runs = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.runs.append((grid, args, kwargs))
            return object()

        return run


def _stub_launches(monkeypatch, interpreting: bool = False) -> list:
    """``compiled_launch`` as on a GPU (or under the interpreter), with ``relaunch`` and the stream stubbed: returns
    the list each relaunch appends its ``(compiled kernel, grid, args)`` to."""
    from quantpatch.kernels import compiled_launch

    monkeypatch.setattr(compiled_launch, "_INTERPRETING", interpreting)
    relaunched = []
    monkeypatch.setattr(compiled_launch, "relaunch", lambda k, grid, stream, args: relaunched.append((k, grid, args)))
    monkeypatch.setattr(compiled_launch, "current_stream", lambda device: 7)
    return relaunched


def test_launch_plans_compile_once_a_key_then_relaunch(monkeypatch):
    from quantpatch.kernels import compiled_launch

    relaunched = _stub_launches(monkeypatch)
    kernel = _RecordingKernel()
    plans = compiled_launch.LaunchPlans(kernel)
    x = torch.zeros(64)
    plans((2,), (x, 32), dict(BLOCK=16, FLAG=True), num_warps=4)
    plans((3, 2), (x, 48), dict(BLOCK=16, FLAG=True), num_warps=4)  # 48 and 32: same class, the same plan
    assert len(plans) == 1 and len(kernel.runs) == 1
    assert kernel.runs[0] == ((2,), (x, 32), dict(BLOCK=16, FLAG=True, num_warps=4))
    (compiled, grid, args), = relaunched
    assert grid == (3, 2, 1) and args == (x, 48, 16, True)  # every parameter in signature order
    plans((2,), (x, 1), dict(BLOCK=16, FLAG=True), num_warps=4)  # an int 1 is compiled in: another plan
    plans((2,), (x, 32), dict(BLOCK=32, FLAG=True), num_warps=4)
    plans((2,), (x, 32), dict(BLOCK=16, FLAG=True), num_warps=8)
    plans((2,), (x[1:], 32), dict(BLOCK=16, FLAG=True), num_warps=4)  # not 16-byte aligned
    assert len(plans) == 5 and len(kernel.runs) == 5 and len(relaunched) == 1
    with pytest.raises(ValueError, match="not the parameters after"):
        plans((2,), (x, 32), dict(FLAG=True, BLOCK=16), num_warps=2)


def test_launch_plans_keep_nothing_under_the_interpreter(monkeypatch):
    from quantpatch.kernels import compiled_launch

    monkeypatch.setattr(compiled_launch, "_INTERPRETING", True)
    kernel = _RecordingKernel()
    plans = compiled_launch.LaunchPlans(kernel)
    for _ in range(2):
        plans((1,), (torch.zeros(4), 3), dict(BLOCK=16, FLAG=False))
    assert len(kernel.runs) == 2 and len(plans) == 0


def test_a_plan_key_stands_in_for_the_arguments_specialization(monkeypatch):
    from quantpatch.kernels import compiled_launch

    relaunched = _stub_launches(monkeypatch)
    kernel = _RecordingKernel()
    plans = compiled_launch.LaunchPlans(kernel)
    x = torch.zeros(64)
    plans((2,), (x, 32), dict(BLOCK=16, FLAG=True), plan_key=("shape", 32), num_warps=4)
    monkeypatch.setattr(compiled_launch, "specialization", lambda args: pytest.fail("specialized a keyed launch"))
    plans((2,), (x, 48), dict(BLOCK=16, FLAG=True), plan_key=("shape", 32), num_warps=4)
    assert len(kernel.runs) == 1 and [args for _, _, args in relaunched] == [(x, 48, 16, True)]
    plans((2,), (x, 48), dict(BLOCK=16, FLAG=True), plan_key=("shape", 48), num_warps=4)  # another key: compiled
    plans((2,), (x, 32), dict(BLOCK=32, FLAG=True), plan_key=("shape", 32), num_warps=4)  # other constexprs too
    assert len(plans) == 3 and len(kernel.runs) == 3


@pytest.mark.parametrize("interpreting", [False, True])
def test_addresses_need_a_plan_made_with_tensors(monkeypatch, interpreting):
    """A launch with a ``DevicePointer`` relaunches a plan made with tensors under the same key, and raises
    ``LookupError`` where there is none (Triton would compile the address as an integer), interpreter or not."""
    from quantpatch.kernels import compiled_launch
    from quantpatch.kernels.compiled_launch import DevicePointer

    relaunched = _stub_launches(monkeypatch, interpreting)
    kernel = _RecordingKernel()
    plans = compiled_launch.LaunchPlans(kernel)
    address = DevicePointer(4096)
    assert address == 4096 and address.data_ptr() == 4096
    with pytest.raises(LookupError, match="no launch plan"):
        plans((1,), (address, 3), dict(BLOCK=16, FLAG=False), plan_key=("k",), device=0)
    assert kernel.runs == []
    if interpreting:
        return
    plans((1,), (torch.zeros(4), 3), dict(BLOCK=16, FLAG=False), plan_key=("k",), device=0)
    plans((1,), (address, 3), dict(BLOCK=16, FLAG=False), plan_key=("k",), device=0)
    assert len(kernel.runs) == 1 and [args for _, _, args in relaunched] == [(address, 3, 16, False)]
