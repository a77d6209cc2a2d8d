"""The one-warpgroup sm_90 Gluon attention kernel compiles for sm_90 on any machine.

Gluon has no interpreter, so the kernel's numerics are tested on the GPU only (``test_attn_sm90.py``). Triton's
compiler and ``ptxas`` need no GPU, though: this builds the kernel for sm_90 as its launcher does (head_dim 64 and
128, causal or not, sage2 and int8-flash operands, the launcher's register cap), in a process without
``TRITON_INTERPRET``, and checks the binary holds the tensor-core instructions of its numerics and fits the shared
memory that lets several programs share an SM.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

gluon = pytest.importorskip("triton.experimental.gluon", reason="this Triton has no Gluon")
owg = pytest.importorskip("quantpatch.kernels.attention.one_warpgroup_gluon", reason="the sm_90 kernel needs Gluon")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

gl = gluon.language
ROOT = Path(__file__).resolve().parents[2]
BLOCK_N = 128
SM90_SHARED_BYTES = 227 * 1024  # per SM, for thread blocks


def _compile(head_dim: int, causal: bool, int8_flash: bool):
    from triton.experimental.gluon._runtime import GluonASTSource

    kernel = owg._attn_sm90_kernel
    k_layout = gl.NVMMASharedLayout(swizzle_byte_width=min(128, head_dim), element_bitwidth=8, rank=2)
    v_layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    vec_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
    types = dict(Q_ptr="*i8", QS_ptr="*fp32", KS_ptr="*fp32", VS_ptr="*fp32", VM_ptr="*fp32", O_ptr="*bf16",
                 LSE_ptr="*fp32", stride_ob="i64", stride_oh="i64", stride_om="i64", qk_scale="fp32",
                 k_desc=f"tensordesc<i8[{BLOCK_N}, {head_dim}],{k_layout!r}>",
                 vt_desc=f"tensordesc<{'i8' if int8_flash else 'fp8e4nv'}[{head_dim}, {BLOCK_N}],{v_layout!r}>",
                 ks_desc=f"tensordesc<fp32[{BLOCK_N}],{vec_layout!r}>")
    constexprs = dict(HEAD_DIM=head_dim, BLOCK_N=BLOCK_N, STAGES=owg.DEFAULT_STAGES, CAUSAL=causal, SMOOTH_V=False,
                      RETURN_LSE=True, TOKEN_SCALES=int8_flash, PV_INT8=int8_flash)
    names = kernel.arg_names
    aligned = [n for n in names if n.endswith("_ptr")] + ["stride_ob", "stride_oh", "stride_om", "NK_PAD"]
    source = GluonASTSource(fn=kernel, signature={n: "constexpr" if n in constexprs else types.get(n, "i32")
                                                  for n in names},
                            constexprs={(names.index(k),): v for k, v in constexprs.items()},
                            attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=owg.compile_options(head_dim, int8_flash))


def build(head_dim: int, causal: bool, int8_flash: bool) -> dict:
    """The compiled kernel's wgmma shapes and shared memory (run where ``TRITON_INTERPRET`` is unset: in the
    interpreter Triton's own jit helpers are interpreted functions, which a Gluon compile cannot inline)."""
    compiled = _compile(head_dim, causal, int8_flash)
    shapes = {line.split()[0].rsplit(".aligned.", 1)[-1] for line in compiled.asm["ptx"].splitlines()
              if "wgmma.mma_async" in line}
    return {"wgmma": sorted(shapes), "shared": compiled.metadata.shared}


@pytest.mark.parametrize("head_dim, causal, int8_flash", [(128, False, False), (128, True, False), (64, False, False),
                                                          (64, True, True)])
def test_kernel_builds_for_sm90(head_dim, causal, int8_flash):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (f"import json; from tests.kernels.test_sm90_offline_compile import build; "
            f"print(json.dumps(build({head_dim}, {causal}, {int8_flash})))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode and "ptxas" in done.stderr:
        pytest.skip(f"no ptxas in this Triton: {done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    pv = f"m64n{head_dim}k32." + ("s32.s8.s8" if int8_flash else "f32.e4m3.e4m3")
    # Q̂·K̂ᵀ on INT8 tensor cores, P̂·V̂ on the mode's
    assert set(result["wgmma"]) == {f"m64n{BLOCK_N}k32.s32.s8.s8", pv}, result["wgmma"]
    assert SM90_SHARED_BYTES // result["shared"] >= (3 if head_dim == 128 else 4), result["shared"]
