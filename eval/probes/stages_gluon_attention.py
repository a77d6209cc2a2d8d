"""Ring depths of the Gluon sage2 kernel on the benchmark's own operands (``eval/bench_attention.py``: ``randn`` seeded
by N + D, quantized with ``v_key_order`` as the end-to-end call does), and on a second seed; the depths alternate
over three rounds and each keeps its best median (needs an sm_90 GPU; B=4, H=32, D=128, non-causal):

    python eval/probes/stages_gluon_attention.py [--stages 3 4] [--seq-lens 4096 8192 16384]
"""

import argparse

import torch
import triton.testing

import quantpatch as qp
from quantpatch.kernels import fast_paths
from quantpatch.kernels.attn_gluon import attn_qk_int8_gluon
from quantpatch.kernels.qk_quant_triton import QuantizedQKV


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", type=int, nargs="+", default=[3, 4])
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192, 16384])
    args = ap.parse_args()
    cfg = qp.get_mode("sage2-8b").attention
    options = fast_paths.quant_options(cfg) | dict(v_key_order=True)
    for n in args.seq_lens:
        for seed in (n + 128, n):
            gen = torch.Generator(device="cuda").manual_seed(seed)
            q, k, v = (torch.randn(4, 32, n, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
                       for _ in range(3))
            x = QuantizedQKV(*fast_paths.quantize_qkv_op(q, k, v, **options))
            times = {st: [] for st in args.stages}
            for rnd in range(3):
                for st in (args.stages if rnd % 2 == 0 else args.stages[::-1]):
                    times[st].append(float(triton.testing.do_bench(
                        lambda st=st: attn_qk_int8_gluon(x, n, block_q=cfg.block_q, stages=st,
                                                         v_keys_permuted=x.v_hat_t),
                        warmup=25, rep=100, return_mode="median")))
            base = min(times[args.stages[0]])
            print(f"N={n} seed={seed}: " + "  ".join(f"{st} stages {min(t):.3f} ms (x{base / min(t):.3f} of "
                                                      f"{args.stages[0]})" for st, t in times.items()), flush=True)


if __name__ == "__main__":
    main()
