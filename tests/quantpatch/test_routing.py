"""policy="speed": route each call to the mode's kernel only where the crossover table says it beats SDPA."""

import json

import pytest
import torch

import quantpatch as qp
from quantpatch import dispatch, routing
from quantpatch.kernels.attention.quant_attention_ref import quant_attention_ref
from quantpatch.synthetic import attention_inputs
from tests.patches.conftest import tiny_model

CUDA = torch.device("cuda", 0)  # a device object only: nothing here touches a GPU
SAGE = qp.get_mode("sage2-8b").attention


@pytest.fixture(autouse=True)
def fresh_tables(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(routing, "arch", lambda device: "sm_90")
    dispatch.forget_crossovers()
    yield
    dispatch.forget_crossovers()


def test_cpu_calls_run_sdpa_and_say_so():
    assert "off the GPU" in dispatch.speed_reason(SAGE, torch.device("cpu"), 128, 32768, 32768, False)


@pytest.mark.parametrize("d, causal, n, quantized", [
    (128, False, 4096, False), (128, False, 8192, True), (128, False, 32768, True),
    (128, True, 4096, False), (128, True, 8192, True), (64, False, 4096, False), (64, False, 8192, True),
    (64, True, 8192, False), (64, True, 16384, True),
])
def test_shipped_sm90_table_decides_by_length(d, causal, n, quantized):
    why = dispatch.speed_reason(SAGE, CUDA, d, n, n, causal)
    assert (why is None) == quantized
    if not quantized:
        assert "sm_90" in why and f"D={d}" in why


def test_a_mode_without_quantized_attention_says_so_rather_than_a_table_entry():
    # mode "off" (FP8 linears alone) still wraps the attention sites: their calls run SDPA for that reason
    why = dispatch.speed_reason(qp.get_mode("off").attention, torch.device("cuda", 0), 128, 32768, 32768, False)
    assert why == "the mode leaves attention unquantized"


def test_cross_attention_over_few_keys_runs_sdpa():
    assert "crossover of 8192" in dispatch.speed_reason(SAGE, CUDA, 128, 32760, 512, False)


def test_turbo_never_wins_on_sm90():
    turbo = qp.get_mode("turbo").attention
    assert "no crossover on sm_90: SDPA as fast or faster at the longest length measured" in \
        dispatch.speed_reason(turbo, CUDA, 128, 32768, 32768, False)


def test_an_entry_a_tuned_table_lacks_runs_sdpa_and_says_so(tmp_path):
    path = routing.user_table_path("sm_90")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"version": routing.TABLE_VERSION,
                                "crossovers": {routing.entry_key("sage2", 128, False): 2048}}))
    assert dispatch.speed_reason(SAGE, CUDA, 128, 4096, 4096, False) is None
    assert f"not measured on sm_90 (D=64, non-causal; {path})" == dispatch.speed_reason(SAGE, CUDA, 64, 32768, 32768,
                                                                                          False)


def test_an_unmeasured_architecture_runs_sdpa(monkeypatch):
    monkeypatch.setattr(routing, "arch", lambda device: "sm_80")
    assert "no measured crossover for sm_80" in dispatch.speed_reason(SAGE, CUDA, 128, 32768, 32768, False)


def test_a_tuned_user_table_takes_precedence(tmp_path):
    path = routing.user_table_path("sm_90")
    assert str(path).startswith(str(tmp_path))
    path.parent.mkdir(parents=True)
    key = routing.entry_key("sage2", 128, False)
    path.write_text(json.dumps({"version": routing.TABLE_VERSION, "crossovers": {key: 2048}}))
    assert dispatch.speed_reason(SAGE, CUDA, 128, 2048, 2048, False) is None
    assert str(path) in dispatch.speed_reason(SAGE, CUDA, 128, 1024, 1024, False)


def test_the_shipped_sm90_table_is_the_later_crossover_of_the_measured_h200_and_h100_tables():
    """Per entry the later crossover (None, never, the latest) of the H200's table, whose int8-flash and fireq
    (per-token scales) entries come from the later tune of those two modes, and the H100's; turbo never routed to its
    prefill kernel."""
    from pathlib import Path

    results = Path(__file__).resolve().parents[2] / "eval/results/tune"
    shipped = dict(routing.SHIPPED["sm_90"])
    assert shipped.pop(routing.TURBO_CACHE) == 8 * 32768  # from model-level decode runs (its comment), not tune
    turbo = {key: shipped.pop(key) for key in list(shipped) if key.startswith("turbo/")}
    assert len(turbo) == 4 and set(turbo.values()) == {None}  # not in the measured runs: never routed to its kernel
    h200 = routing.read_table(results / "crossovers-sm_90.json")
    token_scales = routing.read_table(results / "crossovers-sm_90-token-scales.json")
    assert {key.split("/")[0] for key in token_scales} == {"int8_flash", "fireq"}
    h200 |= token_scales
    h100 = routing.read_table(results / "crossovers-sm_90-h100.json")
    assert h100.keys() == h200.keys() == shipped.keys()
    later = {key: None if h200[key] is None or h100[key] is None else max(h200[key], h100[key]) for key in h200}
    assert shipped == later
    assert sum(shipped[key] != h200[key] for key in shipped) == 5  # where the H100 needs longer calls


