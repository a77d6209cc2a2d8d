"""The real pydoc-llama-21m weights (GQA, RoPE), patched: greedy generation is unchanged."""

from pathlib import Path

import pytest
import torch

import quantpatch as qp
from tests.gpu import needs_cuda

MODEL = Path(__file__).resolve().parents[3] / "shared" / "models" / "pydoc-llama-21m"
PROMPTS = [
    "import os\n\ndef list_files(path):\n",
    "The :mod:`json` module provides",
    "class Stack:\n    def __init__(self):\n",
    "To open a file for reading, use",
    "for i in range(10):\n    if i % 2 == 0:\n",
]

pytestmark = pytest.mark.skipif(not MODEL.exists(), reason=f"optional asset missing: {MODEL}")


DEVICES = [
    pytest.param(("cpu", torch.float32), id="cpu-fp32"),
    pytest.param(("cuda", torch.bfloat16), id="cuda-bf16", marks=[pytest.mark.gpu, needs_cuda]),
]


@pytest.fixture(scope="module", params=DEVICES)
def pydoc(request):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device, dtype = request.param
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=dtype).to(device).eval()
    return model, AutoTokenizer.from_pretrained(MODEL)


def _greedy(model, tok, prompt):
    ids = tok(prompt, return_tensors="pt").to(model.device)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=16, do_sample=False, pad_token_id=tok.eos_token_id)
    return out[0, ids.input_ids.shape[1] :].tolist()


def _margin_at(model, tok, prompt, generated, step):
    """Top-1 minus top-2 logit of the unpatched model where ``generated`` took its ``step``-th token."""
    ids = tok(prompt, return_tensors="pt").input_ids.to(model.device)
    ids = torch.cat([ids, torch.tensor([generated[:step]], dtype=ids.dtype, device=ids.device)], dim=1)
    with torch.no_grad():
        top = model(ids).logits[0, -1].topk(2).values
    return float(top[0] - top[1])


def test_sage2_8b_keeps_greedy_tokens_except_at_near_ties(pydoc, no_leaks):
    # The target is identical 16-token greedy output on 5 prompts under sage2-8b. Measured on the
    # CPU: 5/5 at 2f8ad5d; 4/5 at an earlier commit (16/20 on pydoc-val prompts there;
    # int8-flash 5/5 and 19/20). The one prompt that flips with rounding is a near-tie: "import os ...
    # list_files(path):\n" has 'def' ahead of '\n' by 0.074 logits, and FP8 P̃·V moves that margin
    # by about 0.05 (Q·K INT8 by 0.01). Asserted: at least 4/5, and every divergence starts where the
    # unpatched model's top-2 margin is under 0.15 logits.
    model, tok = pydoc
    base = [_greedy(model, tok, p) for p in PROMPTS]
    with qp.patch_model(model, "sage2-8b", policy="always") as handle:
        patched = [_greedy(model, tok, p) for p in PROMPTS]
    assert len(handle.sites) == 6 and not handle.fallbacks()
    same = sum(a == b for a, b in zip(base, patched))
    print(f"sage2-8b greedy on {model.device} {model.dtype}: {same}/5 prompts keep their 16 tokens")
    assert same >= 4
    for prompt, a, b in zip(PROMPTS, base, patched):
        if a != b:
            step = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            assert _margin_at(model, tok, prompt, a, step) < 0.15
    assert [_greedy(model, tok, p) for p in PROMPTS] == base
