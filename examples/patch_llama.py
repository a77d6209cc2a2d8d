"""Patch a Transformers causal LM, generate, and restore it.

    python examples/patch_llama.py [MODEL_DIR]      # default: the bundled pydoc-llama-21m
"""

import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import quantpatch

path = sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[2] / "shared/models/pydoc-llama-21m"
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
tokenizer = AutoTokenizer.from_pretrained(path)
inputs = tokenizer("class Stack:\n    def __init__(self):\n", return_tensors="pt")

with quantpatch.patch_model(model, "sage2-8b") as handle:
    print(handle.report())
    out = model.generate(**inputs, max_new_tokens=32, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    print(tokenizer.decode(out[0]))
# leaving the block restored the original attention, bit for bit
