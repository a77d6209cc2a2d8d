"""Patch a Transformers causal LM, generate, and restore it.

    python examples/patch_llama.py [MODEL_DIR_OR_HUB_ID]

Without an argument a tiny Llama with random weights is built from a config (nothing is downloaded), so the
report and the restore run anywhere; with one, the model and its tokenizer are loaded and a prompt is decoded.
"""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

import quantpatch

# policy="speed" (the default) runs the quantized kernel only where it beats SDPA on this GPU, so on the CPU every
# call would run SDPA; there the example asks for the mode's numerics (the PyTorch reference) to show its accuracy
POLICY = "speed" if torch.cuda.is_available() else "always"

torch.manual_seed(0)
if len(sys.argv) > 1:
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
    input_ids = tokenizer("class Stack:\n    def __init__(self):\n", return_tensors="pt").input_ids
else:
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model, tokenizer = LlamaForCausalLM(config).eval(), None
    input_ids = torch.randint(0, config.vocab_size, (1, 48))

with torch.no_grad():
    reference = model.generate(input_ids, max_new_tokens=32, do_sample=False)
    with quantpatch.patch_model(model, "sage2-8b", policy=POLICY) as handle:
        print(handle.report())
        out = model.generate(input_ids, max_new_tokens=32, do_sample=False)
    restored = model.generate(input_ids, max_new_tokens=32, do_sample=False)
# leaving the block restored the original attention, bit for bit
print(f"greedy tokens equal to the unpatched model's: {(out == reference).float().mean():.0%}")
print(f"restored model reproduces the unpatched output: {torch.equal(restored, reference)}")
if tokenizer is not None:
    print(tokenizer.decode(out[0]))
