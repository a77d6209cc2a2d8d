"""A TurboCache compiles every kernel its decode steps launch at its first forward (the prefill), none later.

Triton compiles a kernel once per key: the constexprs, the launch options and the specialization of the runtime
arguments (ints on ``== 1`` and ``% 16 == 0``, tensors on dtype and 16-byte alignment; ``do_not_specialize`` ints on
their type only). Here the cache, its dispatch and the launchers run as on CUDA, on CPU tensors: every launch of the
compression kernel, the Triton decode kernel and the Gluon decode kernel is recorded with its key, not run (Gluon has
no interpreter, and the keys are the subject: what a kernel computes does not change them). Then:

* every decode step's launches have keys that the prefill already launched (the layer's warm-up compiled them), and
* a long prompt's steps launch one key per kernel, through the buffer's first flush into a block (step 64);
* a beam search's reorder (and the other batch maps) keeps each width's codes views of one tensor, so the steps after
  it launch the prefill's keys too;
* off CUDA the cache warms nothing up.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import pytest
import torch

import quantpatch as qp
from quantpatch import dispatch
from quantpatch.dispatch import Implementation
from quantpatch.kernels import compiled_launch

transformers = pytest.importorskip("transformers", reason="the TurboCache needs Transformers")
tdg = pytest.importorskip("quantpatch.kernels.turbo_kv.turbo_decode_gluon", reason="the decode kernel needs Gluon")

from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import BaseBackend  # noqa: E402

from quantpatch.kernels.turbo_kv import turbo_compress_triton as tct  # noqa: E402
from quantpatch.kernels.turbo_kv import turbo_decode_triton as tdt  # noqa: E402
from quantpatch.patches.transformers import turbo_cache  # noqa: E402

CPU = torch.device("cpu")
NOT_CUDA = "inputs are not CUDA tensors"


def _key(kernel, args: tuple, constexprs: dict, options: dict) -> tuple:
    """What ``JITFunction.run`` keys a compiled kernel on (its binder's specialization, do_not_specialize honoured)."""
    dns = getattr(kernel, "do_not_specialize", None) or getattr(kernel, "kwargs", {}).get("do_not_specialize") or ()
    dns = {kernel.arg_names[i] if isinstance(i, int) else i for i in dns}
    spec = tuple((name, native_specialize_impl(BaseBackend, a, False, name not in dns, True))
                 for name, a in zip(kernel.arg_names, args))
    return tuple(constexprs.items()), tuple(sorted(options.items())), spec


class Launches:
    """The keys of the recorded launches, per kernel name and phase (``"prefill"`` or the decode step)."""

    def __init__(self):
        self.phase: str | int = "prefill"
        self.keys: dict[str, list[tuple]] = defaultdict(list)

    def add(self, kernel, args, constexprs, options) -> None:
        self.keys[kernel.__name__].append((self.phase, _key(kernel, args, constexprs, options)))

    def at(self, name: str, prefill: bool) -> dict[tuple, list]:
        """Keys of ``name`` launched at the prefill (or at the decode steps), each with its phases."""
        out: dict[tuple, list] = defaultdict(list)
        for phase, key in self.keys[name]:
            if (phase == "prefill") == prefill:
                out[key].append(phase)
        return out


class _Recorded:
    """A ``kernel[grid](*args, **constexprs, **options)`` stand-in that records the launch."""

    def __init__(self, kernel, launches: Launches):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            names = self.kernel.arg_names
            self.launches.add(self.kernel, args, {k: v for k, v in kwargs.items() if k in names},
                              {k: v for k, v in kwargs.items() if k not in names})
        return launch


@pytest.fixture
def launches(monkeypatch):
    """The TurboCache kernels serving CPU tensors as they serve CUDA ones, their launches recorded (not run)."""
    for module in dispatch.TURBO_KERNELS_MODULES:
        dispatch.load_kernels(module)
    monkeypatch.setattr(dispatch, "_REGISTRY", {op: {key: list(impls) for key, impls in keys.items()}
                                                for op, keys in dispatch._REGISTRY.items()})
    for op in ("turbo_compress", "turbo_decode"):
        kernel = dispatch.implementations(op, "turbo")[0]
        assert kernel.name == "triton"

        def unsupported(call, kernel=kernel):
            reason = kernel.unsupported(call)
            return None if reason == NOT_CUDA else reason

        dispatch.register(op, "turbo", Implementation(kernel.name, kernel.priority, unsupported, kernel.run))
    monkeypatch.setattr(turbo_cache, "_WARMED", set(), raising=False)  # what this process warmed: each test its own
    recorded = Launches()
    monkeypatch.setattr(tct, "_turbo_compress_kernel", _Recorded(tct._turbo_compress_kernel, recorded))
    monkeypatch.setattr(tdt, "_turbo_decode_kernel", _Recorded(tdt._turbo_decode_kernel, recorded))
    monkeypatch.setattr(compiled_launch.LaunchPlans, "__call__",
                        lambda plans, grid, args, constexprs, *, plan_key=None, **options:
                        recorded.add(plans.kernel, args, constexprs, options))
    return recorded


def _generation(launches: Launches, *, kv_heads: int, group: int, head_dim: int, prompt: int, steps: int,
                gluon: bool, monkeypatch, warm: bool = True, batch: int = 1,
                remaps: dict[int, Callable[[turbo_cache.TurboCache], torch.Tensor]] | None = None) -> None:
    """A patched one-layer Llama's cache through a prefill of ``prompt`` tokens and ``steps`` decode steps, each
    attended by the model's attention function as a decode step does. ``remaps[step](cache)`` runs before that step
    (a beam search's reorder, say) and returns the rows of the old batch that the new one holds."""
    if gluon:
        monkeypatch.setitem(tdt.GLUON.reasons, CPU, None)  # as on an sm_90 device
    if warm:  # the warm-up of CUDA layers, on the CPU
        monkeypatch.setattr(turbo_cache, "WARM_DEVICES", ("cuda", "cpu"), raising=False)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=group * kv_heads, num_key_value_heads=kv_heads,
                                      head_dim=head_dim)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    k, v = (torch.randn(batch, prompt + steps, kv_heads, head_dim).transpose(1, 2)  # the model's layout
            for _ in range(2))
    with qp.patch_model(model, "turbo", policy="always"):
        attend = transformers.AttentionInterface._global_mapping[model.config._attn_implementation]
        module = model.model.layers[0].self_attn
        cache = turbo_cache.TurboCache(model)
        cache.update(k[:, :, :prompt], v[:, :, :prompt], 0)
        for step in range(1, steps + 1):
            launches.phase = step
            if step in (remaps or {}):
                rows = remaps[step](cache)
                k, v = (x.transpose(1, 2)[rows].transpose(1, 2) for x in (k, v))
            i = prompt + step - 1
            kp, vp = cache.update(k[:, :, i:i + 1], v[:, :, i:i + 1], 0)
            q = torch.randn(k.shape[0], 1, group * kv_heads, head_dim).transpose(1, 2)
            attend(module, q, kp, vp, None, scaling=module.scaling)
        assert cache.layers[0].k_blocks.n_blocks == (prompt + steps) // 64


