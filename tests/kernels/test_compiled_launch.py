"""The key of a compiled-kernel launch plan (``kernels/compiled_launch.py``): what Triton specializes on."""

import torch

from quantpatch.kernels.compiled_launch import specialization


def test_specialization_tells_apart_what_triton_compiles_apart():
    aligned = torch.zeros(64, dtype=torch.float32)
    offset = aligned[1:]  # 4 bytes past a 16-byte boundary
    one, sixteen, seventeen, big = specialization((1, 16, 17, 2**31))
    assert one == ("constexpr", 1)  # an int 1 becomes a constant of the compiled kernel
    assert sixteen[1] == "D" and seventeen[1] != "D" and sixteen[0] == seventeen[0] == "i32"
    assert big[0] == "i64"
    a, b, c = specialization((aligned, offset, aligned.to(torch.bfloat16)))
    assert a[1] == "D" and b[1] != "D" and a[0] != c[0]
    assert specialization((32, aligned)) == specialization((48, torch.ones(8)))  # same class: one plan
