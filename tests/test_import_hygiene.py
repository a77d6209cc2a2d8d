"""Importing quantpatch must not pull heavy libraries in nor initialise CUDA; patching imports no calibration method."""

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


def test_patching_imports_no_calibration_method_and_calibrating_only_its_own():
    """``patch_model`` (sage2-8b on a Llama) imports neither method module (FireQ, TurboAttention); calibrating
    for ``turbo`` then imports TurboAttention's and still not FireQ's."""
    code = (
        "import sys, torch, transformers as T, quantpatch\n"
        "cfg = T.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,\n"
        "                    num_attention_heads=2, num_key_value_heads=1)\n"
        "model = T.LlamaForCausalLM(cfg).eval()\n"
        "quantpatch.patch_model(model, 'sage2-8b').remove()\n"
        "methods = lambda: sorted(m for m in sys.modules if m.startswith('quantpatch.methods.'))\n"
        "assert methods() == [], methods()\n"
        "quantpatch.calibrate(model, [torch.arange(1, 20)], 'turbo', progress=False)\n"
        "assert methods() == ['quantpatch.methods.turbo'], methods()\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
