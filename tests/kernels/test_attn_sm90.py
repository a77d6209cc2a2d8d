"""The one-warpgroup Gluon kernel (:mod:`quantpatch.kernels.attention.one_warpgroup_gluon`: sage2 without smooth Q,
int8-flash, fireq) against the Triton kernel over the same operands.

Both take key blocks of 128, but this kernel takes a program's blocks last first (the tail or causal diagonal
blocks, the only masked ones), so P̂ is rounded against another running max: a different draw of the same FP8 /
INT8 rounding noise. The bounds are those of ``test_attention_gluon.py``: err(kernel) ≤ NOISE_FACTOR · err(triton)
+ OUT_TOL against float64; sage2's LSE within LSE_ATOL of the Triton kernel's; int8-flash's (ℓ from P̂) as close to
float64's as the Triton kernel's, within NOISE_FACTOR and LSE_ATOL. GPU only (Gluon has no interpreter), sm_90;
the launcher's checks run everywhere.
"""

import math

import pytest
import torch

from quantpatch.synthetic import attention_inputs
from tests.gpu import assert_graph_replays_follow_eager, hopper, needs_cuda
from tests.kernels.test_attention_gluon import assert_as_accurate_as_triton

# (64, 4100): 4 keys in the last block, a 64-key span of padding keys; causal (239, 113): rows that see no key
SHAPES = [(1, 1), (113, 203), (239, 239), (1000, 1000), (203, 4096), (64, 4100)]
CAUSAL_SHAPES = [(1, 1), (113, 203), (239, 113), (1000, 1000), (203, 4096), (64, 4100)]


def _operands(nq, nk, head_dim, mode, seed, options=None):
    """bf16 inputs with outliers (GQA: 4 heads over 2) and their quantized operands, Vᵀ's keys in the wgmma order;
    ``options``: attention fields overriding the mode's (``get_mode``)."""
    import quantpatch as qp
    from quantpatch.kernels.attention import fast_paths
    from quantpatch.kernels.attention.qk_quant_triton import quantize_qkv

    q, k, v = attention_inputs("outliers", batch=2, heads=4, kv_heads=2, seq_q=nq, seq_k=nk, head_dim=head_dim,
                               seed=seed)
    q, k, v = (t.to("cuda", torch.bfloat16) for t in (q, k, v))
    cfg = qp.get_mode(mode, **(options or {})).attention
    return quantize_qkv(q, k, v, **fast_paths.quant_options(cfg), v_key_order=True), cfg, (q, k, v)


@pytest.mark.gpu
@needs_cuda
@hopper
@pytest.mark.parametrize("shape", range(len(SHAPES)))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("mode, options, stages", [("sage2-8b", {}, 1), ("sage2-8b", {}, 2), ("int8-flash", {}, 2),
                                                   ("fireq", {}, 2), ("fireq", {"two_level_accum": True}, 2)])
def test_gpu_sm90_matches_the_triton_kernel(shape, causal, head_dim, mode, options, stages):
    from quantpatch.kernels.attention.one_warpgroup_gluon import attn_qk_int8_pv_fp8_sm90
    from quantpatch.kernels.attention.pingpong_gluon import permute_v_keys
    from quantpatch.kernels.attention.quant_attn_triton import attn_qk_int8_pv_fp8

    nq, nk = (CAUSAL_SHAPES if causal else SHAPES)[shape]
    x, cfg, qkv = _operands(nq, nk, head_dim, mode, seed=nq + nk + head_dim, options=options)
    plain = x._replace(v_hat_t=permute_v_keys(x.v_hat_t, inverse=True))
    ref, ref_lse = attn_qk_int8_pv_fp8(plain, nk, is_causal=causal, return_lse=True, block_q=cfg.block_q,
                                       block_m=64, block_n=128, num_warps=4, num_stages=2,
                                       l_from_quantized_p=cfg.l_from_quantized_p, two_level_accum=cfg.two_level_accum)
    out, lse = attn_qk_int8_pv_fp8_sm90(x, nk, qk_granularity=cfg.qk_granularity, is_causal=causal,
                                        return_lse=True, stages=stages, two_level_accum=cfg.two_level_accum)
    assert_as_accurate_as_triton("sm90", out, lse, ref, ref_lse, qkv, cfg, causal)


