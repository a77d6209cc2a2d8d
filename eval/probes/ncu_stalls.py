"""Where a kernel's warps stall, from Nsight Compute's PC sampling (needs a GPU with ncu for ``run``).

    # the program ncu profiles: CALLS calls of the quantization pass and the Gluon attention kernel itself, sage2-8b
    # (or --mode int8-flash), non-causal unless --causal, B=4, H=32, D=128, bf16
    python eval/probes/ncu_stalls.py run [N] [CALLS] [--mode MODE] [--causal]
    # e.g. the Gluon attention kernel's third launch at N=8k (the quantization kernels: -k regex:q_and_kv_stats …)
    ncu --clock-control none --set full --import-source yes -k regex:attn_qk_int8_fwd_gluon --launch-skip 2 \\
        --launch-count 1 -f -o gluon python eval/probes/ncu_stalls.py run 8192 3
    ncu -i gluon.ncu-rep --page source --csv --print-source sass > gluon_sass.csv
    # the summary (a .csv or .csv.gz export)
    python eval/probes/ncu_stalls.py summarize gluon_sass.csv

``summarize`` finds the hot loops (runs of instructions executed the most common loop count, more than once a
program) and prints, per loop: its share of the samples, the stall reasons as shares of its samples, the
instructions a warp executes per iteration by opcode, and per opcode its share of the loop's samples with its
top stall reasons. ``selected`` is a warp issuing; the rest are the reasons it could not.
"""

import collections
import csv
import gzip
import sys

MAX_GAP = 60  # instructions between two hot instructions of one loop at most


def read_sass(path: str) -> tuple[list[str], list[list[str]]]:
    """Header and instruction rows of an ncu ``--page source --print-source sass`` CSV export."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = list(csv.reader(f))
    start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    return rows[start], rows[start + 1:]


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def opcode(sass: str) -> str:
    parts = sass.split()
    if not parts:
        return ""
    return (parts[1] if parts[0].startswith("@") and len(parts) > 1 else parts[0]).split(".")[0]


def hot_loops(executed: list[float]) -> tuple[float, list[tuple[int, int]]]:
    """The loop count (the executed count that accounts for the most instructions) and the index ranges of the
    runs of instructions executed that often."""
    weight = collections.Counter()
    for n in executed:
        if n > 0:
            weight[n] += n
    count = max(weight, key=weight.get)
    ranges: list[list[int]] = []
    for i, n in enumerate(executed):
        if n == count:
            if ranges and i - ranges[-1][1] <= MAX_GAP:
                ranges[-1][1] = i
            else:
                ranges.append([i, i])
    return count, [(lo, hi) for lo, hi in ranges]


def summarize(path: str) -> None:
    header, rows = read_sass(path)
    col = {name: i for i, name in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "(Not Issued)" not in h]
    samples = [number(r[col["Warp Stall Sampling (All Samples)"]]) for r in rows]
    executed = [number(r[col["Instructions Executed"]]) for r in rows]
    total = sum(samples)
    count, loops = hot_loops(executed)
    print(f"{path}: {len(rows)} instructions, {total:.0f} samples; loop count {count:.0f}")
    for lo, hi in loops:
        loop = rows[lo:hi + 1]
        loop_samples = sum(samples[lo:hi + 1])
        stalls = collections.Counter()
        per_op = collections.defaultdict(collections.Counter)
        instrs = collections.Counter()
        for r in loop:
            op = opcode(r[col["Source"]])
            instrs[op] += number(r[col["Instructions Executed"]]) / count
            for reason in reasons:
                v = number(r[col[reason]])
                stalls[reason[6:]] += v
                per_op[op][reason[6:]] += v
        print(f"\nloop at rows {lo}-{hi}: {loop_samples / total:.1%} of the samples, "
              f"{sum(instrs.values()):.0f} instructions a warp an iteration")
        print("  stalls: " + " ".join(f"{k} {v / loop_samples:.3f}" for k, v in stalls.most_common(10)))
        print("  per iteration: " + " ".join(f"{k} {v:.0f}" for k, v in instrs.most_common(16)))
        for op, c in sorted(per_op.items(), key=lambda kv: -sum(kv[1].values()))[:12]:
            s = sum(c.values())
            top = " ".join(f"{k} {v / s:.2f}" for k, v in c.most_common(4))
            print(f"  {op:10s} {s / loop_samples:6.1%} of the loop: {top}")


def run(n: int, calls: int, mode: str, causal: bool) -> None:
    import torch

    import quantpatch as qp
    from quantpatch.kernels import fast_paths
    from quantpatch.kernels.attn_gluon import attn_qk_int8_gluon
    from quantpatch.kernels.qk_quant_triton import QuantizedQKV

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(4, 32, n, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    cfg = qp.get_mode(mode).attention
    for _ in range(calls):
        x = QuantizedQKV(*fast_paths.quantize_qkv_op(q, k, v, **fast_paths.quant_options(cfg), v_key_order=True))
        attn_qk_int8_gluon(x, n, qk_granularity=cfg.qk_granularity, is_causal=causal, block_q=cfg.block_q,
                           v_keys_permuted=x.v_hat_t)
    torch.cuda.synchronize()


if __name__ == "__main__":
    if sys.argv[1:2] == ["summarize"] and len(sys.argv) == 3:
        summarize(sys.argv[2])
    elif sys.argv[1:2] == ["run"]:
        args = sys.argv[2:]
        mode = args[args.index("--mode") + 1] if "--mode" in args else "sage2-8b"
        given = [int(a) for a in args if a.isdigit()]
        run(*(given + [8192, 3][len(given):]), mode=mode, causal="--causal" in args)
    else:
        sys.exit(__doc__)
