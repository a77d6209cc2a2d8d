"""GPU time of the ΔS launch (``qk_quant_triton._delta_s_kernel``, smooth Q's q̄ · Kᵀ) and of the whole quantization
pass, non-causal and causal (causal calls skip the key tiles past each query block's diagonal), against tile
variants of the same GEMM: the committed kernel (a program per 128 keys of a kv head, looping over query blocks)
with other warps / query tiles, a row-strip kernel (a program per query tile of a head, q̄ split once, looping
over keys), and the committed tiles with ΔS stored (and q̄ loaded) by TMA. Each variant's ΔS must equal the
committed kernel's bit for bit where written. Needs a GPU; B=4, H=32, D=128, bf16, ``triton.testing.do_bench``
medians (L2 flushed), best of three alternating rounds.

    python eval/probes/delta_s_launch.py [--seq-lens 8192 16384 32768] [--variants NAME ...]
"""

import argparse

import torch
import triton
import triton.language as tl
import triton.testing

import quantpatch as qp
from quantpatch.kernels import fast_paths, qk_quant_triton
from quantpatch.kernels.qk_quant_triton import _dot_bf16, _split_bf16, delta_s_written

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # a Triton without host tensor descriptors: the TMA variants are skipped
    TensorDescriptor = None


@triton.jit
def _delta_s_rows_kernel(K_ptr, QM_ptr, DS_ptr, stride_kb, stride_kh, stride_kn, NK, NK_PAD, H, GROUP, NQB, DIAG,
                         HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, QB_TILE: tl.constexpr, Q_BLOCK: tl.constexpr,
                         CAUSAL: tl.constexpr, STAGES: tl.constexpr):
    """Row strip: QB_TILE query blocks of query head ``pid_bh`` against every key tile (bf16 K only)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // H
    hk = (pid_bh % H) // GROUP
    qb = pid_m * QB_TILE + tl.arange(0, QB_TILE)
    offs_d = tl.arange(0, HEAD_DIM)
    qm = tl.load(QM_ptr + (pid_bh * NQB + qb[:, None]) * HEAD_DIM + offs_d[None, :], mask=qb[:, None] < NQB, other=0.0)
    q_hi, q_mid, q_lo = _split_bf16(qm)
    hi = NK_PAD
    key_end = (qb + 1) * Q_BLOCK + DIAG
    if CAUSAL:
        hi = tl.minimum(tl.maximum(tl.max(tl.where(qb < NQB, key_end, 0), 0), 0), NK_PAD)
    k_base = K_ptr + b * stride_kb + hk * stride_kh
    ds_base = DS_ptr + (pid_bh * NQB + qb[:, None]) * NK_PAD
    for key0 in tl.range(0, hi, BLOCK_N, num_stages=STAGES):
        rows = key0 + tl.arange(0, BLOCK_N)
        k = tl.load(k_base + rows[:, None] * stride_kn + offs_d[None, :], mask=rows[:, None] < NK, other=0.0)
        ds = _dot_bf16(q_hi, k, tl.zeros([QB_TILE, BLOCK_N], dtype=tl.float32), False)
        ds = _dot_bf16(q_mid, k, ds, False)
        ds = _dot_bf16(q_lo, k, ds, False)
        ds = tl.where(rows[None, :] < NK, ds, float("-inf"))
        mask = qb[:, None] < NQB
        if CAUSAL:
            mask &= key0 < key_end[:, None]
        tl.store(ds_base + rows[None, :], ds, mask=mask)


@triton.jit
def _delta_s_tma_kernel(K_ptr, qm_desc, ds_desc, stride_kb, stride_kh, stride_kn, NK, HKV, GROUP, NQB, DIAG,
                        HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, QB_TILE: tl.constexpr, Q_BLOCK: tl.constexpr,
                        CAUSAL: tl.constexpr, TMA_Q: tl.constexpr):
    """The committed kernel's tiles with ΔS stored by TMA (``ds_desc`` over (B·H, NQB, Nk_pad), boxes of
    (1, QB_TILE, BLOCK_N), clipped at each head's NQB) and, with TMA_Q, q̄ loaded by TMA (bf16 K only)."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HKV
    hk = pid_bh % HKV
    key0 = pid_n * BLOCK_N
    rows = key0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    qb_first = 0
    if CAUSAL:
        qb_first = tl.maximum(key0 - DIAG, 0) // Q_BLOCK
    k = tl.load(K_ptr + b.to(tl.int64) * stride_kb + hk * stride_kh + rows[:, None] * stride_kn + offs_d[None, :],
                mask=rows[:, None] < NK, other=0.0)
    offs_qb = tl.arange(0, QB_TILE)
    for g in range(GROUP):
        bh_q = b * HKV * GROUP + hk * GROUP + g
        for qb0 in range(qb_first // QB_TILE * QB_TILE, NQB, QB_TILE):
            if TMA_Q:
                qm = tl.reshape(qm_desc.load([bh_q, qb0, 0]), [QB_TILE, HEAD_DIM])
            else:
                qb = qb0 + offs_qb
                qm = tl.load(qm_desc + (bh_q.to(tl.int64) * NQB + qb[:, None]) * HEAD_DIM + offs_d[None, :],
                             mask=qb[:, None] < NQB, other=0.0)
            q_hi, q_mid, q_lo = _split_bf16(qm)
            ds = _dot_bf16(q_hi, k, tl.zeros([QB_TILE, BLOCK_N], dtype=tl.float32), False)
            ds = _dot_bf16(q_mid, k, ds, False)
            ds = _dot_bf16(q_lo, k, ds, False)
            ds = tl.where(rows[None, :] < NK, ds, float("-inf"))
            ds_desc.store([bh_q, qb0, key0], tl.reshape(ds, [1, QB_TILE, BLOCK_N]))


def _tma(k, q_mean, ds, nq, causal, qb_tile, warps, stages, tma_q):
    b, hkv, nk, d = k.shape
    h, nqb, nk_pad = q_mean.shape[1], q_mean.shape[2], ds.shape[-1]
    ds_desc = TensorDescriptor(ds, [b * h, nqb, nk_pad], [nqb * nk_pad, nk_pad, 1], [1, qb_tile, 128])
    qm = TensorDescriptor(q_mean, [b * h, nqb, d], [nqb * d, d, 1], [1, qb_tile, d]) if tma_q else q_mean
    _delta_s_tma_kernel[(nk_pad // 128, b * hkv)](
        k, qm, ds_desc, k.stride(0), k.stride(1), k.stride(2), nk, hkv, h // hkv, nqb, nk - nq,
        HEAD_DIM=d, BLOCK_N=128, QB_TILE=qb_tile, Q_BLOCK=128, CAUSAL=causal, TMA_Q=tma_q, num_warps=warps,
        num_stages=stages)


def _tma_store(*args):
    _tma(*args, tma_q=False)


def _tma_both(*args):
    _tma(*args, tma_q=True)


def _committed(k, q_mean, ds, nq, causal, qb_tile, warps, stages):
    b, hkv, nk, d = k.shape
    h, nqb, nk_pad = q_mean.shape[1], q_mean.shape[2], ds.shape[-1]
    qk_quant_triton._delta_s_kernel[(nk_pad // 128, b * hkv)](
        k, q_mean, ds, k.stride(0), k.stride(1), k.stride(2), nk, nk_pad, hkv, h // hkv, nqb, nk - nq,
        HEAD_DIM=d, BLOCK_N=128, QB_TILE=qb_tile, Q_BLOCK=128, K_BF16=True, CAUSAL=causal, EMULATE=False,
        num_warps=warps, num_stages=stages)


def _rows(k, q_mean, ds, nq, causal, qb_tile, warps, stages):
    b, hkv, nk, d = k.shape
    h, nqb, nk_pad = q_mean.shape[1], q_mean.shape[2], ds.shape[-1]
    _delta_s_rows_kernel[(triton.cdiv(nqb, qb_tile), b * h)](
        k, q_mean, ds, k.stride(0), k.stride(1), k.stride(2), nk, nk_pad, h, h // hkv, nqb, nk - nq,
        HEAD_DIM=d, BLOCK_N=128, QB_TILE=qb_tile, Q_BLOCK=128, CAUSAL=causal, STAGES=stages, num_warps=warps)


VARIANTS = {
    "committed q64 w4 s2": (_committed, 64, 4, 2),
    "committed q32 w4 s2": (_committed, 32, 4, 2),
    "committed q16 w4 s2": (_committed, 16, 4, 2),
    "committed q64 w8 s2": (_committed, 64, 8, 2),
    "rows q64 w4 s2": (_rows, 64, 4, 2),
    "rows q128 w8 s1": (_rows, 128, 8, 1),
}
if TensorDescriptor is not None:
    VARIANTS |= {
        "tma store q64 w4 s2": (_tma_store, 64, 4, 2),
        "tma store q64 w4 s3": (_tma_store, 64, 4, 3),
        "tma q+store q64 w4 s2": (_tma_both, 64, 4, 2),
        "tma q+store q64 w4 s3": (_tma_both, 64, 4, 3),
        "tma q+store q128 w8 s2": (_tma_both, 128, 8, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), help="names of VARIANTS to time")
    args = ap.parse_args()
    options = fast_paths.quant_options(qp.get_mode("sage2-8b").attention) | dict(v_key_order=True)
    for n in args.seq_lens:
        gen = torch.Generator(device="cuda").manual_seed(n)
        q, k, v = (torch.randn(4, 32, n, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
        x = qk_quant_triton.quantize_qkv(q, k, v, **options)
        for causal in (False, True):
            written = delta_s_written(n, n, block_q=128, pad_to=128, is_causal=causal, device="cuda")
            want = x.delta_s[..., written]
            nbytes = written.sum().item() * 4 * 4 * 32 + k.numel() * 2
            times = {name: [] for name in args.variants}
            times["quantize_qkv"] = []
            for rnd in range(3):
                for name in (list(times) if rnd % 2 == 0 else list(times)[::-1]):
                    if name == "quantize_qkv":
                        fn = lambda: qk_quant_triton.quantize_qkv(q, k, v, **options, is_causal=causal)  # noqa: E731
                    else:
                        launch, qb_tile, warps, stages = VARIANTS[name]
                        ds = torch.full_like(x.delta_s, float("nan"))
                        fn = lambda: launch(k, x.q_mean, ds, n, causal, qb_tile, warps, stages)  # noqa: E731
                        try:
                            fn()
                        except triton.runtime.errors.OutOfResources as err:
                            print(f"N={n} causal={int(causal)} {name}: not run ({err})", flush=True)
                            continue
                        if not torch.equal(ds[..., written], want):
                            raise AssertionError(f"{name}: ΔS differs (N={n}, causal={causal})")
                    times[name].append(float(triton.testing.do_bench(fn, rep=100, return_mode="median")))
            for name, ts in times.items():
                if not ts:
                    continue
                us = min(ts) * 1e3
                rate = f"  {nbytes / us / 1e6:.2f} TB/s" if name != "quantize_qkv" else ""
                print(f"N={n} causal={int(causal)} {name:22s} {us:9.1f} µs{rate}", flush=True)


if __name__ == "__main__":
    main()
