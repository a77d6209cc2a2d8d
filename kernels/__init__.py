"""quantpatch.kernels: Triton kernels and their pure-PyTorch references, one subpackage per op.

* :mod:`.attention`: quantized attention (references, quantization pass, Triton and Gluon kernels, custom ops);
* :mod:`.turbo_kv`: TurboAttention's compressed KV cache and its decode attention;
* :mod:`.fireq_kv`: FireQ's INT4 KV cache, FP8 queries, decode attention and key scalings;
* :mod:`.w4a8`: FireQ's W4A8-FP linear;
* :mod:`.fp8_linear`: the FP8 linear;
* :mod:`.rotary`: the rotary embedding of queries and keys, in the forms Wan2.1, Diffusers and Transformers use.

Shared by every op: :mod:`.quant_ref` (quantization primitives), :mod:`.device` (which device runs which kernel),
:mod:`.compiled_launch` (launch plans), :mod:`.rounding_triton` (Triton rounding functions) and
:mod:`.gluon_compat` (Gluon names across Triton versions).

Importing this package never imports Triton or initialises CUDA; the Triton modules load
lazily when a fast path is first used.
"""
