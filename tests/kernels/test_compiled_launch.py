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


def test_host_arithmetic_matches_triton_helpers():
    import triton

    from quantpatch.kernels.compiled_launch import cdiv, next_pow2

    for a in (1, 2, 15, 16, 17, 4096, 14337):
        for b in (1, 3, 16, 64):
            assert cdiv(a, b) == triton.cdiv(a, b)
        assert next_pow2(a) == triton.next_power_of_2(a)
    assert cdiv(0, 16) == 0 and next_pow2(0) == 1  # (an empty count still gets a 1-wide tile)
