#!/usr/bin/env bash
# FireQ W4A8 on the device machine: GPU tests, (TUNE=1) the GEMM configuration sweep, then the linear benchmark.
#   QP_GIT_SHA=<sha> [TUNE=1] [TUNE_TOKENS="1 16"] bash eval/run_w4a8_gpu.sh   (results: $OUT/w4a8.tgz, logs under $OUT)
# Each stage has its own time box so one slow stage cannot starve the others inside a 300 s call.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
RES=/tmp/w4a8; mkdir -p "$RES"
export PYTHONUNBUFFERED=1 QP_GIT_SHA=${QP_GIT_SHA:-unknown}
python -m pip install -q --no-deps --no-build-isolation -e . >"$RES/install.log" 2>&1 || { cat "$RES/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv,noheader | tee "$RES/gpu.txt"
timeout "${TEST_S:-110}" python -m pytest -q -m gpu -rs -p no:cacheprovider --tb=short --durations=8 \
  tests/kernels/test_w4a8_triton.py tests/quantpatch/test_w4a8_linear.py >"$RES/pytest_gpu.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed|^E " "$RES/pytest_gpu.log" | head -20
if [[ ${TUNE:-0} == 1 ]]; then  # the sweep first: the benchmark then runs the rows it picks (best_table.json)
  # shellcheck disable=SC2086
  timeout "${TUNE_S:-100}" python eval/bench_linear.py --tune --warmup 5 --rep 20 --tokens ${TUNE_TOKENS:-1 16 128 4096} \
    --out "$RES/tune" >"$RES/tune.log" 2>&1
  grep -E "best|Error" "$RES/tune.log" | cut -c1-230
  cat "$RES/tune/best_table.json"; echo
fi
configs=(); [[ -s $RES/tune/best_table.json ]] && configs=(--configs "$RES/tune/best_table.json")
timeout "${BENCH_S:-80}" python eval/bench_linear.py "${configs[@]}" --out "$RES/bench" >"$RES/bench.log" 2>&1
grep -E "M=   1|M=  16|accuracy|Error|error" "$RES/bench.log" | grep -E "bf16|w4a8|accuracy|rror" | cut -c1-150 | head -60
tar czf "$OUT/w4a8.tgz" -C /tmp w4a8
cp "$RES/pytest_gpu.log" "$RES/bench.log" "$OUT/" 2>/dev/null
