"""The Gluon kernels compile for sm_90 on any machine.

Gluon has no interpreter, so these kernels' numerics are tested on the GPU only (``test_attn_sm90.py``,
``test_turbo_decode_gluon.py``). Triton's compiler and ``ptxas`` need no GPU, though: this builds them for sm_90 as
their launchers do, in a process without ``TRITON_INTERPRET``, and checks each binary holds the tensor-core
instructions of its numerics, that ptxas kept its wgmma asynchronous (no serialization advisory) and that it fits the
shared memory that lets its programs share an SM:

* the one-warpgroup attention kernel: head_dim 64 and 128, causal or not, sage2, int8-flash and fireq operands, as
  its launcher builds them (constexprs, register cap);
* the ping-pong attention kernel: sage2 with smooth Q's ΔS (two warpgroups taking turns, causal or not) and
  int8-flash (three in series), at its launcher's ring depths;
* the TurboAttention decode kernel: one split (the reference's roundings) and several (the merge);
* the W4A8 GEMMs: the warp-specialised prefill kernel (its tiles and ring depths, bias or not) and the decode kernel
  (fused quantization or not, split-K or not), each on FP8 wgmma with the weights as the register operand.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

gluon = pytest.importorskip("triton.experimental.gluon", reason="this Triton has no Gluon")
owg = pytest.importorskip("quantpatch.kernels.attention.one_warpgroup_gluon", reason="the sm_90 kernel needs Gluon")
ppg = pytest.importorskip("quantpatch.kernels.attention.pingpong_gluon", reason="the sm_90 kernel needs Gluon")
tdg = pytest.importorskip("quantpatch.kernels.turbo_kv.turbo_decode_gluon", reason="the decode kernel needs Gluon")
w4p = pytest.importorskip("quantpatch.kernels.w4a8.w4a8_prefill_gluon", reason="the W4A8 GEMMs need Gluon")
w4d = pytest.importorskip("quantpatch.kernels.w4a8.w4a8_gluon", reason="the W4A8 GEMMs need Gluon")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from quantpatch.modes import get_mode  # noqa: E402

gl = gluon.language
ROOT = Path(__file__).resolve().parents[2]
BLOCK_N = 128
SM90_SHARED_BYTES = 227 * 1024  # per SM, for thread blocks


def _sm90(kernel, types: dict, constexprs: dict, aligned: list, options: dict):
    """``kernel`` compiled for sm_90: arguments typed by ``types`` (else ``i32``) or fixed by ``constexprs``, the
    ``aligned`` ones divisible by 16 (as Triton specializes them at a launch)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    names = kernel.arg_names
    source = GluonASTSource(fn=kernel, signature={n: "constexpr" if n in constexprs else types.get(n, "i32")
                                                  for n in names},
                            constexprs={(names.index(k),): v for k, v in constexprs.items()},
                            attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


MODE_OF = {"sage2": "sage2-8b", "int8_flash": "int8-flash", "fireq": "fireq"}  # a mode of each numerics family


def _attention(head_dim: int, causal: bool, numerics: str):
    """The one-warpgroup kernel as its launcher (``Sm90Launch``) builds it for ``numerics`` (``sage2``,
    ``int8_flash``, ``fireq``): its constexprs, options and descriptor layouts, from CPU operands of those formats."""
    import torch

    from quantpatch.kernels.attention.qk_quant_triton import QuantizedQKV

    cfg = get_mode(MODE_OF[numerics]).attention
    fp8, empty = torch.float8_e4m3fn, torch.empty(0)
    qk_dtype = fp8 if numerics == "fireq" else torch.int8
    v_dtype = torch.int8 if numerics == "int8_flash" else fp8
    v_scale = torch.ones(1 if cfg.v_granularity == "tensor" else (1, 1, head_dim))
    x = QuantizedQKV(torch.zeros(1, 1, 64, head_dim).to(qk_dtype), torch.ones(1, 1, 64), empty,
                     torch.zeros(1, 1, BLOCK_N, head_dim).to(qk_dtype), torch.ones(1, 1, BLOCK_N), empty, empty,
                     torch.zeros(1, 1, head_dim, BLOCK_N).to(v_dtype), v_scale, empty)
    launch = owg.Sm90Launch(x, BLOCK_N, qk_granularity=cfg.qk_granularity, is_causal=causal, return_lse=True,
                            two_level_accum=cfg.two_level_accum)
    kernel = owg._attn_sm90_kernel
    k_layout, v_layout, vec_layout = owg.shared_layouts(head_dim, BLOCK_N)
    qk, v = ("fp8e4nv" if t is fp8 else "i8" for t in (qk_dtype, v_dtype))
    types = dict(Q_ptr=f"*{qk}", QS_ptr="*fp32", KS_ptr="*fp32", VS_ptr="*fp32", VM_ptr="*fp32", O_ptr="*bf16",
                 LSE_ptr="*fp32", stride_ob="i64", stride_oh="i64", stride_om="i64", qk_scale="fp32",
                 k_desc=f"tensordesc<{qk}[{BLOCK_N}, {head_dim}],{k_layout!r}>",
                 vt_desc=f"tensordesc<{v}[{head_dim}, {BLOCK_N}],{v_layout!r}>",
                 ks_desc=f"tensordesc<fp32[{BLOCK_N}],{vec_layout!r}>")
    aligned = [n for n in kernel.arg_names if n.endswith("_ptr")] + ["stride_ob", "stride_oh", "stride_om", "NK_PAD"]
    return _sm90(kernel, types, launch.constexprs, aligned, launch.options)


def _pingpong(causal: bool, warpgroups: int, int8_flash: bool):
    """The ping-pong kernel as its launcher's defaults build it: sage2 with smooth Q, or int8-flash; two warpgroups
    and 3 stages, or three in series and 4."""
    kernel = ppg._attn_qk_int8_fwd_gluon
    k_layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)  # also Vᵀ's (D = 128)
    vec = f"tensordesc<fp32[{BLOCK_N}],{gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)!r}>"
    types = dict(Q_ptr="*i8", QS_ptr="*fp32", KS_ptr="*fp32", QM_ptr="*fp32", KM_ptr="*fp32", VS_ptr="*fp32",
                 VM_ptr="*fp32", O_ptr="*bf16", LSE_ptr="*fp32", stride_ob="i64", stride_oh="i64", stride_om="i64",
                 qk_scale="fp32", k_desc=f"tensordesc<i8[{BLOCK_N}, 128],{k_layout!r}>",
                 vt_desc=f"tensordesc<{'i8' if int8_flash else 'fp8e4nv'}[128, {BLOCK_N}],{k_layout!r}>", ks_desc=vec,
                 ds_desc=vec)
    constexprs = dict(HEAD_DIM=128, BLOCK_N=BLOCK_N, Q_BLOCK=128, SMOOTH_Q=not int8_flash, SMOOTH_K=True,
                      SMOOTH_V=False, RETURN_LSE=True, STAGES=4 if warpgroups == ppg.SERIAL.value else 3,
                      TOKEN_SCALES=int8_flash, PV_INT8=int8_flash, CAUSAL=causal, WARPGROUPS=warpgroups)
    aligned = [n for n in kernel.arg_names if n.endswith("_ptr")] + ["stride_ob", "stride_oh", "stride_om", "NK_PAD"]
    return _sm90(kernel, types, constexprs, aligned, dict(num_warps=4))


