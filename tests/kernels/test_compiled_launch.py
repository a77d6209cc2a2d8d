"""The key of a compiled-kernel launch plan (``kernels/compiled_launch.py``): what Triton specializes on."""

import pytest
import torch

from quantpatch.kernels.compiled_launch import specialization
from tests.gpu import hopper


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


def _fake_triton36_launcher(monkeypatch, c_calls: list, expansions: list, *, scratch: int = 0):
    """A compiled kernel whose launcher has Triton 3.6's form (``CudaLauncher``; its descriptor wrapper a closure over
    the C function, the descriptor positions and their metadata), with the driver module's names it is checked
    by patched in; the C function records its arguments in ``c_calls``, each descriptor expansion goes to
    ``expansions``."""
    from triton.backends.nvidia import driver

    def expand(arg, metadata):
        expansions.append((arg.base.data_ptr(), metadata))
        return [f"map{arg.base.data_ptr()}:{metadata}", *arg.shape, *arg.strides]

    class CudaLauncher:
        def __init__(self):
            launcher = lambda *a: c_calls.append(a)  # noqa: E731  (the compiled C function)
            tensordesc_indices, tensordesc_meta = {3, 1}, ["meta1", "meta3"]

            def inner(*args):
                return launcher, tensordesc_indices, tensordesc_meta  # (the wrapper; only its closure is read)

            self.launch = inner
            self.global_scratch_size = scratch
            self.profile_scratch_size = 0
            self.launch_cooperative_grid = self.launch_pdl = False

        def __call__(self, gridX, gridY, gridZ, stream, function, *args):
            raise AssertionError("the direct launch went through the Python launcher")

    monkeypatch.setattr(driver, "CudaLauncher", CudaLauncher, raising=False)
    monkeypatch.setattr(driver, "_BASE_ARGS_FORMAT", "iiiKKppOOOOOO", raising=False)
    monkeypatch.setattr(driver, "make_tensordesc_arg", expand, raising=False)

    class Compiled:
        run = CudaLauncher()
        function, packed_metadata = 77, ("packed",)

        def launch_metadata(self, grid, stream, *args):
            return ("metadata", grid, args)

    return Compiled()


class _Descriptor:
    def __init__(self, address: int):
        from quantpatch.kernels.compiled_launch import DevicePointer

        self.base, self.shape, self.strides, self.padding = DevicePointer(address), [64, 128], [128, 1], "zero"


def test_direct_launch_expands_each_descriptor_once_an_address(monkeypatch):
    """Triton 3.6's launcher form: the C function gets the base arguments Triton's launcher gives it, then every
    kernel argument with each descriptor expanded at its position; a descriptor is expanded once per address."""
    from quantpatch.kernels import compiled_launch

    c_calls, expansions = [], []
    kernel = _fake_triton36_launcher(monkeypatch, c_calls, expansions)
    direct = compiled_launch.DirectLaunch.of(kernel)
    assert direct is not None and direct.descriptor_meta == {1: "meta1", 3: "meta3"}
    args = ("x", _Descriptor(4096), 5, _Descriptor(8192), 16)
    direct((3, 2, 1), 9, args, None, None)
    direct((3, 2, 1), 9, args, None, None)
    assert expansions == [(8192, "meta3"), (4096, "meta1")]  # the second call expanded nothing
    base = (3, 2, 1, 9, 77, False, False, None, None, ("packed",), None, None, None)
    flat = ("x", "map4096:meta1", 64, 128, 128, 1, 5, "map8192:meta3", 64, 128, 128, 1, 16)
    assert c_calls == [base + flat] * 2
    direct((3, 2, 1), 9, ("x", _Descriptor(4096), 5, _Descriptor(12288), 16), "enter", "exit")
    assert expansions[2:] == [(12288, "meta3")]  # a new address of one descriptor: only it is expanded
    metadata, enter, exit_ = c_calls[-1][10:13]
    assert (enter, exit_) == ("enter", "exit")
    assert metadata[0] == "metadata" and metadata[2][1].base == 4096  # made from the unexpanded arguments


def test_direct_launch_declines_launchers_it_does_not_know(monkeypatch):
    from triton.backends.nvidia import driver

    from quantpatch.kernels import compiled_launch

    kernel = _fake_triton36_launcher(monkeypatch, [], [], scratch=256)
    assert compiled_launch.DirectLaunch.of(kernel) is None  # scratch memory: Triton's launcher allocates it
    kernel = _fake_triton36_launcher(monkeypatch, [], [])
    monkeypatch.setattr(driver, "_BASE_ARGS_FORMAT", "iiiKKppOOOO")
    assert compiled_launch.DirectLaunch.of(kernel) is None  # another base argument layout


