"""TurboAttention KV-cache numerics (FlashQ, §3 and Appendix A), reference.

Each K or V tensor ``(B, Hkv, N, D)`` of a layer's cache is held in two parts:

* **compressed blocks** of ``n_b = 64`` tokens, Blockwise Progressive Quantization (BPQ, eq. 9-10,
  Algorithm 1), with ``L = 2^b − 1`` and ``b`` = 4 or 2 per KV head (head-wise mixed precision)::

      step 1, symmetric INT8 per block and head:    s = absmax(X_j) / 119        X^{q1} = round(X_j / s)
      step 2, asymmetric per channel of the block:  s^int = max(1, round((max − min) / L))
                                                     z^int = round(min / s^int)
                                                     X^{q2} = clamp(round(X^{q1} / s^int − z^int), 0, L)

  ``X^{q2}`` is packed 2 (INT4) or 4 (INT2) codes per byte along the channels, ``s^int`` and
  ``z^int`` are stored in INT8 (one per channel per block), ``s`` in floating point (one per block).
* **an INT8 buffer** of the ``< n_b`` most recent tokens (§3.3), quantized with one *universal*
  scale per head and clamped to ±119, so that a new, larger token never forces the buffer to be
  re-quantized. When the buffer holds ``n_b`` tokens it becomes a compressed block (step 2 only;
  its block scale is the universal scale).

Decode (Algorithm 2) dequantizes a block to the INT8 grid, ``X^{q1} ≈ (X^{q2} + z^int) · s^int``,
and runs the INT8 attention of the ``turbo`` mode on it (Q per token ``absmax / 119``, SAS, P INT8
per tile). Algorithm 2 prints the inverse as ``X^{q2} · s^int + z^int``; with Algorithm 1's
``z^int = round(min / s^int)`` (in code units) the exact inverse is ``(X^{q2} + z^int) · s^int``,
which a kernel may evaluate as ``X^{q2} · s^int + (z^int · s^int)``.

Why 119: a 4-bit block decodes to ``|X^{q1}| ≤ 119 + s^int / 2 ≤ 119 + 8 = 127`` (``s^int ≤
round(238 / 15) = 16``), so the dequantized block is a valid INT8 operand. A 2-bit block has
``s^int`` up to ``round(238 / 3) = 79`` and can decode to −158; :func:`turbo_decompress_kv_ref`
saturates to ±127 ("dequantize into INT8", eq. 7-8), which never moves a value away from its
input (every input lies in ±119) and is a no-op for 4-bit heads.

Layout: tokens on dim −2, channels on dim −1, as in :mod:`quant_ref`. Quantization math runs in
float32 (``compute_dtype``) with round-half-to-even, like every other reference here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from quantpatch.config import AttentionConfig
from quantpatch.modes import get_mode

from ..attention.quant_attention_ref import quant_attention_ref
from ..quant_ref import (
    dequantize_asymmetric_int,
    quantize_asymmetric_int,
    quantize_symmetric,
    quantize_tokens,
    symmetric_scale,
)

TURBO_BLOCK = 64  # n_b = B_c = 64 (TurboAttention §5.2)
TURBO_QMAX = 119  # first-step INT8 range (Algorithm 1)
INT8_MAX = 127  # saturation of the dequantized INT8 operand
CODE_BITS = (2, 4, 8)  # 8: step 2 is lossless (s^int = 1, z^int = min), one code per byte


# --------------------------------------------------------------------------- packing


def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned ``bits``-bit codes ``q (..., D)`` into bytes along the channel dim.

    Channel ``c`` of a byte group goes to bits ``[bits·(c mod k), bits·(c mod k + 1))`` of byte
    ``c // k``, ``k = 8 / bits`` (INT4: low nibble = even channel; INT2: channel 4i+j at bits 2j).

    Returns:
        uint8 tensor ``(..., D·bits/8)``.
    """
    if bits not in CODE_BITS:
        raise ValueError(f"bits={bits} is not valid; choose one of {list(CODE_BITS)}")
    per_byte = 8 // bits
    if q.shape[-1] % per_byte:
        raise ValueError(f"{bits}-bit packing needs the last dim divisible by {per_byte}, got {q.shape[-1]}")
    if q.numel() and (q.min() < 0 or q.max() > 2**bits - 1):
        raise ValueError(f"codes must lie in [0, {2**bits - 1}] for {bits}-bit packing")
    u = q.to(torch.uint8).unflatten(-1, (-1, per_byte))
    out = u[..., 0]
    for i in range(1, per_byte):
        out = out | (u[..., i] << (bits * i))
    return out


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: uint8 ``(..., D·bits/8)`` → uint8 codes ``(..., D)``."""
    if bits not in CODE_BITS:
        raise ValueError(f"bits={bits} is not valid; choose one of {list(CODE_BITS)}")
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & (2**bits - 1)).flatten(-2)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte along the channel dim: ``(..., D)`` → uint8 ``(..., D/2)``."""
    return pack_codes(q, 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``(..., D/2)`` → 4-bit codes ``(..., D)``."""
    return unpack_codes(packed, 4)


def pack_int2(q: torch.Tensor) -> torch.Tensor:
    """Four 2-bit codes per byte along the channel dim: ``(..., D)`` → uint8 ``(..., D/4)``."""
    return pack_codes(q, 2)


def unpack_int2(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``(..., D/4)`` → 2-bit codes ``(..., D)``."""
    return unpack_codes(packed, 2)


# --------------------------------------------------------------------------- containers


def bit_groups(*widths: Sequence[int]) -> list[tuple[tuple[int, ...], list[int]]]:
    """Heads grouped by their widths: ``[(key, heads)]``, key = the widths of head ``h`` in each sequence.

    ``bit_groups((4, 2, 4))`` → ``[((2,), [1]), ((4,), [0, 2])]``; the decode kernel groups by
    ``(k_bits, v_bits)`` pairs. The kernels launch once per group; keys sorted, heads ascending.
    """
    groups: dict[tuple[int, ...], list[int]] = {}
    for h, key in enumerate(zip(*widths)):
        groups.setdefault(tuple(key), []).append(h)
    return sorted(groups.items())


def per_head_bits(bits: int | Sequence[int], kv_heads: int) -> tuple[int, ...]:
    """Normalize ``bits`` (one int for every head, or one per KV head) to a tuple of ``kv_heads`` ints."""
    out = (int(bits),) * kv_heads if isinstance(bits, int) else tuple(int(b) for b in bits)
    if len(out) != kv_heads:
        raise ValueError(f"got {len(out)} per-head bit widths for {kv_heads} KV heads")
    bad = [b for b in out if b not in CODE_BITS]
    if bad:
        raise ValueError(f"bit widths {bad} are not valid; choose from {list(CODE_BITS)}")
    return out


@dataclass(frozen=True)
class CompressedKV:
    """The BPQ-compressed blocks of one K or V tensor.

    Attributes:
        codes: one uint8 tensor per KV head, ``(B, T·block, D·bits[h]/8)``: packed ``X^{q2}`` (the compressions,
            the appends and the batch maps store the heads of one width as views of one ``(B, H_w, T·block, ·)``
            tensor: :func:`map_width_codes`).
        int_scale: int8 ``(B, Hkv, T, D)``: ``s^int`` per channel per block.
        int_zero: int8 ``(B, Hkv, T, D)``: ``z^int`` per channel per block (code units).
        block_scale: float ``(B, Hkv, T)``: ``s`` of the INT8 step per block.
        bits: code width per KV head (2, 4 or 8).
        block: tokens per block (``n_b``).
    """

    codes: tuple[torch.Tensor, ...]
    int_scale: torch.Tensor
    int_zero: torch.Tensor
    block_scale: torch.Tensor
    bits: tuple[int, ...]
    block: int = TURBO_BLOCK

    def __post_init__(self) -> None:
        b, h, t, d = self.int_scale.shape
        if len(self.codes) != h or len(self.bits) != h:
            raise ValueError(f"CompressedKV: {len(self.codes)} code tensors, {len(self.bits)} bit widths, {h} heads")
        if self.int_zero.shape != self.int_scale.shape or self.block_scale.shape != (b, h, t):
            raise ValueError("CompressedKV: int_zero must match int_scale and block_scale must be (B, Hkv, T)")
        for c, nbits in zip(self.codes, self.bits):
            if c.dtype != torch.uint8 or tuple(c.shape) != (b, t * self.block, d * nbits // 8):
                raise ValueError(f"CompressedKV: codes {tuple(c.shape)} {c.dtype} do not match {nbits}-bit blocks")

    @property
    def kv_heads(self) -> int:
        return self.int_scale.shape[1]

    @property
    def head_dim(self) -> int:
        return self.int_scale.shape[-1]

    @property
    def n_blocks(self) -> int:
        return self.int_scale.shape[2]

    @property
    def n_tokens(self) -> int:
        return self.n_blocks * self.block

    def nbytes(self) -> int:
        """Bytes of every stored tensor, as stored here (block scales in their own dtype)."""
        tensors = (*self.codes, self.int_scale, self.int_zero, self.block_scale)
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class Int8Buffer:
    """The INT8 buffer of recent tokens of one K or V tensor (§3.3).

    Attributes:
        values: int8 ``(B, Hkv, Nb, D)`` in ``[-qmax, qmax]``, ``Nb < block`` between appends.
        scale: float ``(B, Hkv, 1, 1)``: the universal scale of each head, fixed for the generation.
        qmax: the symmetric INT8 range (119).
    """

    values: torch.Tensor
    scale: torch.Tensor
    qmax: int = TURBO_QMAX

    def __post_init__(self) -> None:
        b, h = self.values.shape[:2]
        if self.values.dtype != torch.int8 or self.scale.shape != (b, h, 1, 1):
            raise ValueError("Int8Buffer: values must be int8 (B, Hkv, Nb, D) and scale (B, Hkv, 1, 1)")

    @property
    def n_tokens(self) -> int:
        return self.values.shape[-2]

    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size() + self.scale.numel() * self.scale.element_size()


def _width_tensor(codes: Sequence[torch.Tensor]) -> torch.Tensor:
    """The heads' codes ``(B, N, W)`` of one width as one ``(B, H_w, N, W)`` tensor: the tensor they are views of
    (one storage, one stride from a head to the next), else a stacked copy."""
    first = codes[0]
    step = codes[1].storage_offset() - first.storage_offset() if len(codes) > 1 else 0
    storage = first.untyped_storage().data_ptr()
    if step >= 0 and all(c.untyped_storage().data_ptr() == storage and c.stride() == first.stride()
                         and c.storage_offset() == first.storage_offset() + i * step for i, c in enumerate(codes)):
        b, n, w = first.shape
        return first.as_strided((b, len(codes), n, w), (first.stride(0), step, *first.stride()[1:]),
                                first.storage_offset())
    return torch.stack(tuple(codes), dim=1)


def width_views(groups: Sequence[torch.Tensor], bits: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """Each head's codes ``(B, N, D·w/8)`` as a view of its width's tensor: ``groups[i]`` ``(B, H_w, N, D·w/8)``
    holds the heads of the ``i``-th width of :func:`bit_groups` ``(bits)``, ascending."""
    codes: list[torch.Tensor | None] = [None] * len(bits)
    for group, (_, heads) in zip(groups, bit_groups(bits), strict=True):
        for slot, head in enumerate(heads):
            codes[head] = group[:, slot]
    return tuple(codes)


def map_width_codes(fn: Callable[..., torch.Tensor], *caches: CompressedKV) -> tuple[torch.Tensor, ...]:
    """Each head's codes of ``fn`` applied per code width: ``fn(codes_a, codes_b, …)`` gets the width's codes of each
    of ``caches`` (same widths) as one ``(B, H_w, N, D·w/8)`` tensor, heads ascending, and returns one
    ``(B', H_w, N', D·w/8)`` tensor whose ``[:, slot]`` views become the heads' codes.

    So the heads of one width stay views of one tensor, as the compression kernel and :func:`compress_int8_blocks`
    store them: the decode kernels address a width group's heads by their code offsets from its first head's, which
    then keep one pattern (evenly spaced, 16-byte multiples) through appends and batch maps, and so does their
    compiled variant."""
    bits = caches[0].bits
    return width_views([fn(*(_width_tensor([c.codes[h] for h in heads]) for c in caches))
                        for _, heads in bit_groups(bits)], bits)


# --------------------------------------------------------------------------- compression


def _to_int8(x: torch.Tensor, what: str) -> torch.Tensor:
    if x.numel() and (x.min() < -128 or x.max() > 127):
        raise ValueError(f"{what} does not fit in int8 (range [{int(x.min())}, {int(x.max())}])")
    return x.to(torch.int8)


def compress_int8_blocks(
    values: torch.Tensor, block_scale: torch.Tensor, bits: int | Sequence[int], *, block: int = TURBO_BLOCK
) -> CompressedKV:
    """Step 2 of BPQ (eq. 10) on blocks already on the INT8 grid.

    Per block ``j``, head ``h`` and channel ``c`` (``L = 2^{bits[h]} − 1``, over the block's tokens)::

        s^int = max(1, round((max − min) / L)),  z^int = round(min / s^int),  q = clamp(round(x / s^int − z^int), 0, L)

    Args:
        values: integer-valued ``(B, Hkv, T·block, D)`` in ``[-qmax, qmax]`` (any float or int dtype).
        block_scale: ``(B, Hkv, T)`` INT8-step scale of each block (carried, not used here).
        bits: one code width for every head, or one per KV head (2, 4 or 8).
    """
    b, h, n, d = values.shape
    if n % block:
        raise ValueError(f"compress_int8_blocks needs whole blocks of {block} tokens, got {n}")
    bits = per_head_bits(bits, h)
    tiles = values.to(torch.float32).unflatten(-2, (-1, block))  # (B, Hkv, T, block, D)
    groups = []  # one (B, H_w, N, D·w/8) tensor per width: its heads' codes are views of it
    scales, zeros = tiles.new_empty(b, h, n // block, d), tiles.new_empty(b, h, n // block, d)
    for (nbits,), heads in bit_groups(bits):
        # dim=-2 is the token dim inside each block: one (s^int, z^int) per channel per block.
        q, s, z = quantize_asymmetric_int(tiles[:, heads], nbits, dim=-2)
        scales[:, heads], zeros[:, heads] = s.squeeze(-2), z.squeeze(-2)
        groups.append(pack_codes(q.flatten(-3, -2), nbits))
    return CompressedKV(
        codes=width_views(groups, bits),
        int_scale=_to_int8(scales, "s^int"),
        int_zero=_to_int8(zeros, "z^int"),
        block_scale=block_scale,
        bits=bits,
        block=block,
    )


def turbo_compress_kv_ref(
    x: torch.Tensor,
    bits: int | Sequence[int],
    *,
    block: int = TURBO_BLOCK,
    qmax: int = TURBO_QMAX,
    buffer_scale: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32,
    compress_blocks: Callable[..., CompressedKV] | None = None,
) -> tuple[CompressedKV, Int8Buffer]:
    """Compress a prefill K or V ``(B, Hkv, N, D)`` (TurboAttention Algorithm 1, eq. 9-10).

    The ``⌊N / block⌋`` full blocks are quantized to INT8 with one scale per block and head
    (``absmax / qmax``) and then to ``bits`` channel-wise (:func:`compress_int8_blocks`). The
    ``N mod block`` tail tokens start the INT8 buffer, quantized with the universal scale
    ``buffer_scale`` (default: ``absmax`` of the head's whole prompt ``/ qmax``, so that later
    decode tokens of the same magnitude are rarely clamped).

    ``compress_blocks(x_full, bits, block=, qmax=)`` replaces both steps on the full blocks
    ``x_full (B, Hkv, T·block, D)`` (in ``x``'s dtype), e.g. the Triton kernel
    ``turbo_compress_triton.turbo_compress_blocks``; the default is this reference.

    Returns:
        ``(CompressedKV, Int8Buffer)``.
    """
    if x.shape[-2] == 0 and buffer_scale is None:
        raise ValueError("an empty prompt needs an explicit buffer_scale (the universal INT8 scale)")
    n_full = (x.shape[-2] // block) * block
    if compress_blocks is not None:
        compressed = compress_blocks(x[..., :n_full, :], bits, block=block, qmax=qmax)
    x = x.to(compute_dtype)
    if compress_blocks is None:
        q1, token_scale = quantize_tokens(x[..., :n_full, :], "block", role="k", qmax=qmax, block=block)
        compressed = compress_int8_blocks(q1, token_scale[..., ::block, 0], bits, block=block)
    if buffer_scale is None:
        buffer_scale = symmetric_scale(x.abs().amax(dim=(-2, -1), keepdim=True), qmax)
    buffer_scale = buffer_scale.to(compute_dtype).expand(*x.shape[:2], 1, 1)
    tail = quantize_symmetric(x[..., n_full:, :], buffer_scale, qmax)
    # contiguous: a slice of the prompt's states keeps their token-major strides, which the append kernel refuses
    return compressed, Int8Buffer(values=tail.to(torch.int8).contiguous(), scale=buffer_scale.contiguous(), qmax=qmax)


def _cat_blocks(a: CompressedKV, b: CompressedKV) -> CompressedKV:
    if a.bits != b.bits or a.block != b.block:
        raise ValueError("cannot concatenate CompressedKV with different bit widths or block sizes")
    return CompressedKV(
        codes=map_width_codes(lambda x, y: torch.cat([x, y], dim=-2), a, b),
        int_scale=torch.cat([a.int_scale, b.int_scale], dim=2),
        int_zero=torch.cat([a.int_zero, b.int_zero], dim=2),
        block_scale=torch.cat([a.block_scale, b.block_scale.to(a.block_scale.dtype)], dim=2),
        bits=a.bits,
        block=a.block,
    )


def turbo_append_ref(
    compressed: CompressedKV,
    buffer: Int8Buffer,
    x_new: torch.Tensor,
    *,
    compress_int8: Callable[..., CompressedKV] = compress_int8_blocks,
) -> tuple[CompressedKV, Int8Buffer]:
    """Append decode tokens ``x_new (B, Hkv, n, D)`` to the cache (TurboAttention §3.3).

    New tokens are quantized with the buffer's universal scale and clamped to ``±qmax``
    (``round(x / s)``, never re-scaling what is already buffered); every time the buffer
    holds ``block`` tokens, that block is compressed by ``compress_int8`` (default
    :func:`compress_int8_blocks`; same signature, e.g. the Triton kernel) with block scale = the
    universal scale.

    Returns:
        the updated ``(CompressedKV, Int8Buffer)`` (inputs are not modified).
    """
    scale = buffer.scale
    q_new = quantize_symmetric(x_new.to(scale.dtype), scale, buffer.qmax)
    values = torch.cat([buffer.values.to(scale.dtype), q_new], dim=-2)
    block = compressed.block
    n_full = (values.shape[-2] // block) * block
    if n_full:
        b, h = values.shape[:2]
        fresh = compress_int8(
            values[..., :n_full, :], scale[..., 0].expand(b, h, n_full // block), compressed.bits, block=block
        )
        compressed = _cat_blocks(compressed, fresh)
    return compressed, Int8Buffer(values=values[..., n_full:, :].to(torch.int8).contiguous(), scale=scale,
                                  qmax=buffer.qmax)


def turbo_decompress_kv_ref(
    compressed: CompressedKV, buffer: Int8Buffer | None = None, *, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantize the cache to the INT8 grid (TurboAttention Algorithm 2, eq. 7-8).

    Per block: ``X^{q1} = clamp((X^{q2} + z^int) · s^int, −127, 127)`` (the saturation only acts
    on 2-bit blocks, see the module docstring); the buffer's INT8 values follow unchanged.

    Returns:
        ``(values, scale)``: integer-valued ``values (B, Hkv, N, D)`` and per-token ``scale
        (B, Hkv, N, 1)`` in ``dtype``, ``N = compressed.n_tokens + buffer.n_tokens``; ``X ≈ values · scale``.
        This is the ``k_quantized`` / ``v_quantized`` pair of ``quant_attention_ref``.
    """
    block, device = compressed.block, compressed.int_scale.device
    heads = []
    for h, (codes, nbits) in enumerate(zip(compressed.codes, compressed.bits)):
        q = unpack_codes(codes, nbits).to(dtype).unflatten(-2, (-1, block))  # (B, T, block, D)
        s = compressed.int_scale[:, h].to(dtype).unsqueeze(-2)
        z = compressed.int_zero[:, h].to(dtype).unsqueeze(-2)
        heads.append(dequantize_asymmetric_int(q, s, z).flatten(-3, -2))
    b, h, t, d = compressed.int_scale.shape
    values = torch.stack(heads, dim=1) if heads else torch.zeros(b, 0, t * block, d, dtype=dtype, device=device)
    values = torch.clamp(values, -INT8_MAX, INT8_MAX)
    scale = compressed.block_scale.to(dtype).repeat_interleave(block, dim=-1).unsqueeze(-1)
    if buffer is not None:
        values = torch.cat([values, buffer.values.to(dtype)], dim=-2)
        scale = torch.cat([scale, buffer.scale.to(dtype).expand(b, h, buffer.n_tokens, 1)], dim=-2)
    return values, scale


# --------------------------------------------------------------------------- memory


def turbo_kv_bytes(
    n_tokens: int,
    head_dim: int,
    bits: int | Sequence[int],
    *,
    kv_heads: int | None = None,
    batch: int = 1,
    block: int = TURBO_BLOCK,
    scale_bytes: int = 2,
) -> int:
    """Bytes of one compressed K or V tensor of ``n_tokens`` tokens.

    Per head: ``T = ⌊N / block⌋`` blocks of ``block·D·bits/8`` code bytes + ``D`` INT8 ``s^int`` +
    ``D`` INT8 ``z^int`` + one ``s`` (``scale_bytes``: FP16 in the paper, 2); the ``N mod block``
    buffered tokens take ``D`` INT8 bytes each, plus the universal scale. ``bits`` is one width
    for ``kv_heads`` heads (default 1) or one per head. Compare with ``2·B·Hkv·N·D`` for bf16.
    """
    widths = per_head_bits(bits, kv_heads if kv_heads is not None else (1 if isinstance(bits, int) else len(bits)))
    n_blocks, tail = divmod(n_tokens, block)
    per_head = [n_blocks * (block * head_dim * w // 8 + 2 * head_dim + scale_bytes) for w in widths]
    buffer = tail * head_dim + scale_bytes
    return batch * sum(p + buffer for p in per_head)


# --------------------------------------------------------------------------- head priority


def head_priority(x: torch.Tensor) -> torch.Tensor:
    """TurboAttention eq. 11: ``priority^(h) = gap^(h) × std^(h)`` of a layer's K or V.

    ``gap`` = max − min over every value of the head; ``std`` = standard deviation (population,
    ``correction=0``; a constant factor for fixed ``D``, so the ranking is the same) of the ``D``
    channel gaps, each ``max − min`` over the tokens (and the batch) of one channel.

    Args:
        x: calibration activations ``(B, Hkv, N, D)``.

    Returns:
        float32 ``(Hkv,)``.
    """
    xf = x.to(torch.float32).transpose(0, 1).flatten(1, 2)  # (Hkv, B·N, D)
    channel_gap = xf.amax(dim=1) - xf.amin(dim=1)  # (Hkv, D)
    gap = xf.amax(dim=(1, 2)) - xf.amin(dim=(1, 2))
    return gap * channel_gap.std(dim=-1, correction=0)


def two_bit_head_count(n_h: int | float, n_heads: int) -> int:
    """``n_h`` as a head count: an int is a count, a float in ``[0, 1]`` a fraction (rounded half up)."""
    if isinstance(n_h, bool) or not isinstance(n_h, (int, float)):
        raise TypeError(f"n_h must be an int count or a float fraction, got {n_h!r}")
    count = n_h if isinstance(n_h, int) else math.floor(n_h * n_heads + 0.5)
    if not 0 <= count <= n_heads:
        raise ValueError(f"n_h={n_h!r} selects {count} of {n_heads} heads")
    return count


def select_two_bit_heads(priority: torch.Tensor, n_h: int | float) -> torch.Tensor:
    """TurboAttention eq. 12: indices (ascending) of the ``n_h`` lowest-priority heads.

    Ties go to the lower head index. ``n_h``: a count, or a float fraction of the heads.
    """
    count = two_bit_head_count(n_h, priority.numel())
    order = torch.sort(priority.detach().flatten().cpu(), stable=True).indices
    return torch.sort(order[:count]).values


def head_bits(priority: torch.Tensor, n_h: int | float, *, bits: int = 4, low_bits: int = 2) -> tuple[int, ...]:
    """Per-head code widths: ``low_bits`` for :func:`select_two_bit_heads`, ``bits`` for the rest.

    K and V are ranked separately (each by its own priority): they are separate tensors with
    separate codes, and TurboAttention Fig. 7b selects "0 to 16 heads" of LLaMA-3-8B's 8 KV heads,
    i.e. K heads and V heads are chosen independently. A joint K+V ranking is
    ``select_two_bit_heads(torch.cat([p_k, p_v]), ...)``.
    """
    low = set(select_two_bit_heads(priority, n_h).tolist())
    return tuple(low_bits if h in low else bits for h in range(priority.numel()))


# --------------------------------------------------------------------------- decode


def decode_attention_config() -> AttentionConfig:
    """The ``turbo`` attention numerics with Q quantized per token (Algorithm 2: ``s_Q = absmax(q) / 119``)."""
    return get_mode("turbo").attention.replace(qk_granularity="token")


def turbo_decode_attention_ref(
    q: torch.Tensor,
    k_cache: CompressedKV,
    v_cache: CompressedKV,
    *,
    k_buffer: Int8Buffer | None = None,
    v_buffer: Int8Buffer | None = None,
    cfg: AttentionConfig | None = None,
    is_causal: bool = True,
    scale: float | None = None,
    return_lse: bool = False,
    compute_dtype: torch.dtype = torch.float32,
):
    """Attention of a few query tokens over the compressed cache (TurboAttention Algorithm 2).

    ``S_j = s_Q · s_{K_j} · Q^{q1} K_j^{q1}ᵀ``, ``P̃_j = SAS(S_j − m_j)``, P̃ INT8 per tile
    (``max / 119``), ``O_j = α O_{j−1} + s_P̃ · s_{V_j} · Q(P̃_j) V_j^{q1}``, with ``K^{q1}``/``V^{q1}``
    from :func:`turbo_decompress_kv_ref` and the numerics of ``cfg`` (default
    :func:`decode_attention_config`) through ``quant_attention_ref``.

    The V scale is one per block (and one for the buffer), so each ``cfg.block_k`` key tile sees
    a single V scale only if ``block_k`` divides the cache block; that is checked here because
    ``QuantAttention`` takes the V scale of a tile from its first token.

    Args:
        q: ``(B, H, Nq, D)``, the newest ``Nq`` tokens, already appended to the cache.
        k_cache / v_cache: compressed blocks ``(B, Hkv, ·)``, ``H % Hkv == 0``.
        k_buffer / v_buffer: the INT8 buffers (the most recent tokens), or None.
        is_causal: bottom-right causal mask among the query tokens (no-op for ``Nq = 1``).

    Returns:
        ``o (B, H, Nq, D)`` in ``compute_dtype`` (and ``lse (B, H, Nq)`` if asked).
    """
    cfg = decode_attention_config() if cfg is None else cfg
    for cache in (k_cache, v_cache):
        if cache.block % cfg.block_k:
            raise ValueError(f"cfg.block_k={cfg.block_k} must divide the cache block ({cache.block})")
    k_q = turbo_decompress_kv_ref(k_cache, k_buffer, dtype=compute_dtype)
    v_q = turbo_decompress_kv_ref(v_cache, v_buffer, dtype=compute_dtype)
    # k and v only supply shapes here (and K for smooth_q's ΔS, off in turbo): pass the dequantized cache.
    k, v = k_q[0] * k_q[1], v_q[0] * v_q[1]
    return quant_attention_ref(
        q,
        k,
        v,
        cfg,
        is_causal=is_causal,
        scale=scale,
        return_lse=return_lse,
        compute_dtype=compute_dtype,
        k_quantized=k_q,
        v_quantized=v_q,
    )
