"""Whether two builds of the Gluon kernel give the same bits (needs an sm_90 GPU): outputs and LSE over five
shapes (odd lengths, GQA, causal, B=2, H=32, D=128, bf16, sage2-8b operands, or int8-flash's with ``--mode
int8-flash``). A build is ``PATH.py`` (a copy of
``kernels/attn_gluon.py``, loaded as ``ab_gluon_attention.load`` does) or a module name, with ``:STAGES`` to set
the ring depth:

    python eval/probes/bits_gluon_attention.py COPY.py quantpatch.kernels.attn_gluon      # a change of the kernel
    python eval/probes/bits_gluon_attention.py quantpatch.kernels.attn_gluon:3 quantpatch.kernels.attn_gluon:4
    python eval/probes/bits_gluon_attention.py COPY.py quantpatch.kernels.attn_gluon --mode int8-flash
"""

import sys

import torch
from ab_gluon_attention import load

import quantpatch as qp
from quantpatch.kernels import fast_paths
from quantpatch.kernels.qk_quant_triton import QuantizedQKV

SHAPES = ((1000, 1000, 32, False), (239, 4096, 8, False), (4096, 4096, 32, True), (184, 3000, 8, True),
          (8192, 8192, 32, False))  # (Nq, Nk, kv heads, causal)


def build(spec: str, index: int):
    """``(attn_qk_int8_gluon, permute_v_keys, extra keyword arguments)`` of a build spec."""
    path, _, stages = spec.partition(":")
    module = load(f"bits_build_{index}", path)
    return module.attn_qk_int8_gluon, module.permute_v_keys, dict(stages=int(stages)) if stages else {}


def main() -> None:
    specs = [a for a in sys.argv[1:] if not a.startswith("--")]
    mode = specs.pop() if "--mode" in sys.argv else "sage2-8b"
    builds = [build(spec, i) for i, spec in enumerate(specs[:2])]
    cfg = qp.get_mode(mode).attention
    for nq, nk, hkv, causal in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(nq + nk)
        q = torch.randn(2, 32, nq, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn(2, hkv, nk, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
        x = QuantizedQKV(*fast_paths.quantize_qkv_op(q, k, v, **fast_paths.quant_options(cfg)))
        (o1, l1), (o2, l2) = (fn(x, nk, is_causal=causal, return_lse=True, block_q=cfg.block_q,
                                 qk_granularity=cfg.qk_granularity, v_keys_permuted=perm(x.v_hat_t), **kw)
                              for fn, perm, kw in builds)
        print(f"Nq={nq} Nk={nk} Hkv={hkv} causal={causal}: out equal {torch.equal(o1, o2)}, "
              f"lse equal {torch.equal(l1, l2)}", flush=True)


if __name__ == "__main__":
    main()