@pytest.mark.gpu
@needs_cuda
@hopper
def test_gpu_sm90_without_lse_gives_the_same_output():
    """The LSE switch compiles another kernel: its output bits are the ones with the LSE."""
    from quantpatch.kernels.attention.one_warpgroup_gluon import attn_qk_int8_pv_fp8_sm90

    x, cfg, _ = _operands(300, 1000, 128, "sage2-8b", seed=7)
    out, lse = attn_qk_int8_pv_fp8_sm90(x, 1000, is_causal=True)
    with_lse, _ = attn_qk_int8_pv_fp8_sm90(x, 1000, is_causal=True, return_lse=True)
    assert lse.numel() == 0
    assert torch.equal(out, with_lse)


def _cpu_operands(head_dim=128, v_dtype=torch.float8_e4m3fn, v_scale_shape=(1, 1, 128), delta_s=(0,),
                  qk_dtype=torch.int8, k_dtype=None):
    from quantpatch.kernels.attention.qk_quant_triton import QuantizedQKV

    f32, empty = torch.float32, torch.empty(0)
    return QuantizedQKV(torch.zeros(1, 1, 100, head_dim).to(qk_dtype), torch.ones(1, 1, 100), empty,
                        torch.zeros(1, 1, 128, head_dim).to(k_dtype or qk_dtype), torch.ones(1, 1, 128), empty,
                        torch.zeros(delta_s),
                        torch.zeros(1, 1, head_dim, 128).to(v_dtype), torch.ones(v_scale_shape, dtype=f32), empty)


@pytest.mark.parametrize("operands, call, match", [
    (dict(delta_s=(1, 1, 1, 128)), {}, "smooth Q"),
    (dict(head_dim=96, v_scale_shape=(1, 1, 96)), {}, "head_dim 96"),
    ({}, dict(qk_granularity="block"), "qk_granularity"),
    (dict(v_dtype=torch.int8), {}, "INT8 V and one V scale"),
    (dict(v_scale_shape=(1,)), {}, "per-channel V scales"),
    (dict(qk_dtype=torch.float8_e4m3fn, v_scale_shape=(1,)), {}, "per-token scales"),  # per-thread FP8 groups
    (dict(qk_dtype=torch.float8_e4m3fn), dict(qk_granularity="token"), "with one scale"),
    (dict(qk_dtype=torch.float8_e4m3fn, v_dtype=torch.int8, v_scale_shape=(1,)), dict(qk_granularity="token"),
     "e4m3 V"),
    (dict(qk_dtype=torch.float8_e4m3fn, k_dtype=torch.int8, v_scale_shape=(1,)), dict(qk_granularity="token"),
     "e4m3 Q/K"),
])
def test_sm90_launcher_rejects_what_the_kernel_does_not_compute(operands, call, match):
    """Checked before anything reaches the GPU: ΔS (smooth Q), other head dims, unknown Q/K groups, operands of none
    of its numerics (FP8 Q/K: fireq's per-token scales, e4m3 K and V, one V scale)."""
    from quantpatch.kernels.attention.one_warpgroup_gluon import attn_qk_int8_pv_fp8_sm90

    with pytest.raises(ValueError, match=match):
        attn_qk_int8_pv_fp8_sm90(_cpu_operands(**operands), 100, **call)


@pytest.mark.parametrize("field, bad", [
    ("k_hat", lambda t: t.transpose(2, 3).contiguous().transpose(2, 3)),  # (B, Hkv, Nk_pad, D) but D-major
    ("v_hat_t", lambda t: t[..., :64]),  # unpadded keys
    ("k_scale", lambda t: t.view(1, 128, 1)),
])
def test_sm90_launcher_rejects_operands_tma_cannot_read(field, bad):
    """The TMA descriptors describe K̂, V̂ᵀ and the K scales by their expected shapes and contiguous strides: anything
    else is rejected, not read out of bounds."""
    from quantpatch.kernels.attention.one_warpgroup_gluon import attn_qk_int8_pv_fp8_sm90

    x = _cpu_operands()
    with pytest.raises(ValueError, match="TMA reads contiguous"):
        attn_qk_int8_pv_fp8_sm90(x._replace(**{field: bad(getattr(x, field))}), 100)


