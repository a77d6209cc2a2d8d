"""TurboAttention's compressed KV cache as a Transformers ``Cache`` (FlashQ, §3 and Appendix A).

:class:`TurboCache` holds one :class:`TurboLayer` per decoder layer. A layer keeps K and V as

* BPQ blocks of ``n_b = 64`` tokens: INT8 symmetric (``absmax / 119`` per block and head), then
  INT4 or INT2 asymmetric per channel with integer ``s^int`` / ``z^int``, packed 2 or 4 codes a byte
  (``turbo_ref.CompressedKV``), the width chosen per KV head (head-wise mixed precision);
* an INT8 buffer of the ``< n_b`` newest tokens with one universal scale per head, clamped to ±119
  (``turbo_ref.Int8Buffer``), compressed into a block when it fills.

The universal scale is fixed at prefill: ``max(headroom · absmax(prompt), calibrated absmax) / 119``
per (sequence, KV head). The paper takes it from the prompt; a short prompt then clamps later
tokens (pydoc-llama-21m, 20 prompts of ~12 tokens × 32 teacher-forced decode steps, SDPA over the
4-bit cache: mean KL to the fp32 cache 0.00044 with the prompt's absmax, 0.00018 with headroom 1.25,
0.00019 with the calibrated absmax alone; headroom 2 costs resolution in the blocks the buffer makes:
0.00050).

**Prefill** (the first ``update`` of a layer): the prompt's K/V are compressed (full blocks + the tail
into the buffer) and returned unchanged, so the prefill attention runs on the fresh K/V: under
``patch_model(model, "turbo")`` that is the paper's prefill (Algorithm 1: Q, K, V INT8 per 64-token
block, SAS, P INT8; the same INT8 K/V blocks the cache compresses further), under any other
attention plain full precision.

**Decode** (every later ``update``, one token or a chunk): the new tokens go to the INT8 buffer
(Algorithm 2 quantizes the generated K/V to INT8) and full buffers become blocks. Then

* if the layer's attention module is a quantpatch ``turbo`` site, ``update`` returns zero-storage
  placeholder tensors (NaN, stride 0, so a consumer that is not ours cannot silently read zeros) and
  publishes the cache; the patched attention function finds the layer by ``module.layer_idx``
  (:func:`turbo_layer_for`) and attends on the compressed blocks and the buffer directly
  (:func:`turbo_cache_attention`; Q per token ``absmax / 119``, SAS, P INT8 per 64-key tile). No float
  copy of the cache is kept (on CUDA the Triton decode kernel dequantizes to the INT8 grid in registers;
  the PyTorch reference, on CPU and for what the kernel declines, per call);
* otherwise (unpatched model, another mode, an excluded site) it returns the cache dequantized to the
  input dtype, as Transformers' own ``QuantizedCache`` does, so any attention stays correct.

**Kernel warm-up** (CUDA): a layer's prefill also compiles every kernel variant that its decode steps will launch
(:meth:`TurboLayer.warm_up`), so that no step of a generation compiles one: the compression of a full buffer, and
the decode kernels at the layer's length and at the lengths the generation grows through (one split, several; the
Triton kernel over the buffer alone, the Gluon one once a block exists).

Sliding-window, chunked and linear-attention layers are not supported (every layer is full attention).
Under Transformers tensor parallelism a rank's cache holds the rank's KV heads, with their slice of the per-head
widths (:mod:`~quantpatch.patches.transformers.tensor_parallel`).
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import inspect
import logging
import sys
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, ClassVar

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from quantpatch import routing
from quantpatch.config import AttentionConfig, KVCacheConfig, ModeConfig
from quantpatch.dispatch import (
    REFERENCE,
    TURBO_COMPRESS_MODULE,
    TURBO_DECODE_MODULE,
    Implementation,
    OpCall,
    Quiet,
    load_kernels,
    on_kernels_import,
    plan_epoch,
    preload_kernels,
    register,
    run_on_device,
    run_op,
    select,
)
from quantpatch.fallback import UnsupportedError
from quantpatch.head_precision import HeadPrecision, attention_modules, head_precision_of, kv_config_of
from quantpatch.kernels.attention.quant_attention_ref import quant_attention_ref
from quantpatch.kernels.quant_ref import symmetric_scale
from quantpatch.kernels.turbo_kv.turbo_ref import (
    CompressedKV,
    Int8Buffer,
    compress_int8_blocks,
    decode_attention_config,
    map_width_codes,
    per_head_bits,
    turbo_append_ref,
    turbo_compress_kv_ref,
    turbo_decompress_kv_ref,
)
from quantpatch.patches.transformers.tensor_parallel import kv_head_count, kv_head_range

logger = logging.getLogger("quantpatch")

# Attribute an AttentionInterface function sets to say it reads TurboLayers directly.
READS_TURBO_LAYERS = "_quantpatch_reads_turbo_layers"
# Attribute of a patched module holding its AttentionSite (defined here: attention.py imports this module).
SITE_ATTR = "_quantpatch_site"
BUFFER_HEADROOM = 1.25  # universal buffer scale = headroom × the prompt's absmax (see the module docstring)
WARM_DEVICES = ("cuda",)  # device types where a layer's prefill compiles its decode steps' kernels (TurboLayer.warm_up)
# What TurboLayer.warm_up compiled in this process: (the kernel variants' inputs: device, dtype, layout, ..., twin size)
_WARMED: set[tuple] = set()
# The TurboCache whose update ran last in this context (weakly held), for the attention function.
_ACTIVE_CACHE: contextvars.ContextVar[weakref.ref | None] = contextvars.ContextVar("quantpatch_turbo", default=None)


@dataclass(frozen=True)
class ModelKVShape:
    """What a cache must agree on with the model it serves.

    ``kv_heads`` counts the model's KV heads; ``heads`` are the model-wide indices of those this process's attention
    holds: all of them, or under tensor parallelism the rank's slice (:func:`kv_head_range`)."""

    name: str
    num_layers: int
    kv_heads: int
    head_dim: int
    heads: range

    @classmethod
    def of(cls, model: Any) -> ModelKVShape:
        config = getattr(model, "config", None)
        if config is None:
            raise TypeError(f"TurboCache needs a Transformers model (with .config), got {type(model).__name__}")
        config = config.get_text_config(decoder=True)
        if getattr(config, "is_encoder_decoder", False):
            raise ValueError("TurboCache supports decoder-only models; got an encoder-decoder config")
        kv_heads = kv_head_count(config)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        name = getattr(config, "_name_or_path", "") or type(model).__name__
        layer_types = getattr(config, "layer_types", None)
        if layer_types is None:  # older configs: one sliding window for every layer
            layer_types = ["sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"]
        others = sorted(set(layer_types) - {"full_attention"})
        if others:
            raise ValueError(f"TurboCache supports full-attention layers only; {name} has {others} layers")
        return cls(name, config.num_hidden_layers, kv_heads, head_dim, kv_head_range(model, kv_heads))

    def describe(self) -> str:
        held = "" if len(self.heads) == self.kv_heads else f" of which this rank holds {list(self.heads)}"
        return f"{self.name} ({self.num_layers} layers, {self.kv_heads} KV heads{held}, head_dim {self.head_dim})"