@pytest.mark.parametrize("gluon, kv_heads, group, head_dim, prompt", [
    (True, 4, 2, 128, 8 * 64),  # 2 splits from the start (on the CPU); 4 KV heads, codes addressed by offsets
    (False, 2, 4, 64, 11 * 64),  # the Triton kernel: 2 splits, 3 from the first flush (12 blocks)
])
def test_decode_steps_launch_one_key_per_kernel_that_the_prefill_compiled(launches, monkeypatch, gluon, kv_heads,
                                                                          group, head_dim, prompt):
    _generation(launches, kv_heads=kv_heads, group=group, head_dim=head_dim, prompt=prompt, steps=70, gluon=gluon,
                monkeypatch=monkeypatch)
    names = ("_turbo_decode_gluon" if gluon else "_turbo_decode_kernel", "_turbo_compress_kernel")
    for name in names:
        at_steps = launches.at(name, prefill=False)
        assert at_steps, name
        if len(at_steps) > 1:  # which constexprs / options / arguments differ, and at which steps
            (a, steps_a), (b, steps_b) = list(at_steps.items())[:2]
            diff = [(x, y) for part_a, part_b in zip(a, b) for x, y in zip(part_a, part_b) if x != y]
            pytest.fail(f"{name}: steps {sorted(set(steps_a))} and {sorted(set(steps_b))} launch different keys: "
                        f"{diff}")
    for name in names:
        assert set(launches.at(name, prefill=False)) <= set(launches.at(name, prefill=True)), \
            f"{name}: a decode step compiles"
    assert 64 in next(iter(launches.at("_turbo_compress_kernel", prefill=False).values()))  # the first flush