@pytest.mark.parametrize("mode, options, d, causal, n, expected", [
    ("sage2-8b", {}, 128, False, 1024, "sm90"), ("sage2-8b", {}, 64, False, 8192, "sm90"),
    ("sage2-8b", {}, 128, True, 2048, "triton"), ("sage2-8b", {}, 128, True, 4096, "sm90"),
    ("int8-flash", {}, 64, True, 16384, "sm90"), ("sage2-8b", {}, 128, False, 512, "triton"),
    ("sage2-4b", {}, 128, False, 8192, "gluon"), ("sage2-4b", {}, 64, False, 8192, "triton"),
    ("fireq", {}, 128, False, 8192, "sm90"), ("fireq", {}, 64, True, 8192, "sm90"),
    ("fireq", {}, 128, False, 512, "triton"), ("fireq", {"two_level_accum": True}, 128, False, 8192, "sm90"),
    ("fireq", {"l_from_quantized_p": True}, 128, False, 8192, "triton"), ("turbo", {}, 128, False, 8192, "triton"),
])
def test_route_prefers_the_sm90_kernel_where_it_measured_faster(monkeypatch, mode, options, d, causal, n, expected):
    """On an sm_90 device (the gate mocked open): sage2 without smooth Q, int8-flash and fireq (one- or two-level P̂·V,
    ℓ from P̃) from SM90_MIN_KEYS keys, smooth Q (sage2-4b) on the ping-pong kernel at D=128, everything else on the
    Triton kernel; on a CPU, Triton."""
    from quantpatch.kernels.attention import fast_paths

    if fast_paths._attn_sm90 is None:
        pytest.skip(f"the Gluon kernels do not import here: {fast_paths._GLUON_IMPORT_ERROR}")
    import quantpatch as qp

    cfg = qp.get_mode(mode, **options).attention
    cpu = torch.device("cpu")
    assert fast_paths.attention_kernel(cfg, cpu, d, n, n, causal) == "triton"

    class OpenGate:
        @staticmethod
        def unsupported(device):
            return None

    monkeypatch.setattr(fast_paths, "ATTENTION_GLUON", OpenGate)
    assert fast_paths.attention_kernel(cfg, cpu, d, n, n, causal) == expected


def _launch_operands(b=1, h=2, hkv=1, nq=100, nk_pad=128, head_dim=128, int8_flash=False):
    """CPU operands of the launcher's shapes (contents unused): sage2 (FP8 V, per-channel scales) or int8-flash."""
    from quantpatch.kernels.attention.qk_quant_triton import QuantizedQKV

    i8, empty = torch.int8, torch.empty(0)
    v_hat_t = torch.zeros(b, hkv, head_dim, nk_pad, dtype=i8)
    v_hat_t, v_scale = (v_hat_t, torch.ones(1)) if int8_flash else (v_hat_t.to(torch.float8_e4m3fn),
                                                                    torch.ones(b, hkv, head_dim))
    return QuantizedQKV(torch.zeros(b, h, nq, head_dim, dtype=i8), torch.ones(b, h, nq), empty,
                        torch.zeros(b, hkv, nk_pad, head_dim, dtype=i8), torch.ones(b, hkv, nk_pad), empty, empty,
                        v_hat_t, v_scale, empty)