# --------------------------------------------------------------------------- head bits


LayerBits = tuple[tuple[int, ...], tuple[int, ...]]


def resolve_head_bits(
    head_bits: HeadPrecision | Sequence[Any] | dict | None, shape: ModelKVShape, kv: KVCacheConfig
) -> list[LayerBits]:
    """Per layer ``(k_bits, v_bits)``, each a tuple of widths of the KV heads ``shape.heads`` (this rank's).

    ``head_bits``: None (every head at ``kv.bits``; only when ``kv.two_bit_heads == 0``), a
    :class:`HeadPrecision` (or its ``to_dict()``), or one entry per layer: an int (every head), a
    sequence of per-head ints (K and V alike) or a mapping ``{"k": [...], "v": [...]}``; per-head
    entries give all ``shape.kv_heads`` of the model (tensor parallelism keeps the rank's slice).
    """
    if head_bits is None:
        if kv.two_bit_heads:
            raise ValueError(
                f"KVCacheConfig.two_bit_heads={kv.two_bit_heads} needs calibrated head_bits: run "
                "quantpatch.calibrate_head_precision(model, texts, tokenizer) and pass its result as head_bits "
                "(or use a config with two_bit_heads=0)"
            )
        row = (kv.bits,) * len(shape.heads)
        return [(row, row)] * shape.num_layers
    if isinstance(head_bits, dict):
        head_bits = HeadPrecision.from_dict(head_bits)
    if isinstance(head_bits, HeadPrecision):
        head_bits = [{"k": k, "v": v} for k, v in zip(head_bits.k_bits, head_bits.v_bits)]
    if isinstance(head_bits, (str, bytes)) or not isinstance(head_bits, Sequence):
        raise TypeError(f"head_bits must be a HeadPrecision or one entry per layer, got {type(head_bits).__name__}")
    if len(head_bits) != shape.num_layers:
        raise ValueError(f"head_bits has {len(head_bits)} layers but the model {shape.describe()} has "
                         f"{shape.num_layers}: head bits calibrated for another model?")
    out = []
    for i, entry in enumerate(head_bits):
        k, v = (entry["k"], entry["v"]) if isinstance(entry, dict) else (entry, entry)
        try:
            k, v = per_head_bits(k, shape.kv_heads), per_head_bits(v, shape.kv_heads)
        except ValueError as err:
            raise ValueError(f"head_bits of layer {i}: {err} (the model {shape.describe()})") from err
        out.append((tuple(k[h] for h in shape.heads), tuple(v[h] for h in shape.heads)))
    return out


# --------------------------------------------------------------------------- layer


def _map_batch(obj: CompressedKV | Int8Buffer | None, fn: Callable[[torch.Tensor], torch.Tensor]):
    """Apply ``fn`` to every tensor of a cache part along its batch dim (to each code width's heads at once, so that
    they stay views of one tensor: ``turbo_ref.map_width_codes``)."""
    if obj is None:
        return None
    if isinstance(obj, CompressedKV):
        return dataclasses.replace(
            obj,
            codes=map_width_codes(fn, obj),
            int_scale=fn(obj.int_scale),
            int_zero=fn(obj.int_zero),
            block_scale=fn(obj.block_scale),
        )
    return dataclasses.replace(obj, values=fn(obj.values), scale=fn(obj.scale))


