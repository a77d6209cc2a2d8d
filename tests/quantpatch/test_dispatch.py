"""quantpatch.dispatch: one registry of implementations per op, priorities, declined reasons, and every op's caller
going through it (a stand-in registered above the others takes its calls)."""

from __future__ import annotations

import sys
import warnings
from types import ModuleType, SimpleNamespace

import pytest
import torch

from quantpatch import dispatch
from quantpatch.dispatch import REFERENCE, Implementation, Quiet
from quantpatch.fallback import QuantpatchFallbackWarning, SiteRecord, reset_fallback_warnings, running_site
from quantpatch.fp8_linear import FP8Linear
from quantpatch.kernels.fp8_linear.fp8_linear_ref import fp8_linear_ref
from quantpatch.kernels.w4a8.w4a8_ref import w4a8_linear_ref
from quantpatch.w4a8_linear import W4A8Linear

CPU_CALL = SimpleNamespace(is_cuda=False, device=torch.device("cpu"))


@pytest.fixture
def registry(monkeypatch):
    """A copy of the registry that the test may change; fallback warnings forgotten before and after."""
    monkeypatch.setattr(dispatch, "_REGISTRY", {op: {key: list(impls) for key, impls in keys.items()}
                                                for op, keys in dispatch._REGISTRY.items()})
    reset_fallback_warnings()
    yield dispatch._REGISTRY
    reset_fallback_warnings()


def _fallback_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, QuantpatchFallbackWarning)]


def _turbo_cache():
    pytest.importorskip("transformers", reason="the TurboCache needs Transformers")
    from quantpatch.patches.transformers import turbo_cache

    return turbo_cache


def test_every_op_has_its_reference_at_priority_0():
    _turbo_cache()  # registers the TurboCache ops' references
    for op, keys in dispatch.OPS.items():
        for key in keys:
            last = dispatch.implementations(op, key)[-1]
            assert (last.name, last.priority) == (REFERENCE, 0), (op, key)
            assert op == "attention" or last.unsupported(CPU_CALL) is None, (op, key)  # takes every call


def test_select_tries_by_priority_and_reports_the_declined(registry):
    registry["fp8_linear"]["fp8"] = []
    for name, priority, reason in [("low", 5, None), ("high", 20, "too long"), ("mid", 10, Quiet("not this device"))]:
        dispatch.register("fp8_linear", "fp8", Implementation(name, priority, lambda call, r=reason: r, None))
    assert [i.name for i in dispatch.implementations("fp8_linear", "fp8")] == ["high", "mid", "low"]
    impl, declined = dispatch.select("fp8_linear", "fp8", CPU_CALL)
    assert impl.name == "low" and declined == ["high: too long", "mid: not this device"]
    dispatch.register("fp8_linear", "fp8", Implementation("low", 1, lambda call: "never", None))  # replaces "low"
    impl, declined = dispatch.select("fp8_linear", "fp8", CPU_CALL)
    assert impl is None and declined == ["high: too long", "mid: not this device", "low: never"]
    assert [i.name for i in dispatch.implementations("fp8_linear", "fp8")].count("low") == 1


def test_register_rejects_an_unknown_op_or_key():
    impl = Implementation("x", 1, lambda call: None, lambda call: None)
    with pytest.raises(ValueError, match="unknown op"):
        dispatch.register("conv", "fp8", impl)
    with pytest.raises(ValueError, match="unknown key"):
        dispatch.register("fp8_linear", "w4a8_fp8", impl)


def test_run_op_warns_once_per_reason_and_records_it(registry):
    registry["fp8_linear"]["fp8"] = []
    ran = []
    dispatch.register("fp8_linear", "fp8", Implementation("declines", 30, lambda call: "a reason", None))
    dispatch.register("fp8_linear", "fp8", Implementation("quiet", 20, lambda call: Quiet("other device"), None))
    dispatch.register("fp8_linear", "fp8", Implementation("takes", 10, lambda call: None,
                                                          lambda call: ran.append(call) or "out"))
    record, running = SiteRecord("layer", "linear", "test"), SiteRecord("attn", "attention", "test")
    with warnings.catch_warnings(record=True) as caught, running_site(running):
        warnings.simplefilter("always")
        outs = [dispatch.run_op("fp8_linear", "fp8", CPU_CALL, what="Layer(4->4)", record=record) for _ in range(2)]
    assert outs == ["out", "out"] and ran == [CPU_CALL, CPU_CALL]
    assert _fallback_warnings(caught) == ["Layer(4->4): a reason; falling back to the takes implementation"]
    assert record.fallbacks == running.fallbacks == {"a reason"} and record.routes == {"takes": 2}