def test_a_bound_launch_is_its_plans_kernel_with_the_grid_and_constexprs(monkeypatch):
    """``LaunchPlans.bound``: the compiled kernel of a made plan (None for a key no launch made, and under the
    interpreter), launched by its direct launch with the runtime arguments and the stream alone; it keeps launching
    that kernel after the plans are cleared."""
    from quantpatch.kernels import compiled_launch

    _stub_launches(monkeypatch)
    c_calls = []
    compiled = _fake_triton36_launcher(monkeypatch, c_calls, [])
    monkeypatch.setattr(compiled_launch, "_DIRECT", {})
    kernel = _RecordingKernel()
    kernel.arg_names = ["X_ptr", "D_desc", "n", "E_desc", "BLOCK", "FLAG"]
    plans = compiled_launch.LaunchPlans(kernel)
    consts = dict(BLOCK=16, FLAG=True)
    assert plans.bound((3,), consts, plan_key=("key",), device=0, num_warps=4) is None  # not made yet
    plans._plans[(0, (16, True), (("num_warps", 4),), ("key",))] = compiled  # as a first launch makes it
    bound = plans.bound((3,), consts, plan_key=("key",), device=0, num_warps=4)
    for other in (dict(plan_key=("other",), device=0, num_warps=4), dict(plan_key=("key",), device=1, num_warps=4),
                  dict(plan_key=("key",), device=0, num_warps=8)):
        assert plans.bound((3,), consts, **other) is None
    plans.clear()
    bound(9, ("x", _Descriptor(4096), 5, _Descriptor(8192)))
    grid_and_stream, (function, packed), args = c_calls[0][:4], (c_calls[0][4], c_calls[0][9]), c_calls[0][13:]
    assert grid_and_stream == (3, 1, 1, 9) and (function, packed) == (77, ("packed",))
    assert args[:2] == ("x", "map4096:meta1") and "map8192:meta3" in args and args[-2:] == (16, True)
    monkeypatch.setattr(compiled_launch, "_INTERPRETING", True)
    plans._plans[(0, (16, True), (("num_warps", 4),), ("key",))] = compiled
    assert plans.bound((3,), consts, plan_key=("key",), device=0, num_warps=4) is None


def test_relaunch_drops_empty_hook_chains_and_keeps_set_ones(monkeypatch):
    from triton import knobs

    from quantpatch.kernels import compiled_launch

    c_calls = []
    kernel = _fake_triton36_launcher(monkeypatch, c_calls, [])
    monkeypatch.setattr(compiled_launch, "_DIRECT", {})
    compiled_launch.relaunch(kernel, (1, 1, 1), 0, ("x", _Descriptor(4096), 5, _Descriptor(8192), 16))
    assert c_calls[-1][10:13] == (None, None, None)  # no hook set: no metadata, no hook call
    hook = lambda metadata: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        compiled_launch.relaunch(kernel, (1, 1, 1), 0, ("x", _Descriptor(4096), 5, _Descriptor(8192), 16))
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert c_calls[-1][11] is knobs.runtime.launch_enter_hook and c_calls[-1][12] is None
    assert c_calls[-1][10][0] == "metadata"


@pytest.mark.gpu
@hopper
def test_direct_launch_gives_the_bits_of_tritons_launcher(monkeypatch):
    """The sm90 prefill path (three launches, the attention kernel's three TMA descriptors) through the direct launch
    and through Triton's launcher: the same outputs bit for bit, for two sets of inputs; on Triton 3.5 / 3.6 every one
    of its launches is direct."""
    import triton

    import quantpatch
    from quantpatch.kernels import compiled_launch
    from quantpatch.kernels.attention import fast_paths

    cfg = quantpatch.get_mode("sage2-8b").attention
    gen = torch.Generator(device="cuda").manual_seed(0)
    inputs = [[torch.randn(1, 2, 1024, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3)]
              for _ in range(2)]
    monkeypatch.setattr(compiled_launch, "_DIRECT", {})
    fast_paths.quantized_attention(*inputs[0], cfg)  # the first call of a shape makes the plans
    direct = [fast_paths.quantized_attention(*x, cfg)[0] for x in inputs]
    launchers = list(compiled_launch._DIRECT.values())
    assert len(launchers) == 3
    if triton.__version__.startswith(("3.5.", "3.6.")):
        assert all(d is not None for d in launchers) and sum(len(d.descriptor_meta) for d in launchers) == 3
    monkeypatch.setattr(compiled_launch, "_DIRECT", {})
    monkeypatch.setattr(compiled_launch.DirectLaunch, "of", classmethod(lambda cls, kernel: None))
    through_triton = [fast_paths.quantized_attention(*x, cfg)[0] for x in inputs]
    assert all(torch.equal(a, b) for a, b in zip(direct, through_triton))
    assert not torch.equal(direct[0], direct[1])


def test_clearing_plans_drops_their_direct_launches(monkeypatch):
    from quantpatch.kernels import compiled_launch

    _stub_launches(monkeypatch)
    monkeypatch.setattr(compiled_launch, "_DIRECT", {})
    kernel = _RecordingKernel()
    plans = compiled_launch.LaunchPlans(kernel)
    plans((2,), (torch.zeros(64), 32), dict(BLOCK=16, FLAG=True), num_warps=4)
    (compiled,) = plans._plans.values()
    other = object()
    compiled_launch._DIRECT.update({compiled: None, other: None})  # as relaunch leaves them
    plans.clear()
    assert len(plans) == 0 and list(compiled_launch._DIRECT) == [other]
