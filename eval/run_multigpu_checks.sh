#!/usr/bin/env bash
# Multi-GPU checks on a 2-GPU device machine: the multigpu tests, then eval/multigpu_checks.py (Wan-1.3B-shaped
# under Diffusers Ulysses / ring, Llama-8B-shaped under tensor parallelism and device_map), one summary table.
#   bash eval/run_multigpu_checks.sh [tests|checks|all] [multigpu_checks.py options]   (writes under $OUT; expects
#   carry/wheels/ with a diffusers wheel, and an accelerate wheel where the machine lacks accelerate)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
what=${1:-all}; shift || true
python -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
python -m pip install -q --no-deps carry/wheels/*.whl >>"$OUT/install.log" 2>&1
python -c "import accelerate, diffusers" 2>/dev/null || {
  echo "accelerate and diffusers must import: carry their wheels in carry/wheels/ (accelerate-*-py3-none-any.whl)"; exit 1; }
# NVLink multicast stays off on shared hosts
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python -c "import torch, transformers, diffusers, accelerate as a; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'diffusers', diffusers.__version__, 'accelerate', a.__version__)" | tee -a "$OUT/gpu.txt"
if [[ $what == tests || $what == all ]]; then
  timeout 150 torchrun --standalone --nproc-per-node 2 -m pytest -q -m multigpu -rs -p no:cacheprovider --tb=short \
    tests/multigpu/test_multigpu.py >"$OUT/pytest_multigpu.log" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed|skipped" "$OUT/pytest_multigpu.log" | tail -12
fi
if [[ $what == checks || $what == all ]]; then
  timeout 420 torchrun --standalone --nproc-per-node 2 eval/multigpu_checks.py --out "$OUT" "$@" \
    >"$OUT/multigpu_checks.log" 2>&1
  grep -E "^\[|^\||checks pass|Error|error" "$OUT/multigpu_checks.log" | grep -v "Warning" | tail -40
fi
