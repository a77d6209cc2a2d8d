#!/usr/bin/env bash
# FireQ W4A8 on the device machine: GPU tests, (TUNE=1) the configuration sweeps, then the linear benchmark.
#   QP_GIT_SHA=<sha> [TUNE=1] [TUNE_TOKENS="1 16"] [TUNE_BIG=1] [BENCH_ARGS=...] bash eval/run_w4a8_gpu.sh
# Results: $OUT/w4a8.tgz, logs under $OUT. Each stage has its own time box so one slow stage cannot starve the
# others inside one device call.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
RES=/tmp/w4a8; mkdir -p "$RES"
export PYTHONUNBUFFERED=1 QP_GIT_SHA=${QP_GIT_SHA:-unknown}
python -m pip install -q --no-deps --no-build-isolation -e . >"$RES/install.log" 2>&1 || { cat "$RES/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv,noheader | tee "$RES/gpu.txt"
if [[ ${TEST_S:-110} -gt 0 ]]; then
  timeout "${TEST_S:-110}" python -m pytest -q -m gpu -rs -p no:cacheprovider --tb=short --durations=8 \
    tests/kernels/test_w4a8_triton.py tests/quantpatch/test_w4a8_linear.py >"$RES/pytest_gpu.log" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed|^E " "$RES/pytest_gpu.log" | head -20
fi
if [[ ${TUNE:-0} == 1 ]]; then  # the decode sweep (M ≤ 16): the benchmark then runs the row it picks
  # shellcheck disable=SC2086
  timeout "${TUNE_S:-100}" python eval/bench_linear.py --tune --warmup 5 --rep 20 --tokens ${TUNE_TOKENS:-1 16} \
    --out "$RES/tune" >"$RES/tune.log" 2>&1
  grep -E "best|Error" "$RES/tune.log" | cut -c1-260
fi
if [[ ${TUNE_BIG:-0} == 1 ]]; then  # the tiled sweep at M = 4096
  timeout "${TUNE_BIG_S:-70}" python eval/bench_linear.py --tune --warmup 5 --rep 20 --tokens 4096 \
    --out "$RES/tune_big" >"$RES/tune_big.log" 2>&1
  grep -E "tune K|Error" "$RES/tune_big.log" | cut -c1-260
fi
python - "$RES" <<'PY'  # one table from both sweeps (rows by max M)
import json, pathlib, sys
res = pathlib.Path(sys.argv[1]); rows = {}
for name in ("tune", "tune_big"):
    f = res / name / "best_table.json"
    if f.exists():
        rows.update({json.dumps(m): c for m, c in json.loads(f.read_text())})
if rows:
    (res / "best_table.json").write_text(json.dumps([[json.loads(m), c] for m, c in rows.items()]))
    print("best table:", (res / "best_table.json").read_text())
PY
configs=(); [[ -s $RES/best_table.json ]] && configs=(--configs "$RES/best_table.json")
if [[ ${BENCH_S:-80} -gt 0 ]]; then
  # shellcheck disable=SC2086
  timeout "${BENCH_S:-80}" python eval/bench_linear.py "${configs[@]}" ${BENCH_ARGS:-} --out "$RES/bench" \
    >"$RES/bench.log" 2>&1
  grep -E "M=   1|M=  16|M=4096|accuracy|Error|error" "$RES/bench.log" | grep -E "bf16|w4a8|fp8-tensor|accuracy|rror" \
    | cut -c1-150 | head -80
fi
tar czf "$OUT/w4a8.tgz" -C /tmp w4a8
cp "$RES/pytest_gpu.log" "$RES/bench.log" "$OUT/" 2>/dev/null
true
