"""Per-program timeline of the W4A8 Gluon decode kernel (needs an sm_90 GPU): a copy of
``kernels/w4a8_gluon.py`` with ``%globaltimer`` stamps at its phase boundaries (``kernel_copy.edited_copy``),
launched without plans at M = 16 after an L2 flush; prints, per phase, percentiles over the programs of the time
since the first program started (µs).

    python eval/probes/trace_w4a8_gluon.py [--gemm] [K N ...]   # default: 4096 4096  14336 4096  4096 14336

``--gemm``: the GEMM alone on x̂ quantized before the flush (no token programs, no flag; x̂ then comes from DRAM).

Stamps: token programs (fused): start, after the flag count; GEMM programs: start, past the flag wait, before the
last chunk's dots (x̂ of a one-chunk run just requested), after them, after the split-K ticket, at the end."""

import os
import sys

import torch
from kernel_copy import edited_copy

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "eval"))

STAMP = '''@gluon.jit
def _stamp(T_ptr, slot):
    l: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    i = gl.arange(0, 128, layout=l)
    t = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [i], dtype=gl.int64, is_pure=False, pack=1)
    gl.store(T_ptr + slot + i * 0, t, mask=i == 0)


'''
EDITS = [  # (anchor, replacement): every anchor must be found once
    ("@gluon.jit\ndef _fragment_slot(c):", STAMP + "@gluon.jit\ndef _fragment_slot(c):"),
    ("stride_xm, QBLOCK: gl.constexpr):", "stride_xm, QBLOCK: gl.constexpr, T_ptr):"),
    ("    offs = gl.arange(0, QBLOCK, layout=q_l)\n",
     "    _stamp(T_ptr, gl.program_id(0) * 8)\n    offs = gl.arange(0, QBLOCK, layout=q_l)\n"),
    ('    gl.atomic_add(C_ptr, 1, sem="release", scope="gpu")\n',
     '    gl.atomic_add(C_ptr, 1, sem="release", scope="gpu")\n    _stamp(T_ptr, gl.program_id(0) * 8 + 1)\n'),
    ("    c, W_ptr, XQ_ptr, AS_ptr, WS_ptr, B_ptr, PTS_ptr, P_ptr, C_ptr, Y_ptr,",
     "    c, W_ptr, XQ_ptr, AS_ptr, WS_ptr, B_ptr, PTS_ptr, P_ptr, C_ptr, Y_ptr, T_ptr,"),
    ("    tiles = gl.cdiv(N, BLOCK_N)\n",
     "    TS = gl.program_id(0) * 8\n    _stamp(T_ptr, TS)\n    tiles = gl.cdiv(N, BLOCK_N)\n"),
    ('            pass\n', '            pass\n    _stamp(T_ptr, TS + 1)\n'),
    ("        acc = _chunk_mma(acc, wb, sig, x_s, i % 2, acc_l, op_l, GPC)\n",  # the last chunk's stamps stay
     "        _stamp(T_ptr, TS + 2)\n        acc = _chunk_mma(acc, wb, sig, x_s, i % 2, acc_l, op_l, GPC)\n"
     "        _stamp(T_ptr, TS + 3)\n"),
    ('        ticket = gl.atomic_add(C_ptr + 2 + tile, 1, sem="acq_rel", scope="gpu")\n',
     '        ticket = gl.atomic_add(C_ptr + 2 + tile, 1, sem="acq_rel", scope="gpu")\n'
     '        _stamp(T_ptr, TS + 4)\n'),
    ("            gl.atomic_xchg(C_ptr + 2 + tile, 0)\n",
     "            gl.atomic_xchg(C_ptr + 2 + tile, 0)\n    _stamp(T_ptr, TS + 5)\n"),
    ("P_ptr, C_ptr, Y_ptr,\n    M, N, K,", "P_ptr, C_ptr, Y_ptr, T_ptr,\n    M, N, K,"),
    ("stride_xm, QBLOCK)", "stride_xm, QBLOCK, T_ptr)"),
    ("_gemm_program(pid - M, W_ptr, XQ_ptr, AS_ptr, WS_ptr, B_ptr, PTS_ptr, P_ptr, C_ptr, Y_ptr,",
     "_gemm_program(pid - M, W_ptr, XQ_ptr, AS_ptr, WS_ptr, B_ptr, PTS_ptr, P_ptr, C_ptr, Y_ptr, T_ptr,"),
    ("        _gemm_program(pid, W_ptr, XQ_ptr, AS_ptr, WS_ptr, B_ptr, PTS_ptr, P_ptr, C_ptr, Y_ptr,",
     "        _gemm_program(pid, W_ptr, XQ_ptr, AS_ptr, WS_ptr, B_ptr, PTS_ptr, P_ptr, C_ptr, Y_ptr, T_ptr,"),
    ("    plan = _PLANS.get(key)\n", "    plan = None  # (traced: every call compiles-or-looks-up through run)\n"),
    ("pts_exp, work, counters, y,\n        *ints, num_warps=4)",
     "pts_exp, work, counters, y, TRACE,\n        *ints, num_warps=4)"),
    ("_PLANS: dict[tuple, tuple] = {}\n", "_PLANS: dict[tuple, tuple] = {}\nTRACE = None\n"),
]
GEMM_STAMPS = ("start", "past flag", "last chunk", "dots done", "ticket", "end")


def percentiles(v: list[float]) -> str:
    v = sorted(v)
    return "/".join(f"{v[min(len(v) - 1, int(q * len(v)))]:.2f}" for q in (0, 0.1, 0.5, 0.9, 1.0))


def main() -> None:
    from bench_linear import Layer

    tm = edited_copy("w4a8_gluon", EDITS)
    from quantpatch.kernels.w4a8_triton import quantize_activation_fp8

    gemm_alone = sys.argv[1:2] == ["--gemm"]
    args = [int(a) for a in sys.argv[1 + gemm_alone:]] or [4096, 4096, 14336, 4096, 4096, 14336]
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    for k, n in zip(args[::2], args[1::2]):
        layer = Layer(k, n, torch.device("cuda"), 0)
        qw, sc, pe, bias = layer.w4a8_args()
        x = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
        x_hat = quantize_activation_fp8(x, fragment_order=True)

        def call():
            if gemm_alone:
                return tm.w4a8_gemm_gluon(*x_hat, qw, sc, pe, bias)
            return tm.w4a8_linear_gluon(x, qw, sc, pe, bias)

        tm.TRACE = torch.zeros(8 * 4096, dtype=torch.int64, device="cuda")
        for _ in range(3):
            call()
        flush.zero_()
        tm.TRACE.zero_()
        torch.cuda.synchronize()
        call()
        torch.cuda.synchronize()
        rows = [r for r in tm.TRACE.view(-1, 8).cpu().tolist() if r[0] > 0]
        t0 = min(r[0] for r in rows)
        gemm = [r for r in rows if r[3] > 0]
        tokens = [r for r in rows if r[3] == 0 and r[2] == 0]
        what = " (GEMM alone)" * gemm_alone
        print(f"{k}->{n}, M=16{what}: {len(tokens)} token + {len(gemm)} GEMM programs; µs since the first start, "
              "p0/p10/p50/p90/p100")
        for i, name in enumerate(("token start", "token counted")):
            if tokens:
                print(f"  {name:14s} {percentiles([(r[i] - t0) / 1e3 for r in tokens])}")
        for i, name in enumerate(GEMM_STAMPS):
            v = [(r[i] - t0) / 1e3 for r in gemm if r[i] > 0]
            if v:
                print(f"  {name:14s} {percentiles(v)}")


if __name__ == "__main__":
    main()
