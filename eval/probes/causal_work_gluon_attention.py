"""Causal calls against non-causal ones of the same block work, Gluon and Triton sage2 kernels, kernel only (needs an
sm_90 GPU; B=4, H=32, D=128, bf16): causal N × N beside non-causal N queries × N/2 keys (the same number of programs
and, within 1.6 %, of program-blocks) and non-causal N × N:

    python eval/probes/causal_work_gluon_attention.py [N ...]   # default 2048 4096 8192

Prints per call both kernels' times and the Gluon kernel's time a program-block (× the SMs, in ns).
"""

import sys

import torch
from sweep_gluon_attention import ms

import quantpatch as qp
from quantpatch.kernels import fast_paths
from quantpatch.kernels.attn_gluon import attn_qk_int8_gluon, permute_v_keys
from quantpatch.kernels.attn_qk_int8_pv_fp8_triton import attn_qk_int8_pv_fp8
from quantpatch.kernels.qk_quant_triton import QuantizedQKV


def program_blocks(nq: int, nk: int, causal: bool, heads: int = 128, block: int = 128) -> int:
    """Key blocks summed over the programs (128 query rows each), bottom-right aligned when causal."""
    per_head = sum(min((m * block + block + nk - nq + block - 1) // block, nk // block) if causal else nk // block
                   for m in range(nq // block))
    return heads * per_head


def main() -> None:
    cfg = qp.get_mode("sage2-8b").attention
    blocks = fast_paths.kernel_blocks(cfg, 128)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for n in [int(a) for a in sys.argv[1:]] or [2048, 4096, 8192]:
        for nq, nk, causal in ((n, n, True), (n, n // 2, False), (n, n, False)):
            gen = torch.Generator(device="cuda").manual_seed(nq + nk)
            q = torch.randn(4, 32, nq, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
            k, v = (torch.randn(4, 32, nk, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
            x = QuantizedQKV(*fast_paths.quantize_qkv_op(q, k, v, **fast_paths.quant_options(cfg)))
            vt = permute_v_keys(x.v_hat_t)
            gluon = ms(lambda: attn_qk_int8_gluon(x, nk, is_causal=causal, block_q=cfg.block_q, v_keys_permuted=vt),
                       100)
            triton = ms(lambda: attn_qk_int8_pv_fp8(x, nk, is_causal=causal, block_q=cfg.block_q, **blocks), 100)
            work = program_blocks(nq, nk, causal)
            print(f"Nq={nq} Nk={nk} causal={causal}: gluon {gluon:.3f} ms, triton {triton:.3f} ms; {work} "
                  f"program-blocks, gluon {gluon * 1e6 / work * sms:.0f} ns a program-block", flush=True)


if __name__ == "__main__":
    main()