def test_turbo_cache_crossover_is_shipped_kept_from_a_tuned_table_or_absent():
    assert routing.turbo_cache_crossover(CUDA) == (8 * 32768, "shipped sm_90 table")
    assert routing.turbo_cache_crossover(torch.device("cpu")) == (None, "no crossover table for cpu")
    path = routing.user_table_path("sm_90")
    path.parent.mkdir(parents=True)
    key = routing.entry_key("sage2", 128, False)
    path.write_text(json.dumps({"version": routing.TABLE_VERSION, "crossovers": {key: 2048}}))  # tune's output
    assert routing.turbo_cache_crossover(CUDA) == (8 * 32768, "shipped sm_90 table")
    path.write_text(json.dumps({"version": routing.TABLE_VERSION, "crossovers": {routing.TURBO_CACHE: 4096}}))
    routing.forget_tables()
    assert routing.turbo_cache_crossover(CUDA) == (4096, str(path))


def test_turbo_cache_crossover_of_an_unmeasured_architecture_is_none(monkeypatch):
    monkeypatch.setattr(routing, "arch", lambda device: "sm_80")
    assert routing.turbo_cache_crossover(CUDA) == (None, "no crossover table for sm_80")


@pytest.mark.parametrize("content", ["{not json", json.dumps({"version": 99, "crossovers": {}}),
                                     json.dumps({"version": 1, "crossovers": {"sage2/d128/full": -4}})])
def test_a_malformed_user_table_warns_and_the_shipped_one_serves(content, caplog):
    path = routing.user_table_path("sm_90")
    path.parent.mkdir(parents=True)
    path.write_text(content)
    with caplog.at_level("WARNING", logger="quantpatch"):
        why = dispatch.speed_reason(SAGE, CUDA, 128, 4096, 4096, False)
    assert "shipped sm_90 table" in why and str(path) in caplog.text


@pytest.mark.parametrize("lengths, ratios, expected", [
    ([1024, 2048, 4096, 8192], [0.5, 0.9, 1.1, 1.3], 4096),
    ([1024, 2048, 4096, 8192], [0.5, 1.1, 0.9, 1.3], 8192),  # must win at every longer length
    ([1024, 2048], [0.5, 0.9], None),
    ([1024, 2048], [1.2, 1.3], 1024),
])
def test_crossover_is_the_first_length_that_wins_from_there_on(lengths, ratios, expected):
    assert routing.crossover(lengths, ratios) == expected


def test_tune_writes_a_table_from_measured_times(tmp_path):
    # scripted timings (sdpa, quantized) per length, measured twice: the quantized call wins at 32 tokens once and
    # loses the second time (the lower ratio is kept), and wins both times at 64
    per_length = {16: [1.0, 2.0, 1.0, 2.0], 32: [1.0, 0.5, 1.0, 1.25], 64: [1.0, 0.5, 1.0, 0.5]}
    script = iter([t for n in (16, 32, 64) for t in per_length[n]] * 2)  # non-causal, then causal
    calls = []

    def timer(fn):
        calls.append(fn())  # the timed calls really run (CPU, tiny shapes)
        return next(script)

    out = tmp_path / "table.json"
    table = routing.tune(modes=["sage2-8b"], head_dims=[32], lengths=[16, 32, 64], heads=2, device="cpu",
                         timer=timer, out=out)
    assert len(calls) == 24
    assert table["ratios"]["sage2/d32/full"] == {"16": 0.5, "32": 0.8, "64": 2.0}
    assert table["crossovers"] == {"sage2/d32/full": 64, "sage2/d32/causal": 64}
    assert routing.read_table(out) == table["crossovers"]
    single = iter([1.0, 2.0, 1.0, 0.5, 1.0, 0.5] * 2)  # once: the win at 32 tokens stands
    one = routing.tune(modes=["sage2-8b"], head_dims=[32], lengths=[16, 32, 64], heads=2, device="cpu",
                       timer=lambda fn: next(single), repeats=1, out=out)
    assert one["crossovers"]["sage2/d32/full"] == 32
    with pytest.raises(ValueError, match="repeats"):
        routing.tune(modes=["sage2-8b"], repeats=0, device="cpu", out=out)


def test_tune_refreshes_the_routing_decisions_this_process_made():
    assert "not measured on sm_90 (D=32" in dispatch.speed_reason(SAGE, CUDA, 32, 16, 16, False)  # now cached
    times = iter([1.0, 0.5] * 6)  # SDPA, then sage2-8b twice as fast, at each length, non-causal then causal
    routing.tune(modes=["sage2-8b"], head_dims=[32], lengths=[16, 32, 64], heads=2, device="cpu",
                 timer=lambda fn: next(times), repeats=1, out=routing.user_table_path("sm_90"))
    assert dispatch.speed_reason(SAGE, CUDA, 32, 16, 16, False) is None


