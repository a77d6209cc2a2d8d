"""Importing quantpatch must not pull heavy libraries in nor initialise CUDA."""

import subprocess
import sys

HEAVY = ("transformers", "diffusers", "triton", "accelerate", "lm_eval", "datasets")


def test_import_is_light():
    code = (
        "import sys, torch, quantpatch, quantpatch.kernels, quantpatch.patches\n"
        f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "assert not torch.cuda.is_initialized()\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
