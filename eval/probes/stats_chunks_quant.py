"""The quantization pass's GPU time (``quantize_qkv`` with sage2-8b's options as the Gluon route calls it, in a CUDA
graph) against the statistics chunk length, ``qk_quant_triton.STATS_TILES`` loads of ``STATS_TILE`` tokens a
program (needs a GPU; B=4, H=32, D=128, bf16): the lengths alternate over three rounds, each keeps its best median.

    python eval/probes/stats_chunks_quant.py [--tiles 8 16 32] [--seq-lens 1024 2048 4096 8192]
"""

import argparse

import torch
import triton.testing

import quantpatch as qp
from quantpatch.kernels import fast_paths, qk_quant_triton


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiles", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    args = ap.parse_args()
    options = fast_paths.quant_options(qp.get_mode("sage2-8b").attention) | dict(v_key_order=True)
    default = qk_quant_triton.STATS_TILES
    for n in args.seq_lens:
        gen = torch.Generator(device="cuda").manual_seed(n)
        q, k, v = (torch.randn(4, 32, n, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
        times = {t: [] for t in args.tiles}
        for rnd in range(3):
            for tiles in (args.tiles if rnd % 2 == 0 else args.tiles[::-1]):
                qk_quant_triton.STATS_TILES = tiles
                try:
                    times[tiles].append(float(triton.testing.do_bench_cudagraph(
                        lambda: qk_quant_triton.quantize_qkv(q, k, v, **options), rep=100, return_mode="median")))
                finally:
                    qk_quant_triton.STATS_TILES = default
        best = {t: min(ts) * 1e3 for t, ts in times.items()}
        print(f"N={n}: " + "  ".join(f"{qk_quant_triton.STATS_TILE * t}-token chunks {us:.1f} µs"
                                      for t, us in best.items()), flush=True)


if __name__ == "__main__":
    main()