def test_invalid_policy_is_refused():
    q, k, v = attention_inputs("randn", heads=2, seq_q=8, head_dim=32)
    with pytest.raises(ValueError, match="policy='fast'"):
        qp.attention(q, k, v, mode="sage2-8b", policy="fast")
    with pytest.raises(ValueError, match="policy="):
        qp.patch_model(tiny_model("llama"), "sage2-8b", policy="fast")


def test_functional_speed_policy_on_cpu_is_sdpa_and_always_is_the_reference():
    q, k, v = attention_inputs("randn", heads=2, seq_q=40, head_dim=64)
    fast = qp.attention(q, k, v, mode="sage2-8b", is_causal=True, policy="speed")
    exact = qp.attention(q, k, v, mode="off", is_causal=True)
    assert torch.equal(fast, exact)
    always = qp.attention(q, k, v, mode="sage2-8b", is_causal=True, policy="always")
    torch.testing.assert_close(always, quant_attention_ref(q, k, v, SAGE, is_causal=True).to(always.dtype))


@pytest.mark.parametrize("mode", ["sage2-8b", "int8-flash", "turbo", "fireq"])
def test_patched_model_on_cpu_is_bitwise_unpatched_and_reports_its_routes(mode):
    model = tiny_model("llama")
    ids = torch.randint(3, 100, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
        with qp.patch_model(model, mode) as handle:
            out = model(ids).logits
            model(ids[:, :10])
    assert torch.equal(out, ref)
    for site in handle.sites:
        if site.kind == "attention":  # (turbo's generate site counts generate() calls: none here)
            assert site.routes == {"sdpa: SDPA is faster than the PyTorch reference off the GPU": 2}
        else:
            assert (site.kind, site.routes) == ("kv cache", {})
    assert "2 calls: sdpa: SDPA is faster" in handle.report() and "policy 'speed'" in handle.report()


def test_speed_policy_takes_the_kernel_where_the_table_says_it_wins(monkeypatch):
    """With a crossover of 16 tokens (mocked) the patched sites run the mode's implementation from 16 tokens on."""
    monkeypatch.setattr(dispatch, "speed_reason",
                        lambda cfg, device, d, nq, nk, causal: None if min(nq, nk) >= 16 else "short")
    import quantpatch.patches.transformers.attention as attention_patch

    monkeypatch.setattr(attention_patch, "speed_reason", dispatch.speed_reason)
    model = tiny_model("llama")
    with torch.no_grad(), qp.patch_model(model, "sage2-8b") as handle:
        model(torch.randint(3, 100, (1, 20)))
        model(torch.randint(3, 100, (1, 8)))
    # on the CPU only the reference takes the long call: the speed policy still prefers SDPA, saying why
    routes = handle.sites[0].routes
    assert routes["sdpa: short"] == 1
    assert [r for r in routes if r.startswith("sdpa: only the PyTorch reference")]


def test_tune_command_needs_a_gpu_and_says_so(capsys, monkeypatch):
    from quantpatch.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["tune"]) == 2
    assert "needs CUDA" in capsys.readouterr().err


def test_tune_command_prints_and_writes_the_table(capsys, monkeypatch, tmp_path):
    from quantpatch.cli import main

    seen = {}

    def fake_tune(modes, head_dims, lengths, *, heads, repeats, out):
        seen.update(modes=modes, head_dims=head_dims, lengths=lengths, heads=heads, repeats=repeats, out=out)
        return {"crossovers": {"sage2/d128/full": 8192, "turbo/d128/full": None}}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(routing, "tune", fake_tune)
    assert main(["tune", "--modes", "sage2-8b", "--lengths", "1024", "2048", "--out", str(tmp_path / "t.json")]) == 0
    out = capsys.readouterr().out
    assert "from 8192 tokens" in out and "never" in out
    assert seen["modes"] == ["sage2-8b"] and seen["lengths"] == [1024, 2048] and seen["out"] == tmp_path / "t.json"
    assert seen["repeats"] == 2


def test_the_speed_decision_traces_without_a_graph_break():
    """torch.compile(fullgraph=True) of a function that asks for the route (a CUDA device object, shapes from a
    tensor): the table lookup is a constant to dynamo."""

    def route(x):
        why = dispatch.speed_reason(SAGE, CUDA, 128, x.shape[0], x.shape[0], False)
        return x * 2 if why is None else x * 3

    torch._dynamo.reset()
    assert route(torch.ones(8192)).eq(2).all()  # eager first, as after patch_model's preload on a GPU machine
    compiled = torch.compile(route, fullgraph=True)
    assert torch.equal(compiled(torch.ones(8192)), torch.full((8192,), 2.0))
    assert torch.equal(compiled(torch.ones(4096)), torch.full((4096,), 3.0))