def _turbo_decode(splits: int):
    kernel = tdg._turbo_decode_gluon
    types = dict(Q_ptr="*bf16", KC_ptr="*u8", KS_ptr="*i8", KZ_ptr="*i8", KBS_ptr="*fp32", VC_ptr="*u8", VS_ptr="*i8",
                 VZ_ptr="*i8", VBS_ptr="*fp32", KB_ptr="*i8", KBSC_ptr="*fp32", VB_ptr="*i8", VBSC_ptr="*fp32",
                 META_ptr="*i32", O_ptr="*bf16", MP_ptr="*fp32", LP_ptr="*fp32", ACC_ptr="*fp32", CNT_ptr="*i32",
                 sm_scale="fp32")
    cfg = get_mode("turbo").attention
    constexprs = tdg.launch_constexprs(4, cfg.qk_qmax, cfg.pv_qmax, splits, True)  # Llama-8B: 4 query heads a KV head
    aligned = [n for n in kernel.arg_names if n.endswith("_ptr") or n.startswith("stride") or n in ("K_STEP", "V_STEP")]
    return _sm90(kernel, types, constexprs, aligned, dict(num_warps=1, enable_fp_fusion=splits > 1))


def _w4a8_prefill(block_t: int, stages: int, bias: bool):
    kernel = w4p._w4a8_prefill_gluon
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    types = dict(x_desc=f"tensordesc<fp8e4nv[{block_t}, 128],{layout!r}>", W_ptr="*i32", AS_ptr="*bf16",
                 WS_ptr="*fp8e4nv", B_ptr="*bf16", PTS_ptr="*i32", Y_ptr="*bf16")
    constexprs = dict(BT=block_t, STAGES=stages, HAS_BIAS=bias)
    aligned = [n for n in kernel.arg_names if n.endswith("_ptr")] + ["K", "stride_wn", "stride_ym"]
    return _sm90(kernel, types, constexprs, aligned, dict(num_warps=4))


