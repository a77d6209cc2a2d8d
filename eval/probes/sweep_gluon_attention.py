"""Kernel-only timings of the Gluon attention (``kernels/attn_gluon.py``) next to the Triton kernel and SDPA
flash / cuDNN in the same run (B=4, H=32, D=128, bf16 inputs), with the Gluon output checked against the Triton
kernel's and, up to 8k keys, both against float64 on the first 8 heads of batch 0:
``python eval/probes/sweep_gluon_attention.py --out DIR [--seq-lens 2048 8192] [--stages 2 3] [--causal]
[--mode int8-flash]`` (default sage2-8b). Writes ``sweep.json`` under DIR and prints one line per row."""

import argparse
import json
import pathlib

import torch
import triton.testing

import quantpatch as qp
from quantpatch.kernels import fast_paths
from quantpatch.kernels.attention_ref import attention_exact
from quantpatch.kernels.attn_gluon import attn_qk_int8_gluon, permute_v_keys
from quantpatch.kernels.attn_qk_int8_pv_fp8_triton import attn_qk_int8_pv_fp8
from quantpatch.kernels.qk_quant_triton import QuantizedQKV
from quantpatch.metrics import rel_l1


def ms(fn, rep):
    return float(triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median"))


def flops(n: int, causal: bool) -> float:
    """4·B·H·N²·D of the probes' shape (B=4, H=32, D=128), halved for causal."""
    return 4 * 4 * 32 * n * n * 128 / (2 if causal else 1)


def operands(cfg, n: int):
    """``q, k, v`` (4, 32, n, 128) bf16 (seeded by n), their operands ``x`` for ``cfg`` and ``x``'s Vᵀ in the Gluon
    kernel's key order."""
    gen = torch.Generator(device="cuda").manual_seed(n)
    q, k, v = (torch.randn(4, 32, n, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    x = QuantizedQKV(*fast_paths.quantize_qkv_op(q, k, v, **fast_paths.quant_options(cfg)))
    return q, k, v, x, permute_v_keys(x.v_hat_t)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 8192, 16384])
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--rep", type=int, default=200)
    ap.add_argument("--causal", action="store_true", help="causal (bottom-right aligned); TFLOPS halved")
    ap.add_argument("--mode", default="sage2-8b", choices=["sage2-8b", "sage2-4b", "int8-flash"])
    args = ap.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cfg = qp.get_mode(args.mode).attention
    kb = fast_paths.kernel_blocks(cfg, 128)
    rows = []
    for n in args.seq_lens:
        q, k, v, x, vt = operands(cfg, n)
        work = flops(n, args.causal)
        times = {}
        for name, backend in (("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
            with sdpa_kernel(backend):
                sdpa = torch.nn.functional.scaled_dot_product_attention
                times[name] = ms(lambda: sdpa(q, k, v, is_causal=args.causal), args.rep)
        causal = dict(is_causal=args.causal, block_q=cfg.block_q)
        numerics = dict(l_from_quantized_p=cfg.l_from_quantized_p, two_level_accum=cfg.two_level_accum)
        gluon = dict(causal, qk_granularity=cfg.qk_granularity, v_keys_permuted=vt)
        ref, _ = attn_qk_int8_pv_fp8(x, n, **causal, **numerics, **kb)
        exact = attention_exact(q[:1, :8], k[:1, :8], v[:1, :8], is_causal=args.causal) if n <= 8192 else None
        errs = {"triton": rel_l1(ref[:1, :8].double(), exact) if exact is not None else ""}
        times["triton"] = ms(lambda: attn_qk_int8_pv_fp8(x, n, **causal, **numerics, **kb), args.rep)
        vs_triton = {}
        for st in args.stages:
            name = f"gluon-s{st}"
            out, _ = attn_qk_int8_gluon(x, n, **gluon, stages=st)
            vs_triton[name] = rel_l1(out.float(), ref.float())
            errs[name] = rel_l1(out[:1, :8].double(), exact) if exact is not None else ""
            times[name] = ms(lambda st=st: attn_qk_int8_gluon(x, n, **gluon, stages=st), args.rep)
        for name, t in times.items():
            row = dict(mode=args.mode, n=n, causal=args.causal, impl=name, ms=t, tflops=work / t * 1e-9,
                       vs_cudnn=times["sdpa-cudnn"] / t,
                       vs_triton=times["triton"] / t, rel_l1_vs_triton=vs_triton.get(name, ""),
                       rel_l1_vs_float64=errs.get(name, ""))
            rows.append(row)
            print(f"N={n:6d} {name:12s} {t:8.3f} ms {row['tflops']:7.1f} TFLOPS  x{row['vs_cudnn']:.3f} cuDNN  "
                  f"x{row['vs_triton']:.3f} triton  rel-L1 vs triton {row['rel_l1_vs_triton']}  "
                  f"vs float64 {row['rel_l1_vs_float64']}", flush=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