def test_run_op_is_silent_when_only_quiet_reasons_declined(registry):
    registry["turbo_decode"]["turbo"] = []
    dispatch.register("turbo_decode", "turbo", Implementation("gpu", 10, lambda call: Quiet("not CUDA"), None))
    dispatch.register("turbo_decode", "turbo", Implementation(REFERENCE, 0, lambda call: None, lambda call: 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert dispatch.run_op("turbo_decode", "turbo", CPU_CALL, what="x") == 1
    assert not _fallback_warnings(caught)


def test_a_kernel_module_imported_before_its_op_module_registers_when_the_op_module_does(monkeypatch):
    """``on_kernels_import`` after ``load_kernels`` has imported the module (a TurboCache built after ``patch_model``
    of a model without one) registers at once; before, on import."""
    name = "quantpatch.kernels.quant_ref"  # any importable module stands in for a kernel module
    monkeypatch.setattr(dispatch, "_ON_IMPORT", {})
    monkeypatch.setattr(dispatch, "_kernels_tried", set())
    seen: list[ModuleType] = []
    dispatch.load_kernels(name)
    dispatch.on_kernels_import(name, seen.append)
    assert seen == [sys.modules[name]]
    monkeypatch.setattr(dispatch, "_kernels_tried", set())
    dispatch.on_kernels_import(name, seen.append)
    assert len(seen) == 1
    dispatch.load_kernels(name)
    assert seen == [sys.modules[name]] * 2


# --------------------------------------------------------------------------- each op's caller goes through it


def test_w4a8_linear_forward_goes_through_the_registry(registry):
    mod = W4A8Linear.from_linear(torch.nn.Linear(128, 8))
    x = torch.randn(3, 128)
    stand_in = torch.full((3, 8), 7.0)
    dispatch.register("w4a8_linear", "w4a8_fp8", Implementation("stand-in", 100, lambda call: None,
                                                                lambda call: stand_in))
    assert mod(x) is stand_in
    dispatch.register("w4a8_linear", "w4a8_fp8", Implementation("stand-in", 100, lambda call: "not this layer",
                                                                lambda call: stand_in))
    with pytest.warns(QuantpatchFallbackWarning, match=r"W4A8Linear\(128->8\): not this layer; falling back to the "
                                                       "PyTorch reference"):
        y = mod(x)
    assert torch.equal(y, w4a8_linear_ref(x, mod.packed(), mod.bias, compute_dtype=torch.float32))


def test_fp8_linear_forward_goes_through_the_registry_and_counts_the_route(registry):
    layer = FP8Linear.from_linear(torch.nn.Linear(32, 16))
    layer.site = SiteRecord("layer", "linear", "fp8")
    x = torch.randn(2, 5, 32)
    calls = []
    dispatch.register("fp8_linear", "fp8", Implementation(
        "stand-in", 100, lambda call: None if call.x.shape[0] == 2 else Quiet("batch 2 only"),
        lambda call: calls.append(call.layer) or fp8_linear_ref(call.x, layer.weight_fp8, layer.weight_scale,
                                                               layer.bias)))
    y = layer(x)
    layer(x[:1])
    assert calls == [layer] and y.shape == (2, 5, 16)
    assert layer.site.routes == {"stand-in": 1, REFERENCE: 1} and not layer.site.fallbacks


def test_fp8_linear_dispatch_traces_without_graph_breaks():
    layer = FP8Linear.from_linear(torch.nn.Linear(32, 16))
    layer.site = SiteRecord("layer", "linear", "fp8")
    x = torch.randn(4, 32)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(layer)(x)
    assert explained.graph_break_count == 0, [str(b.reason)[:200] for b in explained.break_reasons]


def _turbo_layer(turbo_cache, steps: int = 3):
    layer = turbo_cache.TurboLayer(2, 64, 4)
    gen = torch.Generator().manual_seed(0)
    layer.update(torch.randn(1, 2, 70, 64, generator=gen), torch.randn(1, 2, 70, 64, generator=gen))
    for _ in range(steps):
        layer.update(torch.randn(1, 2, 1, 64, generator=gen), torch.randn(1, 2, 1, 64, generator=gen), direct=True)
    return layer


def test_turbo_decode_goes_through_the_registry(registry):
    turbo_cache = _turbo_cache()
    layer = _turbo_layer(turbo_cache)
    q = torch.randn(1, 4, 1, 64)
    want = turbo_cache.turbo_cache_attention(q, layer)
    seen = []
    dispatch.register("turbo_decode", "turbo", Implementation(
        "stand-in", 100, lambda call: None if call.use_kernel else Quiet("use_kernel=False"),
        lambda call: seen.append((call.layer, call.cfg.qk_granularity)) or torch.zeros_like(call.query)))
    assert torch.equal(turbo_cache.turbo_cache_attention(q, layer), torch.zeros_like(q))
    assert seen == [(layer, "token")]  # Q per token (Algorithm 2)
    assert torch.equal(turbo_cache.turbo_cache_attention(q, layer, use_kernel=False), want)
    assert len(seen) == 1


def test_turbo_compression_goes_through_the_registry(registry):
    turbo_cache = _turbo_cache()
    reference = dispatch.implementations("turbo_compress", "turbo")[-1]
    calls = []
    dispatch.register("turbo_compress", "turbo", Implementation(
        "stand-in", 100, lambda call: None, lambda call: calls.append(call.blocks is None) or reference.run(call)))
    layer = _turbo_layer(turbo_cache, steps=2)
    assert calls == [True, True, False, False, False, False]  # the prompt's K and V, then K and V of each step
    dispatch.register("turbo_compress", "turbo", Implementation("stand-in", 100, lambda call: "no", None))
    with pytest.warns(QuantpatchFallbackWarning, match="TurboCache compression kernel: no; falling back to the "
                                                       "PyTorch reference"):
        again = _turbo_layer(turbo_cache, steps=2)
    assert all(torch.equal(a, b) for a, b in zip(layer.k_blocks.codes + layer.v_blocks.codes,
                                                  again.k_blocks.codes + again.v_blocks.codes))
    assert torch.equal(layer.k_buffer.values, again.k_buffer.values)


def test_a_planned_attention_call_runs_its_plan_from_the_second_call_of_a_signature(registry, monkeypatch):
    """``quantpatch.attention`` keeps the chosen implementation's plan per call signature (shapes, strides, dtypes,
    devices, alignment, mode, causality, scale, policy): the signature's later calls run the plan alone and count
    on their site, a site not yet range-checked takes the whole path once, and any other signature, a mask, an LSE,
    a new registration or forgotten crossovers take the whole path."""
    import quantpatch as qp
    from quantpatch import range_check

    monkeypatch.setattr(dispatch, "_PLANNED", {})
    monkeypatch.setattr(range_check, "_checked_configs", {})
    events = []

    def run(call):
        events.append("run")
        o = torch.zeros_like(call.q)
        return (o, torch.zeros(call.q.shape[:3])) if call.return_lse else o

    def planned(q, k, v):
        events.append("plan")
        return torch.ones_like(q), None

    def plan(call):
        return planned if call.attn_mask is None and not call.return_lse else None

    dispatch.register("attention", "sage2", Implementation("stub", 100, lambda call: None, run, plan))
    q, k, v = (torch.randn(1, 2, 16, 64) for _ in range(3))

    def call(*tensors, **kw):
        return qp.attention(*(tensors or (q, k, v)), mode="sage2-8b", **kw)

    assert torch.equal(call(), torch.zeros_like(q)) and events == ["run"]
    assert torch.equal(call(), torch.ones_like(q)) and events == ["run", "plan"]
    events.clear()
    call(q[:, :, :8], k, v)  # another shape
    call(scale=0.5)
    call(is_causal=True)
    call(policy="speed")  # the CPU runs SDPA under policy="speed": no implementation, no plan
    call(attn_mask=torch.ones(16, 16, dtype=torch.bool))
    call(return_lse=True)
    bshd = [t.transpose(1, 2).contiguous() for t in (q, k, v)]
    call(*bshd, layout="BSHD")  # other strides as BHSD views
    assert events == ["run"] * 3 + ["run"] * 3
    events.clear()
    call(scale=0.5)
    out = call(*bshd, layout="BSHD")
    assert events == ["plan", "plan"] and out.shape == bshd[0].shape and torch.equal(out, torch.ones_like(out))
    with pytest.raises(ValueError, match="layout"):
        call(layout="BSDH")

    site = SiteRecord("layers.0.self_attn", "attention", "sage2-8b")
    events.clear()
    with running_site(site):
        call()  # the site's first call: range-checked on the whole path
        call()
    assert events == ["run", "plan"] and site.routes == {"stub": 2} and site.range_checked

    dispatch.register("attention", "sage2", Implementation("stub", 100, lambda call: None, run, plan))
    events.clear()
    call()
    call()
    dispatch.forget_crossovers()
    call()
    assert events == ["run", "plan", "run"]


def test_a_call_with_a_gradient_to_record_takes_the_reference_not_a_kernel(registry, monkeypatch):
    """No kernel has a backward: with grad mode on and an input requiring a gradient, ``quantpatch.attention``
    declines every implementation but the reference (which autograd records) and neither makes nor runs a plan; under
    ``no_grad`` the kernel runs and its plan follows. The linear ops decline their kernels the same way."""
    import quantpatch as qp
    from quantpatch import range_check

    monkeypatch.setattr(dispatch, "_PLANNED", {})
    monkeypatch.setattr(range_check, "_checked_configs", {})
    events = []

    def run(call):
        events.append("kernel")
        return torch.zeros_like(call.q)

    def plan(call):
        return lambda q, k, v: (events.append("plan"), (torch.ones_like(q), None))[1]

    dispatch.register("attention", "sage2", Implementation("stub", 100, lambda call: None, run, plan))
    q, k, v = (torch.randn(1, 2, 16, 64) for _ in range(3))
    q.requires_grad_()
    for _ in range(2):
        out = qp.attention(q, k, v, mode="sage2-8b")
    assert events == [] and out.grad_fn is not None
    out.float().sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape
    with torch.no_grad():
        qp.attention(q, k, v, mode="sage2-8b")
        qp.attention(q, k, v, mode="sage2-8b")
    assert events == ["kernel", "plan"]
    qp.attention(q, k, v, mode="sage2-8b")
    assert events == ["kernel", "plan"]  # a gradient again: the kept plan is not run
    layer = FP8Linear.from_linear(torch.nn.Linear(32, 16))
    dispatch.register("fp8_linear", "fp8", Implementation("stub", 100, lambda call: None,
                                                          lambda call: events.append("linear kernel")))
    x = torch.randn(4, 32, requires_grad=True)
    with pytest.warns(QuantpatchFallbackWarning, match="a gradient to record"):
        y = layer(x)
    assert y.grad_fn is not None and "linear kernel" not in events
    with torch.no_grad():
        layer(x)
    assert events[-1] == "linear kernel"


@pytest.mark.parametrize("layer_class", ["fp8", "w4a8"])
def test_a_linear_layer_runs_its_planned_call_from_the_second_call_of_a_signature(registry, layer_class):
    """``FP8Linear`` and ``W4A8Linear`` keep, per input signature, the chosen implementation's plan
    (``dispatch.LinearPlans``): that signature's later calls run the plan alone, counted on the layer's site. Another
    signature, a tensor subclass, a gradient to record, an attribute set, a cast and a new registration take the
    whole path again; a plan is made only where no implementation declined the call loudly; a copy of the layer
    starts with none."""
    import copy

    events = []
    linear = torch.nn.Linear(128, 16)
    if layer_class == "fp8":
        op, key, layer = "fp8_linear", "fp8", FP8Linear.from_linear(linear)
        layer.site = SiteRecord("layer", "linear", key)  # W4A8Linear counts on the running site
    else:
        op, key, layer = "w4a8_linear", "w4a8_fp8", W4A8Linear.from_linear(linear)

    def run(call):
        events.append("run")
        return torch.zeros(*call.x.shape[:-1], call.layer.out_features)

    def plan(call):
        return lambda layer, x: (events.append("plan"), torch.ones(*x.shape[:-1], layer.out_features))[1]

    dispatch.register(op, key, Implementation("stub", 100, lambda call: None, run, plan))
    x = torch.randn(2, 3, 128)
    assert not layer(x).any() and layer(x).all() and layer(x.clone()).all()
    assert events == ["run", "plan", "plan"]
    if layer_class == "fp8":
        assert layer.site.routes == {"stub": 3}
    events.clear()
    layer(x[:1])  # another signature
    with pytest.warns(QuantpatchFallbackWarning, match="a gradient to record"):
        layer(x.requires_grad_())  # the reference records the gradient
    with torch.no_grad():
        layer(x)
        layer(torch.nn.Parameter(x.detach(), requires_grad=False))  # a tensor subclass: the whole path
    assert events == ["run", "plan", "run"]
    for change in (lambda: setattr(layer, "what", layer.what), lambda: layer.to(torch.float64),
                   lambda: dispatch.register(op, key, Implementation("stub", 100, lambda call: None, run, plan))):
        change()
        events.clear()
        with torch.no_grad():
            layer(x.to(layer.bias.dtype))
            layer(x.to(layer.bias.dtype))
        assert events == ["run", "plan"]
    twin = copy.deepcopy(layer)
    assert not twin.plans.entries and layer.plans.entries
    events.clear()
    dispatch.register(op, key, Implementation("stub", 100, lambda call: "declined", run, plan))
    dispatch.register(op, key, Implementation("second", 90, lambda call: None, run, plan))
    with torch.no_grad(), pytest.warns(QuantpatchFallbackWarning, match="declined"):
        layer(x.double())
        layer(x.double())
    assert events == ["run", "run"]


def test_fp8_linear_plans_its_original_route_under_the_speed_policy():
    """Under ``policy="speed"`` on the CPU an FP8 layer calls its original ``nn.Linear``: from the second call of a
    signature through its planned call, the same bits and the same route count, and a new activation is followed."""
    from quantpatch.fallback import ORIGINAL_LINEAR_ROUTE

    linear = torch.nn.Linear(64, 32)
    layer = FP8Linear.from_linear(linear)
    layer.original, layer.speed_policy = (linear,), True
    layer.site = SiteRecord("layer", "linear", "fp8")
    x = torch.randn(3, 64)
    with torch.no_grad():
        outs = [layer(x) for _ in range(3)]
        assert all(torch.equal(o, linear(x)) for o in outs) and len(layer.plans.entries) == 1
        layer.activation = "gelu_tanh"
        assert not layer.plans.entries
        gelu = [layer(x) for _ in range(2)]
    assert all(torch.equal(o, linear(torch.nn.functional.gelu(x, approximate="tanh"))) for o in gelu)
    route = ORIGINAL_LINEAR_ROUTE + "the FP8 path off CUDA is the PyTorch reference"
    assert layer.site.routes == {route: 5}


def test_rows_view_is_a_view_with_a_contiguous_last_dim_or_none():
    """A linear op's plan reads ``x`` as ``(M, K)`` rows it views without a copy: none where the last dim is strided
    or the rows would be a copy."""
    x = torch.randn(2, 3, 8)
    rows = dispatch.rows_view(x, 8)
    assert rows.shape == (6, 8) and rows.data_ptr() == x.data_ptr() and rows.stride() == (8, 1)
    assert dispatch.rows_view(x.transpose(1, 2).contiguous().transpose(1, 2), 8) is None  # last dim strided
    assert dispatch.rows_view(x.transpose(0, 1), 8) is None  # (3, 2, 8) rows of two batches: a copy