class TurboLayer(CacheLayerMixin):
    """One decoder layer's compressed K and V (see the module docstring).

    Attributes:
        k_blocks / v_blocks: ``CompressedKV`` (B, Hkv, T blocks) or None before the first update.
        k_buffer / v_buffer: ``Int8Buffer`` (B, Hkv, < block tokens, D) or None.
        k_bits / v_bits: code width per KV head.
        headroom / k_absmax / v_absmax: the universal buffer scale is ``max(headroom · absmax(prompt),
            calibrated absmax) / qmax`` per KV head (``k_absmax``/``v_absmax``: ``Hkv`` floats or None).
        clamped: new-token values clamped by the universal buffer scale (K and V together), a health counter.
    """

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(
        self,
        kv_heads: int,
        head_dim: int,
        k_bits: int | Sequence[int] = 4,
        v_bits: int | Sequence[int] | None = None,
        *,
        block: int = 64,
        qmax: int = 119,
        layer_idx: int = 0,
        headroom: float = BUFFER_HEADROOM,
        k_absmax: Sequence[float] | None = None,
        v_absmax: Sequence[float] | None = None,
    ):
        super().__init__()
        self.kv_heads, self.head_dim, self.block, self.qmax, self.layer_idx = kv_heads, head_dim, block, qmax, layer_idx
        if headroom < 1:
            raise ValueError(f"headroom must be >= 1 (a smaller scale clamps the prompt itself), got {headroom}")
        self.headroom = float(headroom)
        self.absmax_floor = []
        for name, floor in (("k_absmax", k_absmax), ("v_absmax", v_absmax)):
            if floor is not None and len(floor) != kv_heads:
                raise ValueError(f"{name} has {len(floor)} entries for {kv_heads} KV heads")
            self.absmax_floor.append(None if floor is None else torch.tensor([float(a) for a in floor]))
        self.k_bits = per_head_bits(k_bits, kv_heads)
        self.v_bits = per_head_bits(k_bits if v_bits is None else v_bits, kv_heads)
        if head_dim % (8 // min(self.k_bits + self.v_bits, default=8)):
            raise ValueError(f"head_dim {head_dim} cannot be packed {8 // min(self.k_bits + self.v_bits)} codes a byte")
        self._clear()

    def _clear(self) -> None:
        self.k_blocks = self.v_blocks = None
        self.k_buffer = self.v_buffer = None
        self.cumulative_length = 0
        # int32 (1,) on the cache's device from the prefill on: counted there, no host sync per decode step
        self._clamped: torch.Tensor | int = 0
        self._placeholders: tuple[torch.Tensor, torch.Tensor] | None = None
        self._nan: torch.Tensor | None = None  # the one element the placeholders expand
        # (K blocks, V blocks, query layout, reason) of the decode kernel's last check (see _register_decode_kernels)
        self.decode_checked: tuple | None = None
        # (K blocks, V blocks, call key, run) of the decode kernel's planned call (see turbo_cache_attention)
        self.planned_decode: tuple | None = None
        self._append: Callable[[torch.Tensor, Int8Buffer], Int8Buffer] | None = None

    def __repr__(self) -> str:
        return (f"TurboLayer(layer {self.layer_idx}, {self.cumulative_length} tokens, K bits {list(self.k_bits)}, "
                f"V bits {list(self.v_bits)})")

    # -- CacheLayerMixin --------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch = key_states.shape[0]
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, direct: bool = False, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``key_states`` / ``value_states`` ``(B, Hkv, n, D)``; return what the attention gets.

        Returns the inputs themselves on the first call (prefill), then either placeholders
        (``direct=True``: the attention reads this layer) or the whole cache dequantized.
        """
        self._check(key_states, value_states)
        self._placeholders = None
        if not self.is_initialized or self.k_blocks is None:
            self.lazy_initialization(key_states, value_states)
            self.k_blocks, self.k_buffer = self._compress_prompt(key_states, self.k_bits, self.absmax_floor[0])
            self.v_blocks, self.v_buffer = self._compress_prompt(value_states, self.v_bits, self.absmax_floor[1])
            self.cumulative_length = key_states.shape[-2]
            self._clamped = torch.zeros(1, dtype=torch.int32, device=key_states.device)
            self._append = _buffer_appender(key_states, self._clamped, self.block)
            return key_states, value_states
        if (self._append is not None and self.k_buffer.n_tokens + key_states.shape[-2] < self.block
                and key_states.stride(-1) == 1 and value_states.stride(-1) == 1):
            self.k_buffer = self._append(key_states, self.k_buffer)  # counts its clamps on the device
            self.v_buffer = self._append(value_states, self.v_buffer)
        else:
            for x, buf in ((key_states, self.k_buffer), (value_states, self.v_buffer)):
                self._clamped.add_((torch.round(x.to(buf.scale.dtype) / buf.scale).abs() > buf.qmax).sum())
            self.k_blocks, self.k_buffer = _compress(TurboCompressCall(key_states, self.k_bits, self.block, self.qmax,
                                                                       self.k_blocks, self.k_buffer))
            self.v_blocks, self.v_buffer = _compress(TurboCompressCall(value_states, self.v_bits, self.block,
                                                                       self.qmax, self.v_blocks, self.v_buffer))
        self.cumulative_length += key_states.shape[-2]
        if direct:
            shape = (self.batch, self.kv_heads, self.cumulative_length, self.head_dim)
            if self._nan is None or self._nan.dtype != key_states.dtype or self._nan.device != key_states.device:
                self._nan = key_states.new_full((), float("nan"))
            self._placeholders = (self._nan.expand(*shape), self._nan.expand(*shape))
            return self._placeholders
        return self.dequantized(key_states.dtype)

    def warm_up(self, dtype: torch.dtype, group: int | None, cfg: AttentionConfig | None = None) -> None:
        """Compile now the kernel variants that this layer's decode steps will launch, so that none of them compiles
        one (:class:`TurboCache` calls this at a layer's prefill on CUDA).

        Decode steps over ``dtype`` states launch the compression kernel on each full buffer and, where the attention
        reads the layer (``group`` query heads per KV head, numerics ``cfg``; ``group`` None: it does not), the decode
        kernels, whose variant follows the cache's length (one split or several; the Triton kernel while no block
        exists, the Gluon one after). For each length that ``turbo_decode_triton.decode_variant_blocks`` names (the
        shortest of each variant met from this layer's length on), a twin of this layer is filled with zeros (that
        many blocks and ``block − 1`` buffered tokens), attended once by a zero query token and given one more token,
        which compresses a block as a decode step does; the twin is then dropped. The one-launch buffer append of the
        steps between (``_buffer_appender``) runs once on a zero token. Each (layout, length) is warmed once per
        process; what the kernels decline is left to the first decode step (and its warning).

        Cost, once per process and layout: the compiles that the decode steps would otherwise pay, plus one twin per
        length (on an H200 at most four lengths of at most 17 blocks for batches 1-128; three, of at most 8 blocks, for
        a 4-bit ``D = 128`` cache): a few small launches and their host work. Every other call: a few cache lookups
        (about 2 µs).
        """
        if self.k_blocks is None:
            raise ValueError(f"TurboCache layer {self.layer_idx} is empty: warm_up follows its prefill")
        load_kernels(TURBO_DECODE_MODULE)
        kernels = sys.modules.get(TURBO_DECODE_MODULE)
        if group is None or kernels is None:
            lengths: tuple[int, ...] = (0,)  # the compression alone
        else:
            lengths = kernels.decode_variant_blocks(self.batch, group, self.k_bits, self.v_bits, self.head_dim,
                                                    self.k_blocks.n_blocks, self.device)
        layout = (self.device, dtype, self.batch, self.kv_heads, self.head_dim, self.k_bits, self.v_bits, self.block,
                  self.qmax, group, cfg)
        for n_blocks in lengths:
            if (*layout, n_blocks) in _WARMED:
                continue
            twin = TurboLayer(self.kv_heads, self.head_dim, self.k_bits, self.v_bits, block=self.block, qmax=self.qmax)
            zeros = torch.zeros(self.batch, self.kv_heads, (n_blocks + 1) * self.block, self.head_dim, dtype=dtype,
                                device=self.device)
            twin.update(zeros[..., :-1, :], zeros[..., :-1, :])  # n_blocks blocks and block − 1 buffered tokens
            if group is not None:
                query = zeros.new_zeros((self.batch, self.kv_heads * group, 1, self.head_dim))
                call = TurboDecodeCall(query, twin, cache_attention_config(cfg, self.block), None, False, None, True)
                impl, _ = select("turbo_decode", "turbo", call)
                if impl.name != REFERENCE:
                    run_on_device(impl, call)
            twin.update(zeros[..., -1:, :], zeros[..., -1:, :], direct=True)  # the buffer fills: a block compressed
            _WARMED.add((*layout, n_blocks))

    @property
    def clamped(self) -> int:
        """New-token values the universal buffer scale clamped so far (K and V together)."""
        return int(self._clamped)

    def _compress_prompt(self, x: torch.Tensor, bits: tuple[int, ...], floor: torch.Tensor | None):
        absmax = x.to(torch.float32).abs().amax(dim=(-2, -1), keepdim=True) * self.headroom  # (B, Hkv, 1, 1)
        if floor is not None:
            absmax = torch.maximum(absmax, floor.to(absmax.device).view(1, -1, 1, 1))
        return _compress(TurboCompressCall(x, bits, self.block, self.qmax,
                                           buffer_scale=symmetric_scale(absmax, self.qmax)))

    def _check(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        for name, x in (("key", key_states), ("value", value_states)):
            if x.dim() != 4 or x.shape[1] != self.kv_heads or x.shape[-1] != self.head_dim:
                raise ValueError(
                    f"TurboCache layer {self.layer_idx} holds {self.kv_heads} KV heads of dim {self.head_dim}, got "
                    f"{name} states of shape {tuple(x.shape)} (B, Hkv, n, D): a cache built for one model cannot "
                    "serve another"
                )
        if key_states.shape != value_states.shape:
            raise ValueError(f"key {tuple(key_states.shape)} and value {tuple(value_states.shape)} states differ")
        if self.is_initialized and self.k_blocks is not None and key_states.shape[0] != self.batch:
            raise ValueError(f"TurboCache layer {self.layer_idx} holds batch {self.batch}, got {key_states.shape[0]}")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cumulative_length + query_length, 0

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self._clear()
        self.is_initialized = False

    def offload(self):
        raise NotImplementedError("TurboCache does not offload")

    def prefetch(self):
        raise NotImplementedError("TurboCache does not offload")

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise NotImplementedError("TurboCache cannot be cropped: compressed blocks cannot give tokens back")

    def _map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self.k_blocks is None:
            return
        self.k_blocks, self.v_blocks = _map_batch(self.k_blocks, fn), _map_batch(self.v_blocks, fn)
        self.k_buffer, self.v_buffer = _map_batch(self.k_buffer, fn), _map_batch(self.v_buffer, fn)
        self.batch = self.k_buffer.values.shape[0]
        self._placeholders = self.planned_decode = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices, ...])

    # -- reading ----------------------------------------------------------------------
    def returned_placeholders(self, key: torch.Tensor) -> bool:
        """Whether ``key`` is the placeholder this layer's last ``update`` returned."""
        ph = self._placeholders
        return ph is not None and (key is ph[0] or (key.data_ptr() == ph[0].data_ptr() and key.shape == ph[0].shape
                                                   and key.stride() == ph[0].stride()))

    def quantized(self, dtype: torch.dtype = torch.float32):
        """``(k_q, v_q)``: each ``(values, per-token scale)`` on the INT8 grid, ``turbo_decompress_kv_ref``."""
        if self.k_blocks is None:
            raise ValueError(f"TurboCache layer {self.layer_idx} is empty")
        return (turbo_decompress_kv_ref(self.k_blocks, self.k_buffer, dtype=dtype),
                turbo_decompress_kv_ref(self.v_blocks, self.v_buffer, dtype=dtype))

    def dequantized(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole cache as float ``(B, Hkv, N, D)`` K and V in ``dtype`` (a temporary copy, for other attentions)."""
        (kv, ks), (vv, vs) = self.quantized(torch.float32)
        return (kv * ks).to(dtype), (vv * vs).to(dtype)

    # -- memory -----------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes stored: packed codes, INT8 ``s^int``/``z^int``, block scales, buffer values and scales."""
        parts = (self.k_blocks, self.k_buffer, self.v_blocks, self.v_buffer)
        return sum(p.nbytes() for p in parts if p is not None)

    def bf16_nbytes(self) -> int:
        """Bytes the same K and V take in a bf16 ``DynamicLayer``."""
        if self.k_blocks is None:
            return 0
        return 2 * 2 * self.batch * self.kv_heads * self.cumulative_length * self.head_dim


# --------------------------------------------------------------------------- compression (op "turbo_compress")


@dataclass(frozen=True)
class TurboCompressCall(OpCall):
    """K or V states ``x (B, Hkv, n, D)`` into a layer's cache at ``bits`` per KV head: the prompt (``blocks`` None;
    full blocks of ``block`` tokens, the tail into an INT8 buffer of universal scale ``buffer_scale (B, Hkv, 1, 1)``)
    or decode tokens appended to ``blocks`` / ``buffer``."""

    LEAD: ClassVar[str] = "x"
    x: torch.Tensor
    bits: tuple[int, ...]
    block: int
    qmax: int
    blocks: CompressedKV | None = None
    buffer: Int8Buffer | None = None
    buffer_scale: torch.Tensor | None = None


def _compressed_with(call: TurboCompressCall, compress_blocks: Callable | None = None,
                     compress_int8: Callable = compress_int8_blocks) -> tuple[CompressedKV, Int8Buffer]:
    """``turbo_compress_kv_ref`` (prompt) or ``turbo_append_ref`` (decode) with the given block compressions."""
    if call.blocks is None:
        return turbo_compress_kv_ref(call.x, call.bits, block=call.block, qmax=call.qmax,
                                     buffer_scale=call.buffer_scale, compress_blocks=compress_blocks)
    return turbo_append_ref(call.blocks, call.buffer, call.x, compress_int8=compress_int8)


def _register_compress_kernels(kernels: ModuleType) -> None:
    """The Triton block compression (:mod:`quantpatch.kernels.turbo_kv.turbo_compress_triton`) as ``"triton"``."""

    def unsupported(call: TurboCompressCall) -> str | None:
        if not call.x.is_cuda:
            return Quiet("inputs are not CUDA tensors")
        return kernels.compress_unsupported(call.x, call.bits, call.block)

    def run(call: TurboCompressCall) -> tuple[CompressedKV, Int8Buffer]:
        return _compressed_with(call, kernels.turbo_compress_blocks, kernels.turbo_compress_int8_blocks)

    register("turbo_compress", "turbo", Implementation("triton", 10, unsupported, run))


register("turbo_compress", "turbo", Implementation(REFERENCE, 0, lambda call: None, _compressed_with))
on_kernels_import(TURBO_COMPRESS_MODULE, _register_compress_kernels)


def _buffer_appender(x: torch.Tensor, clamped: torch.Tensor,
                     block: int) -> Callable[[torch.Tensor, Int8Buffer], Int8Buffer] | None:
    """How a layer's decode steps append to its INT8 buffer while it stays short of a block, decided at its prefill
    on ``x`` (the prompt's K states): the compression kernels' one-launch append (``turbo_append_buffer``, clamps
    counted into ``clamped``) for CUDA states it takes, else None (the ``turbo_compress`` op and a count of the
    clamps, as on a block-filling step). Outside ``torch.compile`` only: a traced step takes the op."""
    if not x.is_cuda or torch.compiler.is_compiling():
        return None
    load_kernels(TURBO_COMPRESS_MODULE)
    kernels = sys.modules.get(TURBO_COMPRESS_MODULE)
    if kernels is None or kernels.append_unsupported(x, block) is not None:
        return None

    def append(new: torch.Tensor, buf: Int8Buffer) -> Int8Buffer:
        return kernels.turbo_append_buffer(new, buf, clamped, block=block,
                                           plan_key=(new.dtype, new.shape, new.stride(), new.data_ptr() % 16))

    return append


def _compress(call: TurboCompressCall) -> tuple[CompressedKV, Int8Buffer]:
    """The ``(CompressedKV, Int8Buffer)`` of ``call``: the Triton kernel for CUDA states, the reference on the CPU or,
    with one warning, where the kernel declines."""
    return run_op("turbo_compress", "turbo", call, what="TurboCache compression kernel")


# --------------------------------------------------------------------------- cache


@dataclass(frozen=True)
class KVMemory:
    """KV-cache bytes of a :class:`TurboCache` next to a bf16 cache of the same tokens."""

    nbytes: int
    bf16_nbytes: int
    tokens: int

    @property
    def ratio(self) -> float:
        """How many times smaller than bf16."""
        return self.bf16_nbytes / self.nbytes if self.nbytes else float("nan")

    def __str__(self) -> str:
        return (f"KV cache {self.nbytes / 2**20:.3f} MiB for {self.tokens} tokens vs bf16 "
                f"{self.bf16_nbytes / 2**20:.3f} MiB: {self.ratio:.2f}x smaller")


def _reads_directly(module: Any) -> bool:
    """Whether ``module``'s attention is quantpatch's, in a ``turbo`` configuration, and active."""
    from transformers import AttentionInterface

    site = getattr(module, SITE_ATTR, None)
    if site is None or site.config is None or site.config.numerics != "turbo":
        return False
    impl = getattr(getattr(module, "config", None), "_attn_implementation", None)
    return bool(getattr(AttentionInterface._global_mapping.get(impl), READS_TURBO_LAYERS, False))


class TurboCache(Cache):
    """TurboAttention's compressed KV cache for a decoder-only Transformers model.

    Usage::

        cache = quantpatch.TurboCache(model)                         # every head 4-bit
        hp = quantpatch.calibrate_head_precision(model, texts, tok)  # 2-bit for half the heads
        cache = quantpatch.TurboCache(model, config="turbo", head_bits=hp)
        model.generate(**inputs, past_key_values=cache)

    Args:
        model: the model the cache serves; its layer count, KV heads and head_dim are checked on
            every update, and its attention modules tell whether the attention reads the cache directly.
        config: ``KVCacheConfig`` (kind ``turbo``), ``ModeConfig`` or mode name; default 4-bit, n_b = 64.
        head_bits: per-layer per-KV-head widths (see :func:`resolve_head_bits`); needed when
            ``config.two_bit_heads > 0``. A :class:`HeadPrecision` with calibrated absmax also sets the
            floor of the buffer's universal scale.
        buffer_headroom: the universal buffer scale is at least ``buffer_headroom`` × the prompt's absmax.

    On CUDA each layer's first update (the prefill) also compiles the kernel variants that its decode steps will launch
    (:meth:`TurboLayer.warm_up`: once per process and layout, on zero-filled twins of a few blocks), so that the
    compiles happen in the first forward, not in the middle of the generation.
    """

    def __init__(
        self,
        model: Any,
        config: KVCacheConfig | ModeConfig | str | None = None,
        head_bits: HeadPrecision | Sequence[Any] | dict | None = None,
        *,
        buffer_headroom: float = BUFFER_HEADROOM,
    ):
        kv = KVCacheConfig(kind="turbo", two_bit_heads=0) if config is None else kv_config_of(config)
        self.kv_config = kv
        self.shape = ModelKVShape.of(model)
        if isinstance(head_bits, dict):
            head_bits = HeadPrecision.from_dict(head_bits)
        self.head_bits = resolve_head_bits(head_bits, self.shape, kv)
        absmax = [(None, None)] * self.shape.num_layers
        if isinstance(head_bits, HeadPrecision) and head_bits.k_absmax:
            heads = self.shape.heads
            absmax = [([k[h] for h in heads], [v[h] for h in heads])
                      for k, v in zip(head_bits.k_absmax, head_bits.v_absmax)]
        self._model = weakref.ref(model)
        self._modules = {i: weakref.ref(m) for i, (_, m) in attention_modules(model).items()}
        layers = [
            TurboLayer(len(self.shape.heads), self.shape.head_dim, k, v, block=kv.buffer_tokens, qmax=kv.int8_qmax,
                       layer_idx=i, headroom=buffer_headroom, k_absmax=absmax[i][0], v_absmax=absmax[i][1])
            for i, (k, v) in enumerate(self.head_bits)
        ]
        super().__init__(layers=layers)
        preload_kernels()  # a first generate() under torch.compile would otherwise import them inside the trace

    def __repr__(self) -> str:
        return f"TurboCache({self.shape.describe()}, {self.get_seq_length()} tokens)"

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= layer_idx < len(self.layers):
            raise ValueError(f"layer_idx {layer_idx} is out of range for a TurboCache built for "
                             f"{self.shape.describe()}: a cache built for one model cannot serve another")
        module = self._modules.get(layer_idx)
        module = module() if module is not None else None
        direct = module is not None and _reads_directly(module)
        _ACTIVE_CACHE.set(weakref.ref(self))
        layer = self.layers[layer_idx]
        filling = layer.k_blocks is None
        out = layer.update(key_states, value_states, direct=direct)
        if filling and key_states.device.type in WARM_DEVICES and not torch.compiler.is_compiling():
            site_config = getattr(module, SITE_ATTR).config if direct else None
            layer.warm_up(key_states.dtype, module.num_key_value_groups if direct else None, site_config)
        return out

    def check_model(self, model: Any) -> None:
        """Raise ``ValueError`` unless this cache was built for ``model``."""
        if self._model() is not model:
            other = ModelKVShape.of(model).describe() if getattr(model, "config", None) is not None else repr(model)
            raise ValueError(f"this TurboCache was built for {self.shape.describe()}, not for {other}; build one "
                             "TurboCache per model")

    def check_module(self, layer_idx: int, module: Any) -> None:
        """Raise ``ValueError`` unless ``module`` is this cache's model's attention of layer ``layer_idx``."""
        ref = self._modules.get(layer_idx)
        if ref is None or ref() is not module:
            raise ValueError(f"layer {layer_idx} of this TurboCache belongs to {self.shape.describe()}, but an "
                             f"attention module of another model ({type(module).__name__}) read it: build one "
                             "TurboCache per model")

    def memory(self) -> KVMemory:
        """Bytes stored (scales and zero points included) vs a bf16 cache of the same tokens."""
        return KVMemory(sum(layer.nbytes() for layer in self.layers),
                        sum(layer.bf16_nbytes() for layer in self.layers), self.get_seq_length())

    def report(self) -> str:
        """Memory, head widths and clamping per layer."""
        lines = [f"TurboCache for {self.shape.describe()}: {self.memory()}"]
        for layer in self.layers:
            lines.append(f"  layer {layer.layer_idx:>2}: K bits {list(layer.k_bits)}, V bits {list(layer.v_bits)}, "
                         f"{layer.nbytes()} bytes, {layer.clamped} values clamped by the buffer scale")
        return "\n".join(lines)


# --------------------------------------------------------------------------- attention


def turbo_layer_for(module: Any, key: torch.Tensor) -> TurboLayer | None:
    """The :class:`TurboLayer` whose placeholders ``key`` is (found by ``module.layer_idx``), else None.

    Raises ``ValueError`` when the layer belongs to another model's cache.
    """
    if any(key.stride()):  # not a placeholder (those have stride 0): no ContextVar read, which dynamo cannot trace
        return None
    ref = _ACTIVE_CACHE.get()
    cache = ref() if ref is not None else None
    idx = getattr(module, "layer_idx", None)
    if cache is None or not isinstance(idx, int) or not 0 <= idx < len(cache.layers):
        return None
    layer = cache.layers[idx]
    if not layer.returned_placeholders(key):
        return None
    cache.check_module(idx, module)
    return layer


@functools.lru_cache(maxsize=64)
def cache_attention_config(cfg: AttentionConfig | None, block: int) -> AttentionConfig:
    """The site's ``turbo`` numerics with Q quantized per token (Algorithm 2), checked against the cache block
    (cached: every decode step of every layer asks)."""
    cfg = decode_attention_config() if cfg is None else cfg.replace(qk_granularity="token")
    if block % cfg.block_k:
        raise ValueError(f"attention block_k={cfg.block_k} must divide the cache block n_b={block}: a key tile "
                         "has to carry one V scale")
    return cfg


@dataclass(frozen=True)
class TurboDecodeCall(OpCall):
    """``query (B, H, Nq, D)`` over ``layer``'s compressed K/V (:func:`turbo_cache_attention`'s arguments, ``cfg``
    checked); ``use_kernel`` False: the reference only."""

    LEAD: ClassVar[str] = "query"
    query: torch.Tensor
    layer: TurboLayer
    cfg: AttentionConfig
    attn_mask: torch.Tensor | None
    is_causal: bool
    scale: float | None
    use_kernel: bool


def _decode_reference(call: TurboDecodeCall) -> torch.Tensor:
    """``quant_attention_ref`` on the layer read on the INT8 grid (one float copy per call)."""
    query, cfg = call.query, call.cfg
    k_q, v_q = call.layer.quantized(torch.float32)
    # k only supplies shapes, and K itself to smooth_q's ΔS (off in turbo): skip the float copy otherwise.
    k = k_q[0] * k_q[1] if cfg.smooth_q else k_q[0]
    out = quant_attention_ref(query, k, v_q[0], cfg, is_causal=call.is_causal and query.shape[-2] > 1,
                              scale=call.scale, attn_mask=call.attn_mask, k_quantized=k_q, v_quantized=v_q)
    return out.to(query.dtype)


def _register_decode_kernels(kernels: ModuleType) -> None:
    """The decode kernel (:mod:`quantpatch.kernels.turbo_kv.turbo_decode_triton`: Triton, Gluon on sm_90 for the
    code-width groups it takes, ``kernel="auto"``) as ``"triton"``."""

    def parts(call: TurboDecodeCall) -> tuple:
        layer = call.layer
        return layer.k_blocks, layer.v_blocks, layer.k_buffer, layer.v_buffer

    def unsupported(call: TurboDecodeCall) -> str | None:
        if not call.use_kernel:
            return Quiet("use_kernel=False")
        if not call.query.is_cuda:
            return Quiet("inputs are not CUDA tensors")
        if call.attn_mask is not None:
            return "attn_mask"
        # checked once per (compressed blocks, query layout, numerics): the blocks change only when a buffer fills
        # or the batch is mapped, and update() keeps both buffers short of a block and the cache non-empty
        layer, query = call.layer, call.query
        key = (query.shape, query.dtype, call.cfg)
        checked = layer.decode_checked
        if checked is not None and checked[0] is layer.k_blocks and checked[1] is layer.v_blocks and checked[2] == key:
            return checked[3]
        reason = kernels.decode_unsupported(query, *parts(call), call.cfg)
        layer.decode_checked = (layer.k_blocks, layer.v_blocks, key, reason)
        return reason

    def run(call: TurboDecodeCall) -> torch.Tensor:
        layer, query = call.layer, call.query
        if type(query) is not torch.Tensor or torch.compiler.is_compiling():
            return kernels.turbo_decode_attention(query, *parts(call), cfg=call.cfg, is_causal=call.is_causal,
                                                  scale=call.scale, check=False)
        planned = kernels.decode_plan(query, layer.k_blocks, layer.v_blocks, cfg=call.cfg, is_causal=call.is_causal,
                                      scale=call.scale)
        layer.planned_decode = (layer.k_blocks, layer.v_blocks, _plan_key(call), planned)
        return planned(query, layer.k_buffer, layer.v_buffer)

    register("turbo_decode", "turbo", Implementation("triton", 10, unsupported, run))


register("turbo_decode", "turbo", Implementation(REFERENCE, 0, lambda call: None, _decode_reference))
on_kernels_import(TURBO_DECODE_MODULE, _register_decode_kernels)


def _plan_key(call: TurboDecodeCall) -> tuple:
    """What a layer's planned decode call must share with the call it was planned on, beyond the layer's blocks."""
    query = call.query
    return (query.shape, query.dtype, query.device, call.cfg, call.is_causal, call.scale, plan_epoch())


def turbo_cache_attention(
    query: torch.Tensor,
    layer: TurboLayer,
    *,
    cfg: AttentionConfig | None = None,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = True,
    scale: float | None = None,
    use_kernel: bool | None = None,
) -> torch.Tensor:
    """Attention of ``query (B, H, Nq, D)`` over a compressed layer (TurboAttention Algorithm 2).

    The layer already holds the ``Nq`` query tokens' K/V (in its buffer or blocks). Keys and values
    are read on the INT8 grid (``(X^{q2} + z^int)·s^int`` per block, the buffer as stored), Q is INT8 per
    token (``absmax / 119``), scores go through SAS and P̃ is INT8 per 64-key tile, through
    ``quant_attention_ref`` with ``k_quantized`` / ``v_quantized``. ``is_causal``: bottom-right among the
    query tokens; ``attn_mask``: bool or additive, broadcastable to ``(B, H, Nq, N)``.

    On CUDA the Triton decode kernel (``kernels/turbo_kv/turbo_decode_triton.py``) reads the packed codes, the
    integer scales and the buffer in place. Its launches over a layer's blocks are planned once (the kernel module's
    ``decode_plan``, kept as the layer's ``planned_decode``): the later steps until the next block is compressed run
    them with no dispatch and no checks, for a query of the same shape, dtype, device and options. What the kernel
    does not take (an ``attn_mask``, head_dim outside {64, 128}, ``Nq > 16``, other numerics) runs this reference,
    with one warning. ``use_kernel``: None = on CUDA, False = always the reference (benchmarks).

    Returns:
        ``(B, H, Nq, D)`` in ``query``'s dtype.
    """
    cfg = cache_attention_config(cfg, layer.block)
    call = TurboDecodeCall(query, layer, cfg, attn_mask, is_causal, scale, use_kernel is not False)
    planned = layer.planned_decode
    # the compile test first: a torch.compile trace takes the op (its custom op), with no guard on the plan
    if (not torch.compiler.is_compiling() and planned is not None and attn_mask is None and use_kernel is not False
            and planned[0] is layer.k_blocks and planned[1] is layer.v_blocks and type(query) is torch.Tensor
            and planned[2] == _plan_key(call)
            and (not query.is_cuda or query.device.index == torch.cuda.current_device())):
        return planned[3](query, layer.k_buffer, layer.v_buffer)
    return run_op("turbo_decode", "turbo", call, what="TurboCache decode kernel")


# --------------------------------------------------------------------------- generate hook


def planned_kv_tokens(args: tuple, kwargs: dict, gen_config: Any) -> tuple[int, int]:
    """``(sequences, tokens a sequence)`` that a ``generate(*args, **kwargs)`` call's cache will hold: the prompt's
    batch (times the beams, or the returned sequences when sampling) and its length plus the new tokens
    (``max_new_tokens``, else ``max_length``)."""
    ids = kwargs.get("input_ids", kwargs.get("inputs", args[0] if args else None))
    if ids is None:
        ids = kwargs.get("inputs_embeds")
    batch, prompt = (ids.shape[0], ids.shape[1]) if isinstance(ids, torch.Tensor) and ids.dim() >= 2 else (1, 1)

    def option(name: str, default: Any) -> Any:
        value = kwargs.get(name, getattr(gen_config, name, None))
        return default if value is None else value

    beams = option("num_beams", 1)
    sequences = batch * (beams if beams > 1 else option("num_return_sequences", 1))
    new = option("max_new_tokens", None)
    return sequences, prompt + new if new is not None else max(option("max_length", 20), prompt)


def _turbo_cache_slower(model: Any, args: tuple, kwargs: dict, gen_config: Any) -> str | None:
    """Why a ``generate()`` call should keep the model's own cache under ``policy="speed"`` (its batch × context
    is below where the turbo cache measured faster on this device, :func:`quantpatch.routing.turbo_cache_crossover`),
    or None where the TurboCache pays."""
    device = next(model.parameters()).device
    crossover, source = routing.turbo_cache_crossover(device)
    if crossover is None:
        return f"the turbo cache was not faster at any measured size ({source})"
    sequences, tokens = planned_kv_tokens(args, kwargs, gen_config)
    if sequences * tokens < crossover:
        return f"{sequences} × {tokens} KV tokens a layer, under the crossover of {crossover} ({source})"
    return None


def install_generate_hook(
    model: Any,
    handle: Any,
    config: KVCacheConfig,
    head_bits: HeadPrecision | Sequence[Any] | None = None,
    *,
    strict: bool = False,
) -> None:
    """Make ``model.generate`` build a :class:`TurboCache` when the caller passes no cache; under
    ``handle.policy == "speed"`` only where the call's batch × context passes the turbo-cache crossover (the
    handle's ``generate`` site counts each call's choice and why).

    Per instance: ``model.generate`` is shadowed through ``handle.setattr``, so ``handle.remove()``
    restores it. The cache goes in through ``generate``'s official cache argument (``cache``, or
    ``past_key_values`` before Transformers deprecated it); an explicit cache, ``cache_implementation``
    or ``use_cache=False`` is left alone (a
    TurboCache built for another model raises). ``head_bits`` default: the widths a
    ``convert(mode="turbo")`` or a loaded turbo checkpoint left on the model; without any, every head
    is stored in ``config.bits`` and the handle's remarks say so. A model the cache cannot serve
    (encoder-decoder, sliding-window layers, no ``generate``) keeps its own cache, with a note (an
    error under ``strict``).
    """
    if head_bits is None:
        head_bits = head_precision_of(model)
    if config.two_bit_heads and head_bits is None:
        config = config.replace(two_bit_heads=0)
        what = f"every KV head at {config.bits} bits (no calibrated head bits: calibrate_head_precision picks them)"
    else:
        what = "calibrated head bits" if head_bits is not None else f"every KV head at {config.bits} bits"
    try:
        if not callable(getattr(model, "generate", None)):
            raise ValueError(f"{type(model).__name__} has no generate()")
        TurboCache(model, config, head_bits)  # validate now rather than at the first generate()
    except ValueError as err:
        message = f"KV cache: TurboCache not installed: {err}"
        if strict:
            raise UnsupportedError(message + " (strict=True)") from err
        handle.remarks.append(message + "; generate() keeps the model's own cache")
        logger.warning(message)
        return
    handle.remarks.append(f"KV cache: generate() uses a TurboCache, {what}"
                          + (" where batch × context passes the turbo-cache crossover" if handle.policy == "speed"
                             else ""))
    record = handle.add_site("generate", "kv cache", f"TurboCache ({what})")
    original = model.generate
    # the cache argument's name: ``cache`` from Transformers 5.2x on (``past_key_values`` deprecated), before it
    # ``past_key_values``
    argument = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def generate(*args: Any, **kwargs: Any):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        gen_config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
        wants_cache = kwargs.get("use_cache", getattr(gen_config, "use_cache", True)) is not False
        chosen = kwargs.get("cache_implementation") or getattr(gen_config, "cache_implementation", None)
        if isinstance(cache, TurboCache):
            cache.check_model(model)
        elif cache is None and wants_cache and chosen is None:
            slower = _turbo_cache_slower(model, args, kwargs, gen_config) if handle.policy == "speed" else None
            if slower is None:
                kwargs[argument] = TurboCache(model, config, head_bits)
                record.count("turbo cache")
            else:
                record.count("model's own cache: " + slower)
        return original(*args, **kwargs)

    generate.__doc__ = original.__doc__
    handle.setattr(model, "generate", generate)
