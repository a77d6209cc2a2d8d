#!/usr/bin/env bash
# GPU checks for the device machine: GPU-marked tests, the crossover table, perplexity through the kernels,
# the attention and model benchmarks.
#   bash eval/run_gpu_checks.sh [tests|tune|ppl|bench|models|all]   (writes under $OUT; expects carry/ with the
#   model, data and a diffusers wheel: see eval/README.md)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
what=${1:-all}
python -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
python -m pip install -q --no-deps carry/wheels/*.whl >>"$OUT/install.log" 2>&1
export QP_GIT_SHA=${QP_GIT_SHA:-unknown} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
if [[ $what == tests || $what == all ]]; then
  # with pytest-xdist (a carried wheel), 8 workers share the GPU: the suite compiles hundreds of kernels
  workers=$(python -c "import xdist" 2>/dev/null && echo "-n 8 -p no:benchmark")
  python -m pytest -q -s -m gpu -rfEs -p no:cacheprovider --tb=short $workers tests/kernels tests/patches tests/quantpatch \
    tests/bad_inputs >"$OUT/pytest_gpu.log" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed|PSNR" "$OUT/pytest_gpu.log" | tail -20
fi
if [[ $what == tune || $what == all ]]; then
  python -m quantpatch.cli tune --out "$OUT/crossovers.json" 2>&1 | grep -v "it/s\]" | tail -24
fi
if [[ $what == ppl || $what == all ]]; then
  python eval/perplexity.py --model carry/models/pydoc-llama-21m --data carry/data/pydoc-val.jsonl \
    --max-tokens 16384 --window 1024 --dtype bfloat16 --device cuda \
    --modes off sage2-8b int8-flash fireq sage2-4b turbo --out "$OUT/pydoc-llama-21m_gpu.json" 2>&1 | grep -v "it/s\]" | tail -12 | tee "$OUT/pydoc-llama-21m_gpu.txt"
fi
if [[ $what == bench || $what == all ]]; then
  python eval/bench_attention.py --out "$OUT/bench" 2>&1 | tail -40 | tee "$OUT/bench_tail.log"
fi
if [[ $what == models || $what == all ]]; then
  python eval/bench_models.py --out "$OUT/bench_models" --layers wan-14b=8 hunyuanvideo=6 llama3-8b-prefill-32k-b8=4 \
    llama3-8b-decode-b8-32k=4 2>&1 | grep "^|" | tail -80
fi
