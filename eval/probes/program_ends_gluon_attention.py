"""When each program of a persistent Gluon sage2 kernel starts and ends (needs an sm_90 GPU): a variant module whose
``attn_qk_int8_gluon`` takes ``timer=`` (an int64 tensor of 2 × programs) into which consumer warpgroup 0 of every
program writes ``%globaltimer`` at its start and after its last tile, e.g. session 18's persistent variant with
the timer (``eval/results/bench_attention/session18_h200/variants/persistent_timer.diff`` on a copy of
``kernels/attn_gluon.py`` of 630a621, loaded by ``kernel_copy.load_kernel_copy``: relative imports resolve to
the current package). B=4, H=32, D=128, bf16, non-causal and causal:

    python eval/probes/program_ends_gluon_attention.py VARIANT.py [N ...]   # default 2048 8192

Prints the spread of the starts and the ends (µs from the first start) and the idle share: the programs' time
between their own end and the last one, over programs × the last end.
"""

import sys
from pathlib import Path

import torch
from kernel_copy import load_kernel_copy

import quantpatch as qp
from quantpatch.kernels import fast_paths
from quantpatch.kernels.qk_quant_triton import QuantizedQKV


def main() -> None:
    variant = load_kernel_copy(Path(sys.argv[1]), "attn_gluon_program_ends")
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    cfg = qp.get_mode("sage2-8b").attention
    for n in [int(a) for a in sys.argv[2:]] or [2048, 8192]:
        gen = torch.Generator(device="cuda").manual_seed(n)
        q, k, v = (torch.randn(4, 32, n, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
        x = QuantizedQKV(*fast_paths.quantize_qkv_op(q, k, v, **fast_paths.quant_options(cfg)))
        vt = variant.permute_v_keys(x.v_hat_t)
        for causal in (False, True):
            t = torch.zeros(2 * programs, dtype=torch.int64, device="cuda")
            for _ in range(3):  # the last call's times stay
                variant.attn_qk_int8_gluon(x, n, is_causal=causal, block_q=cfg.block_q, v_keys_permuted=vt, timer=t)
            torch.cuda.synchronize()
            t = t.view(programs, 2).double()
            start, end = (t[:, 0] - t[:, 0].min()) / 1e3, (t[:, 1] - t[:, 0].min()) / 1e3
            e = end.sort().values
            idle = float((e[-1] - end).sum() / (programs * e[-1]))
            print(f"N={n} causal={causal}: starts within {start.max():.1f} µs; ends min {e[0]:.1f} p10 "
                  f"{e[programs // 10]:.1f} median {e[programs // 2]:.1f} p90 {e[programs * 9 // 10]:.1f} max "
                  f"{e[-1]:.1f} µs; idle share {idle:.3f}", flush=True)


if __name__ == "__main__":
    main()
