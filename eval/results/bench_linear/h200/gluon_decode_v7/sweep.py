"""Version-7 device probe (H200).

``python sweep.py ncu``: the version-6 Gluon kernel (a copy of the version-6 module: ``git show
6843a15:kernels/w4a8_gluon.py > kernels/_v6_gluon_tmp.py``) once at M = 16 on 4096→14336 and 14336→4096 (for
Nsight Compute). ``python sweep.py``: the chunked kernel's layer (``w4a8_linear_gluon``) at M = 16 as CUDA-graph
replays (L2 flushed, ``do_bench`` median) for each (groups per run, groups per chunk), bf16 ``F.linear`` in the
same run."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
from bench_attention import bench, graph_replays  # noqa: E402

from quantpatch.kernels import w4a8_triton as wt  # noqa: E402


def _operands(n, k):
    """Random packed weights (N, K/2) bytes, e4m3 scales in [2⁻⁹, 2⁻³), PTS exponent 3, fp32 bias; x (16, K)."""
    g = torch.Generator(device="cuda").manual_seed(n + k)
    qw = torch.randint(0, 256, (n, k // 2), device="cuda", dtype=torch.uint8, generator=g)
    sc = torch.exp2(torch.rand(n, k // 128, device="cuda", generator=g) * 6 - 9).to(torch.float8_e4m3fn)
    pe = torch.tensor(3, dtype=torch.int32, device="cuda")
    b = torch.randn(n, device="cuda", generator=g)
    return (qw, sc, pe, b), torch.randn(16, k, device="cuda", generator=g).to(torch.bfloat16)


SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096)]
CONFIGS = {4096: [(8, 8), (8, 2), (16, 2), (32, 2)], 14336: [(8, 8), (28, 2), (56, 2)]}

if sys.argv[1:] == ["ncu"]:
    from quantpatch.kernels import _v6_gluon_tmp as v6

    for k, n in SHAPES[1:]:
        (qw, sc, pe, b), x = _operands(n, k)
        v6.w4a8_linear_gluon(x, qw, sc, pe, b)
    torch.cuda.synchronize()
    sys.exit()

from quantpatch.kernels import w4a8_gluon as wg  # noqa: E402

for k, n in SHAPES:
    (qw, sc, pe, b), x = _operands(n, k)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    bf16 = bench(graph_replays(lambda i: torch.nn.functional.linear(x, w), 1), 1, 5, 15) * 1e3
    ref = wg.w4a8_linear_gluon(x, qw, sc, pe, b, gps=8, gpc=8)
    us = bench(graph_replays(lambda i: wg.w4a8_linear_gluon(x, qw, sc, pe, b), 1), 1, 5, 15) * 1e3
    row = [f"K={k} N={n} M=16 bf16 {bf16:.1f}", f"default: {us:.1f} ({bf16 / us:.2f}x)"]
    for gps, gpc in CONFIGS[k]:
        y = wg.w4a8_linear_gluon(x, qw, sc, pe, b, gps=gps, gpc=gpc)
        ok = (y.float() - ref.float()).abs().max().item() <= 1e-2 * ref.float().abs().max().item()
        us = bench(graph_replays(lambda i, g=gps, c=gpc: wg.w4a8_linear_gluon(x, qw, sc, pe, b, gps=g, gpc=c), 1),
                   1, 5, 15) * 1e3
        row.append(f"run {gps} chunk {gpc}: {us:.1f} ({bf16 / us:.2f}x){'' if ok else ' MISMATCH'}")
    print(" | ".join(row), flush=True)
    assert not wt._SCRATCH[(wt._stream_key(x.device), "gluon_counters")].any()
