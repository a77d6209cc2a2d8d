"""What both Gluon W4A8 GEMMs (:mod:`.w4a8_gluon`, M ≤ 16; :mod:`.w4a8_prefill_gluon`, M > 16) share: the INT4
weights as the FP8 wgmma's register operand, loaded as words straight into the registers that operand takes, and the
epilogue.

A group's packed bytes ``[rows, 64]`` are loaded as int32 words, 16 contiguous bytes of rows r and r + 8 a thread
(:data:`WORDS_L`: one ``ld.global.v4`` each), unpacked to e4m3 bits of ``v · 2⁻⁹`` by 10 PTX instructions a word
(:func:`_unpack`) and relabelled (:func:`_weight_operand`, no data movement) into wgmma's 8-bit A fragment, given x̂ in
fragment order (:func:`~quantpatch.kernels.w4a8.w4a8_act_quant_triton.fragment_slots`). σ is taken as ``σ · 2⁹``
(:data:`SIGMA_SHIFT`): powers of two, so every product and partial is that of ``ŵ`` and ``σ`` exactly.
"""

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .w4a8_ref import GROUP_SIZE

WG_ROWS = gl.constexpr(64)  # output channels of a warpgroup: its wgmma M
GROUP = gl.constexpr(GROUP_SIZE)  # input channels per scale
HALF = gl.constexpr(GROUP_SIZE // 2)  # bytes of one group of one output channel
SIGMA_SHIFT = gl.constexpr(512.0)  # 2⁹: the operand is ŵ · 2⁻⁹
# a group's words as a warpgroup's thread needs them: 4 contiguous (one 16-byte load) for rows r and r + 8, as in
# the wgmma accumulator's layout
WORDS_L = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [8, 0]], lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, GROUP_SIZE // 8]))


def check_x_hat(x_hat: torch.Tensor) -> None:
    """Both GEMMs read ``x̂`` (fragment order) as a contiguous ``float8_e4m3fn (M, K)``: a ValueError where it is
    not one, before any launch."""
    if not x_hat.is_contiguous() or x_hat.dtype != torch.float8_e4m3fn:
        raise ValueError("x_hat must be a contiguous float8_e4m3fn (M, K)")


def weight_words(qweight: torch.Tensor) -> torch.Tensor:
    """``qweight uint8 (N, K/2)`` as the ``int32 (N, K/8)`` words the kernels load; a ValueError where its row
    stride or address is not a multiple of 4 bytes (a view the words cannot be read from)."""
    if qweight.stride(0) % 4 or qweight.data_ptr() % 4:
        raise ValueError(f"the Gluon W4A8 GEMMs read qweight as 4-byte words: its row stride ({qweight.stride(0)}) "
                         "and address must be multiples of 4 (pass a contiguous copy)")
    return qweight.view(torch.int32)


# Two's complement INT4 → e4m3 bits of v · 2⁻⁹. In: a word of 4 packed bytes ($2). Out: their low nibbles ($0)
# and high nibbles ($1), a byte each. v ≥ 0: the byte v (subnormal v · 2⁻⁹); v < 0: 0x80 | (16 − n) = 0x90 − n
# (sign, |v| · 2⁻⁹; |v| = 8 is 2⁻⁶, exponent 1). prmt 0xBA98 spreads each byte's sign bit over the byte (the
# mask), lop3 0xD8 picks (mask ? b : a).
_UNPACK_ASM = gl.constexpr("""{
.reg .b32 xl, xh, nl, nh, ml, mh, t;
and.b32 xl, $2, 0x0F0F0F0F;
shr.u32 t, $2, 4;
and.b32 xh, t, 0x0F0F0F0F;
shl.b32 t, $2, 4;
prmt.b32 ml, t, 0, 0xBA98;
prmt.b32 mh, $2, 0, 0xBA98;
sub.u32 nl, 0x90909090, xl;
sub.u32 nh, 0x90909090, xh;
lop3.b32 $0, xl, nl, ml, 0xD8;
lop3.b32 $1, xh, nh, mh, 0xD8;
}""")


@gluon.jit
def _unpack(wb):
    """Packed words ``int32 [128, 16]`` → ``(low, high)`` nibbles as e4m3 bits of ``v · 2⁻⁹``, 4 a word."""
    return gl.inline_asm_elementwise(_UNPACK_ASM, "=r,=r,r", [wb], dtype=(gl.int32, gl.int32), is_pure=True, pack=1)


@gluon.jit
def _word_bytes(w):
    """``int32 [R, C]`` → ``int8 [R, 4C]``, byte ``i`` of word ``c`` at ``4c + i`` (register renaming)."""
    t = gl.join(gl.join(w.to(gl.int8), (w >> 16).to(gl.int8)), gl.join((w >> 8).to(gl.int8), (w >> 24).to(gl.int8)))
    return gl.reshape(t, [w.shape[0], 4 * w.shape[1]])


@gluon.jit
def _weight_operand(lo, hi, op_l: gl.constexpr):
    """The unpacked words of a group → the e4m3 A operand ``[rows, 128]`` in fragment order: byte ``16q + 4s + j``
    of a row holds slots ``32s + 4q + j`` (low nibble) and ``32s + 16 + 4q + j`` (high nibble)."""
    rows: gl.constexpr = lo.shape[0]
    t = gl.join(_word_bytes(lo), _word_bytes(hi))  # [rows, 64, 2]
    t = gl.permute(gl.reshape(t, [rows, 4, 4, 4, 2]), (0, 2, 4, 1, 3))  # (q, s, j, h) → (s, h, q, j)
    t = gl.reshape(t, [rows, GROUP]).to(gl.float8e4nv, bitcast=True)
    return gl.convert_layout(t, op_l)


@gluon.jit
def _epilogue(acc, AS_ptr, B_ptr, PTS_ptr, offs_n, offs_m, n_ok, m_ok, HAS_BIAS: gl.constexpr):
    """``(acc ⊙ β) · 2⁻ⁿ (+ bias)`` on ``accᵀ [64, BM]`` in fp32, the reference's order."""
    beta = gl.load(AS_ptr + offs_m, mask=m_ok, other=1.0, cache_modifier=".cg").to(gl.float32)
    n_pts = gl.load(PTS_ptr)
    inv_delta = ((127 - n_pts) << 23).to(gl.float32, bitcast=True)  # 2⁻ⁿ exactly (0 ≤ n ≤ 126)
    y = acc * beta[None, :] * inv_delta
    if HAS_BIAS:
        y += gl.load(B_ptr + offs_n, mask=n_ok, other=0.0).to(gl.float32)[:, None]
    return y
