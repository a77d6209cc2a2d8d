"""``eval/multigpu_checks.py --device cpu``: the script's code paths on two gloo CPU processes under torchrun (its
2-GPU run is ``eval/run_multigpu_checks.sh``), writing its table and JSON record."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

SCRIPT = Path(__file__).resolve().parents[2] / "eval" / "multigpu_checks.py"


def test_smoke_run_writes_the_summary(tmp_path):
    env = os.environ | {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "QP_MULTIGPU_TMP": str(tmp_path)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT),
           "--device", "cpu", "--out", str(tmp_path / "out"), "--prompt", "64", "--generate-prompt", "16",
           "--new-tokens", "8", "--reps", "1"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((tmp_path / "out" / "multigpu_checks.json").read_text())
    results = {row["check"]: row["result"] for row in record["rows"]}
    # the CPU smoke run times two processes on two cores: its speedup row is no measurement, the rest must pass
    speed = [check for check in results if "one step vs one GPU" in check]
    assert len(speed) == 1 and len(results) == 5
    assert all(result == "PASS" for check, result in results.items() if check not in speed), results
    assert "| check | value | target | result | detail |" in (tmp_path / "out" / "multigpu_checks.md").read_text()
