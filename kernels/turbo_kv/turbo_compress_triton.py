"""TurboAttention block compression (Triton): Blockwise Progressive Quantization, Algorithm 1.

One program compresses one ``n_b``-token block of one KV head, in the numerics of
:func:`~quantpatch.kernels.turbo_kv.turbo_ref.turbo_compress_kv_ref` (bit-exact: IEEE divisions through
``div_rn``, round-half-even through the 1.5·2²³ trick)::

    step 1 (STEP1), INT8 symmetric per block:  s = absmax(X_j) / qmax (1 if 0)   X^{q1} = clamp(rne(X_j / s), ±qmax)
    step 2, per channel c of the block:        s^int = max(1, rne((max − min) / L))     L = 2^bits − 1
                                               z^int = rne(min / s^int)
                                               X^{q2} = clamp(rne(X^{q1} / s^int − z^int), 0, L)

The block is loaded as a ``(n_b, D / k, k)`` tile, ``k = 8 / bits`` codes a byte (channel
``k·j + i`` at ``[:, j, i]``), so the packed byte ``j`` is ``Σ_i X^{q2}[:, j, i] << (bits·i)``, the
layout of :func:`~quantpatch.kernels.turbo_kv.turbo_ref.pack_codes` (INT4: low nibble = even channel).

Mixed precision: heads are grouped by width (one launch per width); each group's codes go to
one ``(B, H_g, T·n_b, D·bits/8)`` tensor and ``CompressedKV.codes[h]`` is a view of head ``h``'s row.
Without step 1 (``turbo_compress_int8_blocks``, the full INT8 buffer of ``turbo_append_ref``) the
input is already on the INT8 grid and its block scale is given.

Custom op ``quantpatch::turbo_compress`` (with ``register_fake``), launched on the current stream.

A decode step that leaves the INT8 buffer short of a block only appends to it (:func:`turbo_append_buffer`, one
launch): the buffered rows are copied, the new tokens quantized with the buffer's universal scale after them, and
the values the clamp to ``±qmax`` cut are counted on the device, as ``turbo_append_ref`` and ``TurboLayer`` do.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ..compiled_launch import LaunchPlans
from ..rounding_triton import _rne
from .turbo_ref import TURBO_BLOCK, TURBO_QMAX, CompressedKV, Int8Buffer, bit_groups, per_head_bits, width_views

KERNEL_BITS = (2, 4)  # code widths the kernels take (8-bit codes stay on the reference)


@triton.jit(do_not_specialize=["T"])  # T blocks: 1 in decode, many at prefill; one compiled variant for both
def _turbo_compress_kernel(
    X_ptr, stride_xb, stride_xh, stride_xn,
    C_ptr, stride_cb, stride_ch, stride_cn,
    S_ptr, Z_ptr, BS_ptr, HEADS_ptr,
    HKV, HG, T,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr, QMAX: tl.constexpr, STEP1: tl.constexpr,
):
    """Block ``program_id(0)`` of head ``HEADS[program_id(1) % HG]``, batch ``program_id(1) // HG``."""
    t = tl.program_id(0)
    pid = tl.program_id(1)
    b = pid // HG
    slot = pid % HG
    h = tl.load(HEADS_ptr + slot)
    PER_BYTE: tl.constexpr = 8 // BITS
    LEVELS: tl.constexpr = 2**BITS - 1
    offs_n = t * BLOCK + tl.arange(0, BLOCK)
    offs_j = tl.arange(0, HEAD_DIM // PER_BYTE)
    offs_i = tl.arange(0, PER_BYTE)
    chan = offs_j[:, None] * PER_BYTE + offs_i[None, :]  # (D/k, k)
    x_ptrs = X_ptr + b.to(tl.int64) * stride_xb + h * stride_xh + offs_n[:, None, None] * stride_xn + chan[None]
    x = tl.load(x_ptrs).to(tl.float32)  # (BLOCK, D/k, k)
    bht = (b * HKV + h) * T + t
    if STEP1:
        absmax = tl.max(tl.max(tl.max(tl.abs(x), 2), 1), 0)
        scale = tl.math.div_rn(absmax, QMAX * 1.0)
        scale = tl.where(scale == 0.0, 1.0, scale)
        x = tl.minimum(tl.maximum(_rne(tl.math.div_rn(x, scale)), -QMAX * 1.0), QMAX * 1.0)
        tl.store(BS_ptr + bht, scale)
    hi = tl.max(x, 0)
    lo = tl.min(x, 0)
    s = tl.maximum(_rne(tl.math.div_rn(hi - lo, LEVELS * 1.0)), 1.0)
    z = _rne(tl.math.div_rn(lo, s))
    q = tl.minimum(tl.maximum(_rne(tl.math.div_rn(x, s[None]) - z[None]), 0.0), LEVELS * 1.0)
    packed = tl.sum(q.to(tl.int32) << (offs_i * BITS)[None, None, :], 2)  # disjoint bit fields: sum = or
    c_ptrs = C_ptr + b.to(tl.int64) * stride_cb + slot * stride_ch + offs_n[:, None] * stride_cn + offs_j[None, :]
    tl.store(c_ptrs, packed.to(tl.uint8))
    sz_off = bht.to(tl.int64) * HEAD_DIM + chan
    tl.store(S_ptr + sz_off, s.to(tl.int8))
    tl.store(Z_ptr + sz_off, z.to(tl.int8))


@triton.jit(do_not_specialize=["M"])  # M buffered tokens: 0 to block - 1 over a generation, one variant for all
def _turbo_append_kernel(
    X_ptr, stride_xb, stride_xh, stride_xn,
    OLD_ptr, NEW_ptr, S_ptr, CLAMPED_ptr,
    HKV, M, N_NEW,
    HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, QMAX: tl.constexpr,
):
    """The INT8 buffer of head ``program_id(0) % HKV``, batch ``program_id(0) // HKV``: its ``M`` rows copied, then
    ``clamp(rne(x / s), ±QMAX)`` of the ``N_NEW`` new rows; the count of ``|rne(x / s)| > QMAX`` added to
    ``CLAMPED``. ``ROWS`` ≥ ``M + N_NEW``, a power of two."""
    pid = tl.program_id(0)
    b = pid // HKV
    h = pid % HKV
    rows = tl.arange(0, ROWS)
    d = tl.arange(0, HEAD_DIM)
    total = M + N_NEW
    old = tl.load(OLD_ptr + (pid.to(tl.int64) * M + rows[:, None]) * HEAD_DIM + d[None, :], mask=rows[:, None] < M,
                  other=0)
    fresh = (rows >= M) & (rows < total)
    x_ptrs = X_ptr + b.to(tl.int64) * stride_xb + h * stride_xh + (rows - M)[:, None] * stride_xn + d[None, :]
    x = tl.load(x_ptrs, mask=fresh[:, None], other=0.0).to(tl.float32)
    q = _rne(tl.math.div_rn(x, tl.load(S_ptr + pid)))
    tl.atomic_add(CLAMPED_ptr, tl.sum(tl.sum(((tl.abs(q) > QMAX) & fresh[:, None]).to(tl.int32), 1), 0))
    q = tl.minimum(tl.maximum(q, -QMAX * 1.0), QMAX * 1.0)
    out = tl.where(fresh[:, None], q.to(tl.int8), old)
    tl.store(NEW_ptr + (pid.to(tl.int64) * total + rows[:, None]) * HEAD_DIM + d[None, :], out,
             mask=rows[:, None] < total)


_APPEND = LaunchPlans(_turbo_append_kernel)


# --------------------------------------------------------------------------- launcher


@functools.lru_cache(maxsize=256)
def _heads_tensor(heads: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(heads, dtype=torch.int32, device=device)


def _tile_unsupported(d: int, block: int) -> str | None:
    """Why the kernels here cannot tile a head_dim ``d`` and a cache block of ``block`` tokens (None if they can)."""
    if d < 16 or d > 256 or d & (d - 1):
        return f"head_dim {d} is not a power of two in [16, 256]"
    if block < 16 or block & (block - 1):
        return f"block {block} is not a power of two >= 16"
    return None


def compress_unsupported(x: torch.Tensor, bits: Sequence[int], block: int) -> str | None:
    """Why the compression kernel cannot take ``x (B, Hkv, N, D)`` (None if it can)."""
    if any(w not in KERNEL_BITS for w in bits):
        return f"code widths {sorted(set(bits))} (the kernel packs {list(KERNEL_BITS)})"
    if (reason := _tile_unsupported(x.shape[-1], block)) is not None:
        return reason
    if x.stride(-1) != 1:
        return "head_dim is not the contiguous dimension"
    return None


def _compress_launch(x: torch.Tensor, bits: Sequence[int], block: int, qmax: int, step1: bool) -> list[torch.Tensor]:
    b, h, n, d = x.shape
    t = n // block
    int_scale = torch.empty((b, h, t, d), dtype=torch.int8, device=x.device)
    int_zero = torch.empty_like(int_scale)
    block_scale = torch.empty((b, h, t) if step1 else (0,), dtype=torch.float32, device=x.device)
    codes = []
    for (width,), heads in bit_groups(bits):
        c = torch.empty((b, len(heads), n, d * width // 8), dtype=torch.uint8, device=x.device)
        codes.append(c)
        if c.numel() == 0:
            continue
        _turbo_compress_kernel[(t, b * len(heads))](
            x, x.stride(0), x.stride(1), x.stride(2),
            c, c.stride(0), c.stride(1), c.stride(2),
            int_scale, int_zero, block_scale if step1 else int_scale, _heads_tensor(tuple(heads), x.device),
            h, len(heads), t,
            HEAD_DIM=d, BLOCK=block, BITS=width, QMAX=qmax, STEP1=step1, num_warps=4,
        )
    return [*codes, int_scale, int_zero, block_scale]


@torch.library.custom_op("quantpatch::turbo_compress", mutates_args=())
def turbo_compress_op(x: torch.Tensor, bits: list[int], block: int, qmax: int, step1: bool) -> list[torch.Tensor]:
    """Custom-op form of the compression: ``[codes of each width group (B, H_g, N, D·w/8)..., s^int, z^int, s]``.

    ``s`` (block scales ``(B, Hkv, T)``) is empty when ``step1`` is False (the caller has them).
    """
    return _compress_launch(x, bits, block, qmax, step1)


@turbo_compress_op.register_fake
def _(x, bits, block, qmax, step1):
    b, h, n, d = x.shape
    t = n // block
    codes = [x.new_empty((b, len(heads), n, d * width // 8), dtype=torch.uint8) for (width,), heads in bit_groups(bits)]
    sz = x.new_empty((b, h, t, d), dtype=torch.int8)
    return [*codes, sz, torch.empty_like(sz), x.new_empty((b, h, t) if step1 else (0,), dtype=torch.float32)]


def _compressed(
    parts: list[torch.Tensor], bits: tuple[int, ...], block: int, block_scale: torch.Tensor
) -> CompressedKV:
    n_groups = len(bit_groups(bits))
    return CompressedKV(
        codes=width_views(parts[:n_groups], bits),
        int_scale=parts[n_groups],
        int_zero=parts[n_groups + 1],
        block_scale=block_scale,
        bits=bits,
        block=block,
    )


def _check(x: torch.Tensor, bits: tuple[int, ...], block: int) -> None:
    if x.dim() != 4 or x.shape[-2] % block:
        raise ValueError(f"expected (B, Hkv, T·{block}, D) whole blocks, got {tuple(x.shape)}")
    reason = compress_unsupported(x, bits, block)
    if reason is not None:
        raise ValueError(f"turbo compression kernel: {reason}")


def turbo_compress_blocks(
    x: torch.Tensor, bits: int | Sequence[int], *, block: int = TURBO_BLOCK, qmax: int = TURBO_QMAX
) -> CompressedKV:
    """Both BPQ steps on full blocks ``x (B, Hkv, T·block, D)`` (any float dtype), bit-exact with the reference.

    The ``compress_blocks`` of :func:`~quantpatch.kernels.turbo_kv.turbo_ref.turbo_compress_kv_ref`.

    Returns:
        ``CompressedKV``: codes ``(B, T·block, D·bits[h]/8)`` per head, ``s^int``/``z^int`` int8
        ``(B, Hkv, T, D)``, float32 block scales ``(B, Hkv, T)``.
    """
    bits = per_head_bits(bits, x.shape[1])
    _check(x, bits, block)
    parts = turbo_compress_op(x, list(bits), block, qmax, True)
    return _compressed(parts[:-1], bits, block, parts[-1])


def turbo_compress_int8_blocks(
    values: torch.Tensor, block_scale: torch.Tensor, bits: int | Sequence[int], *, block: int = TURBO_BLOCK
) -> CompressedKV:
    """Step 2 only, on blocks already on the INT8 grid: the kernel form of ``turbo_ref.compress_int8_blocks``.

    Args:
        values: integer-valued ``(B, Hkv, T·block, D)`` in ``[-qmax, qmax]`` (any float or int dtype).
        block_scale: ``(B, Hkv, T)`` INT8-step scale of each block (carried).
    """
    bits = per_head_bits(bits, values.shape[1])
    _check(values, bits, block)
    parts = turbo_compress_op(values, list(bits), block, TURBO_QMAX, False)
    return _compressed(parts[:-1], bits, block, block_scale)


def append_unsupported(x: torch.Tensor, block: int) -> str | None:
    """Why :func:`turbo_append_buffer` cannot take states shaped like ``x (B, Hkv, n, D)`` into buffers of ``block``
    tokens (None if it can)."""
    return _tile_unsupported(x.shape[-1], block)


def turbo_append_buffer(x: torch.Tensor, buffer: Int8Buffer, clamped: torch.Tensor, *, block: int = TURBO_BLOCK,
                        plan_key: tuple | None = None) -> Int8Buffer:
    """``x (B, Hkv, n, D)`` (any float dtype, head_dim contiguous) appended to ``buffer`` (``Nb + n < block``):
    the ``Int8Buffer`` of ``turbo_ref.turbo_append_ref`` when no block fills, byte for byte, in one launch, and
    the number of new values beyond ``±qmax`` (before their clamp) added to ``clamped`` (int32 ``(1,)``, on the
    device: no host sync). ``buffer.scale`` is ``(B, Hkv, 1, 1)`` float32; see also :func:`append_unsupported`.
    ``plan_key``: the launch plan's key where the caller knows one (:class:`~quantpatch.kernels.compiled_launch.
    LaunchPlans`); it must follow ``x``'s dtype, shape and strides."""
    b, h, n, d = x.shape
    m = buffer.n_tokens
    if m + n >= block or x.stride(-1) != 1 or not buffer.values.is_contiguous() or not buffer.scale.is_contiguous():
        raise ValueError(f"turbo_append_buffer: {m} buffered + {n} new tokens must stay short of a block ({block}), "
                         "with head_dim contiguous and the buffer and its scale contiguous")
    values = torch.empty((b, h, m + n, d), dtype=torch.int8, device=x.device)
    _APPEND((b * h,),
            (x, x.stride(0), x.stride(1), x.stride(2), buffer.values, values, buffer.scale, clamped, h, m, n),
            dict(HEAD_DIM=d, ROWS=block, QMAX=buffer.qmax), plan_key=plan_key, num_warps=4)
    return Int8Buffer(values=values, scale=buffer.scale, qmax=buffer.qmax)


__all__ = ["append_unsupported", "compress_unsupported", "turbo_append_buffer", "turbo_compress_blocks",
           "turbo_compress_int8_blocks"]