def test_sm90_plan_key_determines_the_specialization(monkeypatch):
    """The launcher keys its launch plan on three dtypes and the specialization of its tensor and int arguments, not
    on the TMA descriptors' (built per call; their dtype, block shape and layout follow from the constexprs and those
    dtypes): calls with one key have one specialization of every argument as Triton computes it. The descriptors
    describe K̂, V̂ᵀ and the K scales as the 2-D / 1-D views Triton's ``from_tensor`` would take."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from quantpatch.kernels.attention import one_warpgroup_gluon as sm90
    from quantpatch.kernels.compiled_launch import specialization

    calls = []
    monkeypatch.setattr(sm90, "_LAUNCH", lambda grid, args, constexprs, plan_key, **options: calls.append(
        (args, (plan_key, tuple(constexprs.items()), tuple(options.items())))))
    variants = [(dict(nq=nq), dict(nk=nk)) for nq in (100, 112, 1, 64) for nk in (100, 113, 128, 1)]
    variants += [(dict(b=2, h=16, hkv=4, nk_pad=256), dict(nk=250)), (dict(b=2, h=16, hkv=16), dict(nk=97)),
                 (dict(head_dim=64), dict(nk=100, return_lse=True)), (dict(), dict(nk=100, out_dtype=torch.float16)),
                 (dict(int8_flash=True), dict(nk=100, qk_granularity="token")), (dict(nq=3000), dict(nk=100))]
    for shape, call in variants:
        sm90.attn_qk_int8_pv_fp8_sm90(_launch_operands(**shape), **call)
    plans = {}
    for args, key in calls:
        assert plans.setdefault(key, specialization(args)) == specialization(args)
    assert len(plans) < len(calls)  # lengths of one class share a plan

    x = _launch_operands(b=2, h=4, hkv=2, nk_pad=256)
    calls.clear()
    sm90.attn_qk_int8_pv_fp8_sm90(x, 200)
    k_desc, vt_desc, ks_desc = calls[0][0][1:4]
    layouts = sm90.shared_layouts(128, 128)
    views = (x.k_hat.view(-1, 128), [128, 128]), (x.v_hat_t.view(-1, 256), [128, 128]), (x.k_scale.view(-1), [128])
    for desc, (view, block), layout in zip((k_desc, vt_desc, ks_desc), views, layouts):
        ref = TensorDescriptor.from_tensor(view, block, layout)
        assert desc.base.data_ptr() == ref.base.data_ptr() and desc.base.dtype == ref.base.dtype
        assert (list(desc.shape), list(desc.strides), list(desc.block_shape), desc.layout) == (
            list(ref.shape), list(ref.strides), list(ref.block_shape), ref.layout)


def _general_path(q, k, v, cfg, causal):
    """The output of the general sm90 path (``quantize_qkv`` then ``_attend``, tensors of their own)."""
    from quantpatch.kernels.attention import fast_paths

    quant_kw, options = fast_paths.prefill_options(cfg, q.device, q.shape[-1], q.shape[2], k.shape[2],
                                                   is_causal=causal, sm_scale=1.0 / math.sqrt(q.shape[-1]),
                                                   return_lse=False, out_dtype=q.dtype)
    assert options[14] == "sm90"  # the route under test
    return fast_paths._attend(*fast_paths.quantize_qkv(q, k, v, **quant_kw), *options)[0]


@pytest.mark.gpu
@needs_cuda
@hopper
@pytest.mark.parametrize("mode, head_dim, causal, nq, nk", [
    ("sage2-8b", 128, False, 1000, 1100), ("sage2-8b", 64, False, 203, 4100), ("sage2-8b", 128, True, 239, 4096),
    ("int8-flash", 128, False, 1000, 1100), ("int8-flash", 64, True, 4097, 4097), ("fireq", 128, False, 1000, 1100),
    ("fireq", 64, True, 4097, 4097)])
def test_gpu_sm90_prefill_plan_gives_the_general_paths_bits(mode, head_dim, causal, nq, nk):
    """``quantized_attention``'s later calls of one signature (``Sm90Prefill``: the quantized operands carved from one
    allocation and launched by address) give the general path's output bit for bit on new input contents, after the
    launch plans are cleared too (the bound launches keep their kernels)."""
    import quantpatch as qp
    from quantpatch.kernels.attention import fast_paths

    cfg = qp.get_mode(mode).attention

    def inputs(seed):
        q, k, v = attention_inputs("outliers", batch=2, heads=4, kv_heads=2, seq_q=nq, seq_k=nk, head_dim=head_dim,
                                   seed=seed)
        return [t.to("cuda", torch.bfloat16) for t in (q, k, v)]

    def call(q, k, v):
        return fast_paths.quantized_attention(q, k, v, cfg, is_causal=causal)[0]

    sets = [inputs(seed) for seed in range(4)]
    first = call(*sets[0])
    plan = fast_paths._sm90_prefill(*sets[0], cfg, causal, 1.0 / math.sqrt(head_dim))
    assert plan is not None and plan.attend is not None
    later = [call(*s) for s in sets[1:3]]
    for p in fast_paths.PREFILL_PLANS:
        p.clear()
    after_clear = call(*sets[3])
    assert plan.attend is not None  # its bound launches keep their kernels
    for out, s in zip([first, *later, after_clear], sets):
        assert torch.equal(out, _general_path(*s, cfg, causal))
    assert not torch.equal(later[0], later[1])


@pytest.mark.gpu
@needs_cuda
@hopper
@pytest.mark.parametrize("mode, causal, layout", [("sage2-8b", False, "BHSD"), ("fireq", True, "BHSD"),
                                                  ("sage2-8b", False, "BSHD")])
def test_gpu_a_planned_attention_call_gives_the_whole_paths_bits(mode, causal, layout):
    """``quantpatch.attention``'s later calls of a signature run the kept ``Sm90Prefill`` alone (``dispatch``'s
    planned calls, the launches bound to their plans) and give the whole path's output bit for bit, on new input
    contents, in either layout (BSHD: Diffusers' processors)."""
    import quantpatch as qp
    from quantpatch import dispatch

    cfg = qp.get_mode(mode).attention

    def inputs(seed):
        q, k, v = attention_inputs("outliers", batch=1, heads=4, kv_heads=2, seq_q=4000, seq_k=4100, head_dim=128,
                                   seed=seed)
        return [t.to("cuda", torch.bfloat16) for t in (q, k, v)]

    def as_layout(t):  # BSHD storage seen as BHSD views
        return t.transpose(1, 2).contiguous().transpose(1, 2) if layout == "BSHD" else t

    def call(q, k, v):
        args = [as_layout(t) for t in (q, k, v)]
        if layout == "BSHD":
            args = [t.transpose(1, 2) for t in args]
        o = qp.attention(*args, mode=mode, is_causal=causal, layout=layout, strict=True)
        return o.transpose(1, 2) if layout == "BSHD" else o

    sets = [inputs(seed) for seed in range(3)]
    dispatch.forget_crossovers()
    first = call(*sets[0])
    views = [as_layout(t) for t in sets[1]]
    name, _, plan = dispatch.planned_attention(dispatch.attention_signature(*views, mode, causal, None, "always"))
    assert name == "triton" and plan.quantize.bound is not None and plan.attend.bound is not None
    later = [call(*s) for s in sets[1:]]
    for out, s in zip([first, *later], sets):
        assert torch.equal(out, _general_path(*[as_layout(t) for t in s], cfg, causal))
    assert not torch.equal(later[0], later[1])


@pytest.mark.gpu
@needs_cuda
@hopper
def test_gpu_sm90_prefill_plan_replays_in_a_cuda_graph():
    """The plan's workspace comes from the graph's pool while a CUDA graph captures: replays follow the captured
    inputs' new contents, bit for bit against eager calls between them."""
    import quantpatch as qp
    from quantpatch.kernels.attention import fast_paths

    cfg = qp.get_mode("sage2-8b").attention

    def inputs(seed):
        q, k, v = attention_inputs("outliers", batch=1, heads=4, seq_q=2000, head_dim=128, seed=seed)
        return [t.to("cuda", torch.bfloat16) for t in (q, k, v)]

    def call(q, k, v):
        return fast_paths.quantized_attention(q, k, v, cfg)[0]

    assert_graph_replays_follow_eager(call, [t.clone() for t in inputs(5)], inputs(6))


def test_a_kept_sm90_launch_holds_no_operand(monkeypatch):
    """``Sm90Launch`` (kept per call signature by the sm90 plan) checks its TMA descriptors on the first call's
    operands but keeps them without a base, so the quantized K̂, V̂ᵀ and K scales of that call are freed with it;
    each launch names the operands it is given."""
    import gc
    import weakref

    from quantpatch.kernels.attention import one_warpgroup_gluon as sm90

    x = _launch_operands(b=2, h=4, hkv=2, nk_pad=256)
    launch = sm90.Sm90Launch(x, 200)
    assert all(desc.base is None for desc in launch.descriptors)
    alive = [weakref.ref(t) for t in (x.k_hat, x.v_hat_t, x.k_scale)]
    del x
    gc.collect()
    assert all(ref() is None for ref in alive)
    calls = []
    monkeypatch.setattr(sm90, "_LAUNCH", lambda grid, args, constexprs, **options: calls.append(args))
    y = _launch_operands(b=2, h=4, hkv=2, nk_pad=256)
    launch(y, *launch.outputs(torch.device("cpu")))
    assert all(desc.base is t for desc, t in zip(calls[0][1:4], (y.k_hat, y.v_hat_t, y.k_scale)))
    assert all(desc.base is None for desc in launch.descriptors)


def test_sm90_prefill_plans_by_signature_and_rebuild_a_lost_launch_plan(monkeypatch):
    """``_sm90_prefill`` keeps one ``Sm90Prefill`` per call signature (shapes, strides, dtypes, devices, 16-byte
    alignment, causal, scale) and None where the route is not sm90 or a head dim is not contiguous; a plan's first
    call takes the general path, later ones carve and launch by address, and a call whose launch plan is gone
    (``LookupError``) takes the general path again. The launches are stubbed (CPU)."""
    import quantpatch as qp
    from quantpatch.kernels.attention import fast_paths

    cfg = qp.get_mode("sage2-8b").attention
    q, k, v = (torch.randn(1, 2, 300, 128, dtype=torch.bfloat16) for _ in range(3))
    route = {"kernel": "sm90"}
    monkeypatch.setattr(fast_paths, "attention_kernel", lambda *args: route["kernel"])
    monkeypatch.setattr(fast_paths, "_SM90_PREFILLS", {})
    events = []

    class Quantize:
        scratch_size = (4, 1)
        lost = False

        def carve(self, device):
            return torch.empty(8, dtype=torch.uint8), "addresses"

        def launch(self, q, k, v, x, scratch):
            if self.lost:
                raise LookupError("gone")
            events.append(("launch", x))

    class Attend:
        out_shape = (1, 2, 300, 128)

        def __call__(self, x, o, lse, device=None):
            events.append(("attend", x))

    def general(self, q, k, v):
        events.append("general")
        self.quantize, self.attend, self.lse = Quantize(), Attend(), torch.empty(0)
        return torch.zeros(self.attend.out_shape, dtype=q.dtype)

    monkeypatch.setattr(fast_paths.Sm90Prefill, "_general", general)
    monkeypatch.setattr(fast_paths.qk_quant_triton, "stats_scratch", lambda device, part, heads: None)
    plan = fast_paths._sm90_prefill(q, k, v, cfg, False, 0.1)
    assert fast_paths._sm90_prefill(q, k, v, cfg, False, 0.1) is plan
    for other in ((q, k, v, cfg, True, 0.1), (q, k, v, cfg, False, 0.2), (q[:, :, 1:], k, v, cfg, False, 0.1)):
        assert fast_paths._sm90_prefill(*other) not in (None, plan)
    strided = q.transpose(2, 3).contiguous().transpose(2, 3)  # head dim not contiguous: the general path
    assert fast_paths._sm90_prefill(strided, k, v, cfg, False, 0.1) is None
    route["kernel"] = "triton"
    assert fast_paths._sm90_prefill(q, k, v[:, :, :299], cfg, False, 0.1) is None

    for _ in range(3):
        o, lse = plan(q, k, v)
        assert o.shape == (1, 2, 300, 128) and lse.numel() == 0
    by_address = [("launch", "addresses"), ("attend", "addresses")]
    assert events == ["general"] + by_address * 2
    plan.quantize.lost = True
    events.clear()
    plan(q, k, v)
    plan(q, k, v)
    assert events == ["general"] + by_address
