#!/usr/bin/env bash
# GPU checks for the device machine: GPU-marked tests, perplexity through the kernels, attention benchmark.
#   bash eval/run_gpu_checks.sh [tests|ppl|bench|all]   (writes under $OUT; expects carry/ with the model,
#   data and a diffusers wheel: see eval/README.md)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
what=${1:-all}
python -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
python -m pip install -q --no-deps carry/wheels/*.whl >>"$OUT/install.log" 2>&1
export QP_GIT_SHA=${QP_GIT_SHA:-unknown} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
if [[ $what == tests || $what == all ]]; then
  python -m pytest -q -s -m gpu -rs -p no:cacheprovider --tb=short tests/kernels tests/patches >"$OUT/pytest_gpu.log" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed|PSNR" "$OUT/pytest_gpu.log" | tail -20
fi
if [[ $what == ppl || $what == all ]]; then
  python eval/perplexity.py --model carry/models/pydoc-llama-21m --data carry/data/pydoc-val.jsonl \
    --max-tokens 16384 --window 1024 --dtype bfloat16 --device cuda \
    --modes off sage2-8b int8-flash fireq sage2-4b turbo --out "$OUT/ppl_gpu.json" 2>&1 | grep -v "it/s\]" | tail -12 | tee "$OUT/ppl_gpu.txt"
fi
if [[ $what == bench || $what == all ]]; then
  python eval/bench_attention.py --out "$OUT/bench" 2>&1 | tail -40 | tee "$OUT/bench_tail.log"
fi