def _w4a8_decode(tokens: int, fused: bool, split_k: int):
    kernel = w4d._w4a8_decode_gluon
    types = dict(X_ptr="*bf16", XQ_ptr="*fp8e4nv", W_ptr="*i32", AS_ptr="*bf16", WS_ptr="*fp8e4nv", B_ptr="*bf16",
                 PTS_ptr="*i32", P_ptr="*fp32", C_ptr="*i32", Y_ptr="*bf16")
    constexprs = dict(BM=tokens, GPC=2, CHUNKS=2, SPLIT_K=split_k, FUSED=fused, QBLOCK=4096, HAS_BIAS=True)
    # a Llama-sized layer's K and row strides are multiples of 16, as the launch specializes them
    aligned = [n for n in kernel.arg_names if n.endswith("_ptr")] + ["K", "stride_xm", "stride_wn", "stride_ym"]
    return _sm90(kernel, types, constexprs, aligned, dict(num_warps=4))


def _mma_shapes(compiled) -> list[str]:
    return sorted({line.split()[0].rsplit(".aligned.", 1)[-1] for line in compiled.asm["ptx"].splitlines()
                   if "mma" in line and ".aligned." in line and not line.lstrip().startswith("//")})


def _wgmma_serialized(ptx: str) -> list[str]:
    """ptxas's advisories that it serialized the kernel's wgmma (C7510–C7515: each wgmma then waits for the one
    before, with no overlap), from assembling ``ptx`` again with ``-v`` as Triton does (Triton keeps no log)."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        done = subprocess.run([get_ptxas(90).path, "-v", "--regAllocOptLevel=2", "--gpu-name=sm_90a", str(src), "-o",
                               str(Path(tmp) / "kernel.cubin")], capture_output=True, text=True, check=True)
    return [line for line in done.stderr.splitlines() if "wgmma" in line and "serialized" in line]


def build(kernel: str, *args) -> dict:
    """The compiled kernel's tensor-core instruction shapes, shared memory and ptxas's wgmma serialization advisories
    (run where ``TRITON_INTERPRET`` is unset: in the interpreter Triton's own jit helpers are interpreted functions,
    which a Gluon compile cannot inline)."""
    compiled = {"attention": _attention, "pingpong": _pingpong, "turbo_decode": _turbo_decode,
                "w4a8_prefill": _w4a8_prefill, "w4a8_decode": _w4a8_decode}[kernel](*args)
    return {"mma": _mma_shapes(compiled), "shared": compiled.metadata.shared,
            "serialized": _wgmma_serialized(compiled.asm["ptx"])}


def _built(kernel: str, *args) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (f"import json; from tests.kernels.test_gluon_offline_compile import build; "
            f"print(json.dumps(build({kernel!r}, {', '.join(map(repr, args))})))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode and "ptxas" in done.stderr:
        pytest.skip(f"no ptxas in this Triton: {done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("head_dim, causal, numerics", [
    (128, False, "sage2"), (128, True, "sage2"), (64, False, "sage2"), (64, True, "int8_flash"), (128, False, "fireq"),
    (64, True, "fireq")])
def test_attention_kernel_builds_for_sm90(head_dim, causal, numerics):
    result = _built("attention", head_dim, causal, numerics)
    pv = f"m64n{head_dim}k32." + ("s32.s8.s8" if numerics == "int8_flash" else "f32.e4m3.e4m3")
    qk = f"m64n{BLOCK_N}k32." + ("f32.e4m3.e4m3" if numerics == "fireq" else "s32.s8.s8")
    # Q̂·K̂ᵀ on INT8 tensor cores (fireq: FP8), P̂·V̂ on the mode's (wgmma)
    assert set(result["mma"]) == {qk, pv}, result["mma"]
    assert not result["serialized"], result["serialized"]
    assert SM90_SHARED_BYTES // result["shared"] >= (3 if head_dim == 128 else 4), result["shared"]


@pytest.mark.parametrize("causal, warpgroups, int8_flash", [(False, 2, False), (True, 2, False),
                                                             (False, ppg.SERIAL.value, True)])
def test_pingpong_attention_kernel_builds_for_sm90(causal, warpgroups, int8_flash):
    result = _built("pingpong", causal, warpgroups, int8_flash)
    pv = "m64n128k32." + ("s32.s8.s8" if int8_flash else "f32.e4m3.e4m3")
    assert set(result["mma"]) == {f"m64n{BLOCK_N}k32.s32.s8.s8", pv}, result["mma"]
    assert not result["serialized"], result["serialized"]
    assert result["shared"] <= SM90_SHARED_BYTES, result["shared"]


@pytest.mark.parametrize("splits", [1, 8])
def test_turbo_decode_kernel_builds_for_sm90(splits):
    result = _built("turbo_decode", splits)
    assert result["mma"] and all(shape.startswith("m16n8k16.") for shape in result["mma"]), result["mma"]  # mma.sync
    assert SM90_SHARED_BYTES // result["shared"] >= tdg.PROGRAMS_PER_SM, result["shared"]


@pytest.mark.parametrize("block_t, stages, bias", [(128, 4, False), (64, 2, True), (256, 2, False)])
def test_w4a8_prefill_kernel_builds_for_sm90(block_t, stages, bias):
    result = _built("w4a8_prefill", block_t, stages, bias)
    assert result["mma"] == [f"m64n{block_t}k32.f32.e4m3.e4m3"], result["mma"]  # INT4 → e4m3 operand, FP8 wgmma
    assert not result["serialized"], result["serialized"]
    assert result["shared"] <= SM90_SHARED_BYTES, result["shared"]


@pytest.mark.parametrize("tokens, fused, split_k", [(8, True, 1), (16, False, 4)])
def test_w4a8_decode_kernel_builds_for_sm90(tokens, fused, split_k):
    result = _built("w4a8_decode", tokens, fused, split_k)
    assert result["mma"] == [f"m64n{tokens}k32.f32.e4m3.e4m3"], result["mma"]
    assert not result["serialized"], result["serialized"]
    assert result["shared"] <= SM90_SHARED_BYTES, result["shared"]