def test_a_short_prompt_growing_past_eight_blocks_compiles_nothing_after_the_prefill(launches, monkeypatch):
    """From 20 tokens to 8 blocks: the Triton kernel while no block exists, then the Gluon kernel with one split (the
    reference's roundings), then with several; the prefill compiled all three."""
    _generation(launches, kv_heads=4, group=2, head_dim=128, prompt=20, steps=8 * 64 - 20 + 2, gluon=True,
                monkeypatch=monkeypatch)
    seen = 0
    for name in ("_turbo_compress_kernel", "_turbo_decode_kernel", "_turbo_decode_gluon"):
        at_steps = launches.at(name, prefill=False)
        missing = {min(steps) for key, steps in at_steps.items() if key not in launches.at(name, prefill=True)}
        assert not missing, f"{name}: decode steps {sorted(missing)} compile"
        seen += len(at_steps)
    assert seen == 1 + 1 + 2  # compression; Triton over the buffer alone; Gluon with one split and with several


def test_off_cuda_the_cache_warms_nothing_up(launches, monkeypatch):
    _generation(launches, kv_heads=4, group=2, head_dim=128, prompt=64 + 5, steps=1, gluon=True,
                monkeypatch=monkeypatch, warm=False)
    assert set(launches.keys) == {"_turbo_compress_kernel", "_turbo_decode_gluon"}
    assert [phase for phase, _ in launches.keys["_turbo_compress_kernel"]] == ["prefill"] * 2  # the prompt's K and V
    assert [phase for phase, _ in launches.keys["_turbo_decode_gluon"]] == [1]


@pytest.mark.parametrize("method, arg", [
    ("reorder_cache", torch.tensor([1, 0])),  # beam search: each beam's new parent
    ("batch_select_indices", torch.tensor([1, 0])),
    ("batch_repeat_interleave", 2),
])
def test_batch_maps_keep_a_widths_codes_in_one_tensor_and_launch_the_prefill_keys(launches, monkeypatch, method, arg):
    """A beam search's reorder (and the other batch maps) at step 10 leaves each width's codes views of one tensor,
    evenly spaced: the Gluon kernel keeps its offsets-free variant (``REGULAR``) that the prefill compiled, before and
    after the first flush (step 64)."""

    def remap(cache: turbo_cache.TurboCache) -> torch.Tensor:
        getattr(cache, method)(arg)
        layer = cache.layers[0]
        for blocks in (layer.k_blocks, layer.v_blocks):
            assert len({c.untyped_storage().data_ptr() for c in blocks.codes}) == 1, f"{method}: codes copied apart"
        assert tdt._regular_steps(tdt._group_offsets(tuple(range(4)), layer.k_blocks.codes,
                                                     layer.v_blocks.codes)) is not None
        return torch.arange(2).repeat_interleave(arg) if method == "batch_repeat_interleave" else arg

    _generation(launches, kv_heads=4, group=2, head_dim=128, prompt=8 * 64, steps=70, gluon=True,
                monkeypatch=monkeypatch, batch=2, remaps={10: remap})
    decode = launches.at("_turbo_decode_gluon", prefill=False)
    assert {step for steps in decode.values() for step in steps} == set(range(1, 71))
    assert all(dict(key[0])["REGULAR"] for key in decode), "a decode step looks its heads' codes up by offsets"
    for name in ("_turbo_decode_gluon", "_turbo_compress_kernel"):
        assert set(launches.at(name, prefill=False)) <= set(launches.at(name, prefill=True)), \
            f"{name}: a decode step after {method} compiles"
