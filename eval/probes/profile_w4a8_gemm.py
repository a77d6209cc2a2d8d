"""Nsight Compute profile of the Gluon W4A8 GEMMs (GPU with ``ncu``): the prefill GEMM at ``M > 16`` and the decode
GEMM at ``M ≤ 16`` (the library's routing), each on pre-quantized fragment-order x̂ (``bench_linear``'s layer).
Runs itself under ``ncu --set full --import-source yes`` once per shape, one launch after warm-up calls, and
writes under ``--out`` ``<kernel>_K_N_M.ncu-rep``, its details page (``…details.txt``: speed of light, warp
states, stall reasons), its SASS with per-instruction stall samples (``…sass.csv``) and a summary of those
(``…stalls.txt``: samples by stall reason, the instructions with the most samples, loads and stores with excess
L2 sectors): ``python eval/probes/profile_w4a8_gemm.py --out DIR [--shapes K N M ...] [--ncu PATH]``;
``--report REP.ncu-rep`` writes the pages and the summary of an earlier profile beside it."""

import argparse
import csv
import shutil
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_linear import Layer  # noqa: E402

from quantpatch.kernels import w4a8_triton as wt  # noqa: E402

WARMUP = 4  # launches before the profiled one (compiles and launch plans settle)


def _decode(k: int, n: int, m: int) -> bool:
    """Whether the library serves ``m`` tokens by the decode GEMM (its routing table), else the prefill one."""
    return wt.gemm_config(m, n, k)["kernel"] == "decode"


def drive(k: int, n: int, m: int) -> None:
    """``WARMUP + 1`` calls of the GEMM that serves ``m`` tokens (:func:`_decode`)."""
    from quantpatch.kernels.w4a8_gluon import w4a8_gemm_gluon
    from quantpatch.kernels.w4a8_prefill_gluon import w4a8_gemm_prefill_gluon

    layer = Layer(k, n, torch.device("cuda"), seed=k + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to("cuda", torch.bfloat16)
    frag = wt.quantize_activation_fp8(x, fragment_order=True)
    gemm = w4a8_gemm_gluon if _decode(k, n, m) else w4a8_gemm_prefill_gluon
    for _ in range(WARMUP + 1):
        gemm(*frag, *layer.w4a8_args(), torch.bfloat16)
    torch.cuda.synchronize()


def profile(ncu: str, k: int, n: int, m: int, out: Path) -> None:
    kernel = "_w4a8_decode_gluon" if _decode(k, n, m) else "_w4a8_prefill_gluon"
    rep = out / f"{kernel.strip('_')}_{k}_{n}_{m}"
    cmd = [ncu, "--set", "full", "--import-source", "yes", "--kernel-name", f"regex:{kernel}",
           "--launch-skip", str(WARMUP), "--launch-count", "1", "--export", str(rep), "--force-overwrite",
           sys.executable, __file__, "--drive", str(k), str(n), str(m)]
    subprocess.run(cmd, check=True)
    write_pages(ncu, rep)


def write_pages(ncu: str, rep: Path) -> None:
    for page, suffix, extra in (("details", "details.txt", []),
                                ("source", "sass.csv", ["--print-source", "sass", "--csv"])):
        text = subprocess.run([ncu, "--import", f"{rep}.ncu-rep", "--page", page, *extra], check=True,
                              capture_output=True, text=True).stdout
        Path(f"{rep}_{suffix}").write_text(text)
    Path(f"{rep}_stalls.txt").write_text(stall_summary(Path(f"{rep}_sass.csv")))


def stall_summary(sass_csv: Path, top: int = 30) -> str:
    """Samples by stall reason, the ``top`` instructions by samples (with their three main reasons), and every
    global access with excess L2 sectors, from ncu's ``--page source --print-source sass --csv``."""
    rows = list(csv.reader(sass_csv.open()))
    head, body = rows[1], rows[2:]
    col = {name: i for i, name in enumerate(head)}
    reasons = [name for name in head if name.startswith("stall_") and not name.endswith("(Not Issued)")]

    def count(row, name):
        value = row[col[name]]
        return int(value) if value.isdigit() else 0

    total = sum(count(r, "Warp Stall Sampling (All Samples)") for r in body)
    by_reason = sorted(((sum(count(r, name) for r in body), name) for name in reasons), reverse=True)
    lines = [f"{len(body)} instructions, {total} samples", "by reason: " + ", ".join(
        f"{name[6:]} {n} ({n / max(total, 1):.0%})" for n, name in by_reason if n)]
    ranked = sorted(range(len(body)), key=lambda i: -count(body[i], "Warp Stall Sampling (All Samples)"))[:top]
    lines.append(f"top {top} instructions (index, samples, SASS, main reasons):")
    for i in sorted(ranked):
        r = body[i]
        main = sorted(((count(r, name), name[6:]) for name in reasons if count(r, name)), reverse=True)[:3]
        lines.append(f"{i:5d} {count(r, 'Warp Stall Sampling (All Samples)'):5d}  {r[col['Source']].strip()[:72]:72s} "
                     + " ".join(f"{name} {n}" for n, name in main))
    lines.append("global accesses with excess L2 sectors (index, SASS, excess / sectors):")
    for i, r in enumerate(body):
        if count(r, "L2 Theoretical Sectors Global Excessive"):
            lines.append(f"{i:5d} {r[col['Source']].strip()[:72]:72s} "
                         f"{count(r, 'L2 Theoretical Sectors Global Excessive')} / "
                         f"{count(r, 'L2 Theoretical Sectors Global')}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    parser.add_argument("--shapes", type=int, nargs="+", default=[4096, 4096, 4096, 4096, 4096, 16],
                        help="K N M triples")
    parser.add_argument("--ncu", default=shutil.which("ncu") or "/usr/local/cuda/bin/ncu")
    parser.add_argument("--report", type=Path, help="an earlier profile's .ncu-rep: write its pages and summary")
    parser.add_argument("--drive", type=int, nargs=3, help=argparse.SUPPRESS)  # the process ncu profiles
    args = parser.parse_args()
    if args.drive:
        drive(*args.drive)
        return
    if args.report:
        write_pages(args.ncu, args.report.with_suffix(""))
        return
    if args.out is None or len(args.shapes) % 3:
        parser.error("--out DIR and K N M triples are needed")
    args.out.mkdir(parents=True, exist_ok=True)
    for i in range(0, len(args.shapes), 3):
        profile(args.ncu, *args.shapes[i:i + 3], args.out)


if __name__ == "__main__":
    main()
