"""GPU fast paths of the quantized attention modes, for :mod:`quantpatch.dispatch`.

Imported (with Triton) by ``dispatch.load_kernels``: from ``patch_model``, else on the first CUDA
call; the dispatcher registers :func:`call_unsupported` and :func:`run` as one implementation of each
numerics family in :data:`NUMERICS`. ``call_unsupported(call)`` names the first reason the kernels cannot
take a call (the caller then tries the reference, else falls back to SDPA with one warning).

Custom ops (``torch.library.custom_op`` + ``register_fake``, so ``torch.compile`` traces
through them; launched on the current stream):

* ``quantpatch::quantize_qkv``: fused smoothing + quantization
  (:func:`~quantpatch.kernels.attention.qk_quant_triton.quantize_qkv`), returns the 10 tensors of
  :class:`~quantpatch.kernels.attention.qk_quant_triton.QuantizedQKV`;
* ``quantpatch::attn_qk_int8_pv_fp8``: the attention kernel over them
  (:func:`~quantpatch.kernels.attention.quant_attn_triton.attn_qk_int8_pv_fp8`, or on sm_90 one of the Gluon
  kernels :func:`attention_kernel` picks).

Which path each mode takes: ``sage2-8b``/``sage2-4b`` (INT8 tensor cores, INT4 values for 4b),
``int8-flash``, ``fireq`` and ``turbo``'s prefill (SAS exponential, per-tile P scale, per-block V
scale) run these Triton kernels on sm_89/sm_90 (sm_80 for configs without FP8 operands). On sm_90, sage2-8b's,
int8-flash's and fireq's head_dim-64/128 calls from ``SM90_MIN_KEYS`` keys run the one-warpgroup Gluon kernel
(:mod:`~quantpatch.kernels.attention.one_warpgroup_gluon`: several programs an SM hide each other's latency), and
smooth-Q calls (sage2-4b) at head_dim 128 from ``GLUON_MIN_KEYS`` keys (causal: Nk - Nq a multiple of 128) the
warp-specialised ping-pong kernel (:mod:`~quantpatch.kernels.attention.pingpong_gluon`); the numerics are the same.
"""

from __future__ import annotations

import functools
import math

import torch
import triton

from quantpatch.config import AttentionConfig

from ..device import GluonGate, cuda_unsupported
from . import qk_quant_triton
from . import quant_attn_triton as _attn_triton
from .qk_quant_triton import GRAN_IDS, QuantizedQKV, quantize_qkv
from .quant_attention_ref import smooth_k_lse_shift
from .quant_attn_triton import SAS_THRESHOLD, attn_qk_int8_pv_fp8

NUMERICS = ("sage2", "int8_flash", "fireq", "turbo")  # the numerics families the kernels compute
HEAD_DIMS = (64, 128)
KEY_BLOCK = 128  # the attention kernel's key block; K/V are padded to a multiple of it
FP8_OPERANDS = ("fp8_e4m3",)
# the Gluon kernel from this many keys on, by (numerics, causal): where it ran faster than the Triton kernel, kernel
# only (H200; docs/performance.md).
# sage2: non-causal 1.04× at 2k, 0.94× at 1k; causal 1.09× at 4k, 1.00× at 2k. int8-flash: non-causal (the serial
# three-warpgroup schedule) 1.05 / 1.06 / 1.14 / 1.13× at 2k / 4k / 8k / 16k, 0.88× at 1k; causal 1.06×
# at 4k, 0.98× at 2k.
GLUON_MIN_KEYS = {("sage2", False): 2048, ("sage2", True): 4096, ("int8_flash", False): 2048,
                  ("int8_flash", True): 4096}
# the one-warpgroup sm_90 kernel from this many keys on, by causal: where it ran faster than the Triton kernel, kernel
# only (H200, B=4, H=32; D=128 1.02 / 1.26× cuDNN at 1k / 4k against 0.87 / 1.04×, causal 1.12× at 4k, 0.67× at 1k)
SM90_MIN_KEYS = {False: 1024, True: 4096}


# --------------------------------------------------------------------------- config mapping


def quant_options(cfg: AttentionConfig) -> dict:
    """Keyword arguments of ``quantize_qkv`` for an attention config."""
    return dict(
        qk_format=cfg.qk_format, qk_granularity=cfg.qk_granularity, qk_qmax=cfg.qk_qmax,
        smooth_q=cfg.smooth_q, smooth_k=cfg.smooth_k, smooth_v=cfg.smooth_v,
        pv_format=cfg.pv_format, pv_qmax=cfg.pv_qmax, v_granularity=cfg.v_granularity,
        block_q=cfg.block_q, block_k=cfg.block_k, warps=cfg.warps, pad_to=max(KEY_BLOCK, cfg.block_k),
    )


def kernel_blocks(cfg: AttentionConfig, head_dim: int) -> dict:
    """Tile sizes of the attention kernel (BLOCK_M must divide block_q for ΔS).

    64 query rows per program with one warpgroup and a 3-stage K/V pipeline measured fastest on
    an H200 (2 programs per SM overlap one's softmax with the other's MMAs; see
    docs/performance.md).
    """
    if cfg.exp == "sas":  # TurboAttention's P tile is block_q × block_k
        return dict(block_m=cfg.block_q, block_n=cfg.block_k, num_warps=4, num_stages=3)
    block_m = 64 if not cfg.smooth_q or cfg.block_q % 64 == 0 else cfg.block_q
    return dict(block_m=block_m, block_n=KEY_BLOCK, num_warps=4, num_stages=3)


def config_unsupported(cfg: AttentionConfig) -> str | None:
    """Why the Triton kernels cannot run ``cfg`` (None if they can)."""
    if cfg.exp == "sas":
        turbo = (cfg.qk_format == "int8" and cfg.pv_format == "int8" and cfg.v_granularity == "block"
                 and cfg.p_from_block_max and not cfg.smooth_q and not cfg.l_from_quantized_p)
        if not turbo:
            return ("SAS runs in the kernel only with TurboAttention's other steps (INT8 Q/K/V, per-block V, "
                    "per-tile P, no smooth Q, ℓ from P̃)")
        if cfg.sas_threshold != SAS_THRESHOLD:
            return f"sas_threshold={cfg.sas_threshold} (the kernels take n_r = {SAS_THRESHOLD})"
        if cfg.block_q not in (64, 128) or cfg.block_k not in (64, 128):
            return f"block_q={cfg.block_q}, block_k={cfg.block_k}: the turbo kernel's tiles take 64 or 128"
    elif cfg.p_from_block_max or cfg.v_granularity == "block":
        return "per-tile P scales and per-block V scales run in the kernel only with SAS (mode turbo)"
    if cfg.emulate_fp22:
        return "emulate_fp22 is a reference-only knob (the GPU accumulator is the real FP22)"
    if cfg.qk_format not in ("int8", "int4", "fp8_e4m3"):
        return f"qk_format={cfg.qk_format!r} not implemented by the kernels"
    if cfg.qk_granularity not in GRAN_IDS:
        return f"qk_granularity={cfg.qk_granularity!r} not implemented by the kernels"
    if cfg.pv_format not in ("fp8_e4m3", "int8"):
        return f"pv_format={cfg.pv_format!r} not implemented by the kernels"
    if cfg.smooth_v and cfg.v_granularity == "tensor":
        return "smooth_v with a per-tensor V scale is not implemented by the kernels"
    for name in ("block_q", "block_k"):
        blk = getattr(cfg, name)
        if blk < 16 or blk & (blk - 1):
            return f"{name}={blk} is not a power of two >= 16"
    if cfg.smooth_q and cfg.block_q < 64:
        return f"smooth_q needs block_q >= 64 (got {cfg.block_q})"
    if cfg.block_q * 128 > 128 * 128 * 2:
        return f"block_q={cfg.block_q} too large for one quantization tile"
    return None


_DEVICE_REASONS: dict[tuple[torch.device, bool], str | None] = {}


def _device_unsupported(q: torch.Tensor, fp8: bool) -> str | None:
    """Why ``q``'s device cannot run the kernels (with FP8 operands: sm_89+, else sm_80+); asked once per device,
    not on every call (a device's capability is a query of the driver)."""
    key = (q.device, fp8)
    if key not in _DEVICE_REASONS:
        _DEVICE_REASONS[key] = (cuda_unsupported(q, (8, 9), "FP8 operands") if fp8
                                else cuda_unsupported(q, (8, 0), "INT8 operands"))
    return _DEVICE_REASONS[key]


@functools.cache
def _config_checks(cfg: AttentionConfig) -> tuple[bool, str | None]:
    """Whether ``cfg`` has FP8 operands, and :func:`config_unsupported`: once per config, not on every call."""
    return cfg.qk_format in FP8_OPERANDS or cfg.pv_format in FP8_OPERANDS, config_unsupported(cfg)


def call_unsupported(call) -> str | None:
    """Why the Triton path cannot take ``call`` (a :class:`quantpatch.dispatch.AttentionCall`; None if it can)."""
    q, k, v = call.q, call.k, call.v
    fp8, config_reason = _config_checks(call.config)
    reason = _device_unsupported(q, fp8)
    if reason:
        return reason
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {q.dtype} (the kernels take float16 / bfloat16)"
    if q.shape[-1] not in HEAD_DIMS or v.shape[-1] != q.shape[-1]:
        return f"head_dim {q.shape[-1]} / value dim {v.shape[-1]} (the kernels take {HEAD_DIMS})"
    if call.attn_mask is not None:
        return "attn_mask is not supported by the kernels (is_causal is)"
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        return "head_dim is not the contiguous dimension"
    return config_reason


def _gluon_numerics(cfg: AttentionConfig) -> bool:
    """``cfg`` is one the Gluon kernel computes: sage2 (INT8/INT4-range Q·Kᵀ with per-thread groups the kernel reads
    as one δQ·δK a lane, ``block_q / warps`` a multiple of 16 and ``block_k`` of 64; FP8 P̃·V accumulated per block,
    per-channel V) or int8-flash (per-token INT8 Q/K, INT8 P̂·V, one V scale, ℓ from P̂), exact exp2."""
    if _attn_gluon is None or cfg.exp != "exact" or cfg.p_from_block_max or cfg.block_q % _attn_gluon.BLOCK_M:
        return False
    if cfg.numerics == "sage2":
        return (cfg.qk_format in ("int8", "int4") and cfg.qk_granularity == "thread"
                and (cfg.block_q // cfg.warps) % 16 == 0 and cfg.block_k % _attn_gluon.K_SPAN.value == 0
                and cfg.pv_format in FP8_OPERANDS and cfg.two_level_accum and not cfg.l_from_quantized_p
                and cfg.v_granularity == "channel")
    return (cfg.numerics == "int8_flash" and cfg.qk_format == "int8" and cfg.qk_granularity == "token"
            and cfg.pv_format == "int8" and cfg.v_granularity == "tensor" and cfg.l_from_quantized_p)


def gluon_takes(cfg: AttentionConfig, head_dim: int, nq: int, nk: int, is_causal: bool) -> bool:
    """Whether :func:`~quantpatch.kernels.attention.pingpong_gluon.attn_qk_int8_gluon` computes this call (on sm_90):
    numerics it has (sage2, int8-flash), head_dim 128, query blocks of a multiple of 128 rows, at least
    ``GLUON_MIN_KEYS[numerics, is_causal]`` keys, causal with Nk - Nq a multiple of 128 (the kernel's diagonal);
    False where the Gluon module does not import."""
    if not _gluon_numerics(cfg) or head_dim != 128:
        return False
    if is_causal and (nk - nq) % _attn_gluon.BLOCK_M:
        return False
    return nk >= GLUON_MIN_KEYS[cfg.numerics, is_causal]


def _fireq_numerics(cfg: AttentionConfig) -> bool:
    """``cfg`` is FireQ's prefill attention as the sm90 kernel computes it: e4m3 Q/K with per-token scales, e4m3 P̃·V
    with one V scale (one- or two-level), ℓ from the unquantized P̃, exact exp2."""
    return (cfg.numerics == "fireq" and cfg.qk_format == "fp8_e4m3" and cfg.qk_granularity == "token"
            and cfg.pv_format == "fp8_e4m3" and cfg.v_granularity == "tensor" and not cfg.l_from_quantized_p
            and not cfg.p_from_block_max and cfg.exp == "exact")


def sm90_takes(cfg: AttentionConfig, head_dim: int, nq: int, nk: int, is_causal: bool) -> bool:
    """Whether :func:`~quantpatch.kernels.attention.one_warpgroup_gluon.attn_qk_int8_pv_fp8_sm90` computes this call (on
    sm_90): the Gluon numerics or FireQ's, without smooth Q (sage2-8b, int8-flash, fireq), head_dim 64 or 128, at
    least ``SM90_MIN_KEYS[is_causal]`` keys (where it ran faster than the Triton kernel, kernel only, H200)."""
    return (_attn_sm90 is not None and (_gluon_numerics(cfg) or _fireq_numerics(cfg)) and not cfg.smooth_q
            and head_dim in _attn_sm90.HEAD_DIMS and nk >= SM90_MIN_KEYS[is_causal])


def attention_kernel(cfg: AttentionConfig, device: torch.device, head_dim: int, nq: int, nk: int,
                     is_causal: bool) -> str:
    """The kernel of a call: ``"sm90"`` (:func:`sm90_takes`), ``"gluon"`` (:func:`gluon_takes`: smooth Q), each on
    an sm_90 device where Gluon compiles (:data:`ATTENTION_GLUON`), else ``"triton"``. The Gluon kernels take
    operands quantized with ``v_key_order``."""
    if ATTENTION_GLUON.unsupported(device) is None:
        if sm90_takes(cfg, head_dim, nq, nk, is_causal):
            return "sm90"
        if gluon_takes(cfg, head_dim, nq, nk, is_causal):
            return "gluon"
    return "triton"


# --------------------------------------------------------------------------- custom ops


def _quantized_meta(q, k, *, qk_format, smooth_q, smooth_k, smooth_v, pv_format, v_granularity, block_q, block_k,
                    pad_to) -> list[torch.Tensor]:
    """Empty tensors shaped like :func:`quantize_qkv`'s outputs (for ``register_fake``)."""
    b, h, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    nk_pad = math.ceil(nk / pad_to) * pad_to
    nqb = math.ceil(nq / block_q)
    qk_dtype = torch.float8_e4m3fn if qk_format == "fp8_e4m3" else torch.int8
    v_dtype = torch.float8_e4m3fn if pv_format == "fp8_e4m3" else torch.int8

    def new(shape, dtype=torch.float32):
        return q.new_empty(shape, dtype=dtype)

    v_scale_shape = {"channel": (b, hkv, d), "tensor": (1,), "block": (b, hkv, nk_pad // block_k)}[v_granularity]
    return [
        new((b, h, nq, d), qk_dtype), new((b, h, nq)), new((b, h, nqb, d) if smooth_q else (0,)),
        new((b, hkv, nk_pad, d), qk_dtype), new((b, hkv, nk_pad)), new((b, hkv, d) if smooth_k else (0,)),
        new((b, h, nqb, nk_pad) if smooth_q else (0,)), new((b, hkv, d, nk_pad), v_dtype),
        new(v_scale_shape), new((b, hkv, d) if smooth_v else (0,)),
    ]


@torch.library.custom_op("quantpatch::quantize_qkv", mutates_args=())
def quantize_qkv_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qk_format: str, qk_granularity: str, qk_qmax: int,
    smooth_q: bool, smooth_k: bool, smooth_v: bool, pv_format: str, pv_qmax: int, v_granularity: str,
    block_q: int, block_k: int, warps: int, pad_to: int, v_key_order: bool = False, is_causal: bool = False,
) -> list[torch.Tensor]:
    """Custom-op form of :func:`quantize_qkv` (returns the fields of ``QuantizedQKV`` as a list)."""
    out = quantize_qkv(
        q, k, v, qk_format=qk_format, qk_granularity=qk_granularity, qk_qmax=qk_qmax, smooth_q=smooth_q,
        smooth_k=smooth_k, smooth_v=smooth_v, pv_format=pv_format, pv_qmax=pv_qmax, v_granularity=v_granularity,
        block_q=block_q, block_k=block_k, warps=warps, pad_to=pad_to, v_key_order=v_key_order, is_causal=is_causal,
    )
    return list(out)


@quantize_qkv_op.register_fake
def _(q, k, v, qk_format, qk_granularity, qk_qmax, smooth_q, smooth_k, smooth_v, pv_format, pv_qmax, v_granularity,
      block_q, block_k, warps, pad_to, v_key_order=False, is_causal=False):
    return _quantized_meta(q, k, qk_format=qk_format, smooth_q=smooth_q, smooth_k=smooth_k, smooth_v=smooth_v,
                           pv_format=pv_format, v_granularity=v_granularity, block_q=block_q, block_k=block_k,
                           pad_to=pad_to)


def _attend(
    q_hat: torch.Tensor, q_scale: torch.Tensor, q_mean: torch.Tensor, k_hat: torch.Tensor, k_scale: torch.Tensor,
    k_mean: torch.Tensor, delta_s: torch.Tensor, v_hat_t: torch.Tensor, v_scale: torch.Tensor, v_mean: torch.Tensor,
    nk: int, is_causal: bool, sm_scale: float, return_lse: bool, out_dtype: torch.dtype, block_q: int,
    l_from_quantized_p: bool, two_level_accum: bool, block_m: int, block_n: int, num_warps: int, num_stages: int,
    turbo: bool, p_qmax: int, kernel: str, qk_granularity: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attn_qk_int8_pv_fp8` over the fields of ``QuantizedQKV`` (the custom op's body); ``kernel`` (from
    :func:`attention_kernel`): ``"sm90"`` or ``"gluon"`` (operands quantized with ``v_key_order``) run the Gluon
    kernels, ``"triton"`` the Triton one."""
    x = QuantizedQKV(q_hat, q_scale, q_mean, k_hat, k_scale, k_mean, delta_s, v_hat_t, v_scale, v_mean)
    if kernel != "triton":
        try:
            if kernel == "sm90":
                return _attn_sm90.attn_qk_int8_pv_fp8_sm90(x, nk, qk_granularity=qk_granularity, is_causal=is_causal,
                                                           sm_scale=sm_scale, return_lse=return_lse,
                                                           out_dtype=out_dtype, two_level_accum=two_level_accum)
            return _attn_gluon.attn_qk_int8_gluon(x, nk, qk_granularity=qk_granularity, is_causal=is_causal,
                                                  sm_scale=sm_scale, return_lse=return_lse, out_dtype=out_dtype,
                                                  block_q=block_q, v_keys_permuted=v_hat_t)
        except triton.CompilationError as err:  # a Triton whose Gluon API differs: warn once, Triton serves
            ATTENTION_GLUON.close(q_hat.device, err)
            x = x._replace(v_hat_t=_attn_gluon.permute_v_keys(v_hat_t, inverse=True))
    return attn_qk_int8_pv_fp8(
        x, nk, is_causal=is_causal, sm_scale=sm_scale, return_lse=return_lse, out_dtype=out_dtype, block_q=block_q,
        l_from_quantized_p=l_from_quantized_p, two_level_accum=two_level_accum, block_m=block_m, block_n=block_n,
        num_warps=num_warps, num_stages=num_stages, turbo=turbo, p_qmax=p_qmax,
    )


attn_qk_int8_pv_fp8_op = torch.library.custom_op("quantpatch::attn_qk_int8_pv_fp8", _attend, mutates_args=())


@attn_qk_int8_pv_fp8_op.register_fake
def _(q_hat, q_scale, q_mean, k_hat, k_scale, k_mean, delta_s, v_hat_t, v_scale, v_mean, nk, is_causal, sm_scale,
      return_lse, out_dtype, block_q, l_from_quantized_p, two_level_accum, block_m, block_n, num_warps, num_stages,
      turbo, p_qmax, kernel, qk_granularity):
    b, h, nq, d = q_hat.shape
    lse_shape = (b, h, nq) if return_lse else (0,)
    return q_hat.new_empty((b, h, nq, d), dtype=out_dtype), q_hat.new_empty(lse_shape, dtype=torch.float32)


# --------------------------------------------------------------------------- the implementation


@functools.cache
def _prefill_static(cfg: AttentionConfig, head_dim: int, is_causal: bool, kernel: str) -> tuple[dict, dict]:
    """``quantize_qkv``'s keywords and :func:`kernel_blocks` of a call, made once per (config, head_dim, causal,
    kernel): a frozen config hashes in a fraction of a µs, less than building these."""
    return (quant_options(cfg) | dict(v_key_order=kernel != "triton", is_causal=is_causal),
            kernel_blocks(cfg, head_dim))


def prefill_options(cfg: AttentionConfig, device: torch.device, head_dim: int, nq: int, nk: int, *, is_causal: bool,
                    sm_scale: float, return_lse: bool, out_dtype: torch.dtype,
                    blocks: dict | None = None) -> tuple[dict, tuple]:
    """The arguments of a call's two custom ops: :func:`quantize_qkv_op`'s keywords (a shared dict: not to be
    changed), and :func:`attn_qk_int8_pv_fp8_op`'s options after the quantized tensors (the kernel
    :func:`attention_kernel` picks, else the Triton kernel with :func:`kernel_blocks`, or ``blocks`` where given)."""
    kernel = "triton" if blocks is not None else attention_kernel(cfg, device, head_dim, nq, nk, is_causal)
    quant_kw, kb = _prefill_static(cfg, head_dim, is_causal, kernel)
    if blocks is not None:
        kb = blocks
    options = (nk, is_causal, sm_scale, return_lse, out_dtype, cfg.block_q, cfg.l_from_quantized_p,
               cfg.two_level_accum, kb["block_m"], kb["block_n"], kb["num_warps"], kb["num_stages"],
               cfg.exp == "sas", cfg.pv_qmax, kernel, cfg.qk_granularity)
    return quant_kw, options


class Sm90Prefill:
    """The sm90 route (:func:`attention_kernel` ``"sm90"``) of one call signature, its host work cut to the
    outputs' allocations and the launches. The first call runs the general path (:func:`quantize_qkv`, :func:`_attend`),
    which makes the launch plans, and keeps its :class:`~quantpatch.kernels.attention.qk_quant_triton.QuantizePlan`
    and :class:`~quantpatch.kernels.attention.one_warpgroup_gluon.Sm90Launch`; later calls carve the quantized
    operands from one allocation and launch with their addresses (the same kernels on the same values: the same
    bits). Bound launches keep their kernels after ``LaunchPlans.clear``; where an unbound launch finds its plan gone
    (``LookupError``), the call takes the general path again."""

    def __init__(self, cfg: AttentionConfig, is_causal: bool, sm_scale: float):
        self.cfg, self.is_causal, self.sm_scale = cfg, is_causal, sm_scale
        self.quantize = self.attend = self.lse = None

    def _general(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        quant_kw, options = prefill_options(self.cfg, q.device, q.shape[-1], q.shape[2], k.shape[2],
                                            is_causal=self.is_causal, sm_scale=self.sm_scale, return_lse=False,
                                            out_dtype=q.dtype)
        plan = qk_quant_triton.QuantizePlan(q, k, v, **quant_kw)
        parts = plan.quantize(q, k, v)
        o, self.lse = _attend(*parts, *options)
        if ATTENTION_GLUON.unsupported(q.device) is None:  # the Gluon kernel ran: its plans are made
            self.quantize = plan
            self.attend = _attn_sm90.Sm90Launch(parts, k.shape[2],
                                                qk_granularity=self.cfg.qk_granularity, is_causal=self.is_causal,
                                                sm_scale=self.sm_scale, out_dtype=q.dtype,
                                                two_level_accum=self.cfg.two_level_accum)
            plan.bind(q.device.index)
            self.attend.bind(q.device.index)
        return o

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``o (B, H, Nq, D)`` and an empty LSE, for inputs of this plan's signature."""
        if self.attend is None:
            return self._general(q, k, v), self.lse
        plan = self.quantize
        device = q.device
        scratch = qk_quant_triton.stats_scratch(device, *plan.scratch_size)
        workspace, x = plan.carve(device)  # kept to the return: freed once the launches reading it are enqueued
        o = torch.empty(self.attend.out_shape, device=device, dtype=q.dtype)
        try:
            plan.launch(q, k, v, x, scratch)
            self.attend(x, o, self.lse, device=device.index)
        except LookupError:  # a launch plan was cleared: the general path makes it again
            self.attend = None
            return self._general(q, k, v), self.lse
        return o, self.lse


_SM90_PREFILLS: dict[tuple, Sm90Prefill | None] = {}
SM90_PREFILL_SIGNATURES = 256  # signatures kept (dynamic shapes would add one a length); past it, all are dropped


def _sm90_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: AttentionConfig, is_causal: bool,
                  sm_scale: float) -> Sm90Prefill | None:
    """The :class:`Sm90Prefill` of this call's signature (everything the route, the checks and the launches' plans
    follow from), or None where the call does not take the sm90 route or a head dim is not contiguous."""
    strides = q.stride(), k.stride(), v.stride()
    key = (cfg, q.shape, k.shape, v.shape, strides, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
           q.data_ptr() % 16, k.data_ptr() % 16, v.data_ptr() % 16, is_causal, sm_scale)
    try:
        return _SM90_PREFILLS[key]
    except KeyError:
        pass
    route = attention_kernel(cfg, q.device, q.shape[-1], q.shape[2], k.shape[2], is_causal)
    contiguous = all(s[-1] == 1 for s in strides)
    if len(_SM90_PREFILLS) >= SM90_PREFILL_SIGNATURES:
        _SM90_PREFILLS.clear()
    plan = _SM90_PREFILLS[key] = Sm90Prefill(cfg, is_causal, sm_scale) if route == "sm90" and contiguous else None
    return plan


def _sm_scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def _eager_sm90_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: AttentionConfig, is_causal: bool,
                        sm_scale: float, return_lse: bool, compiling: bool) -> Sm90Prefill | None:
    """The :class:`Sm90Prefill` that runs this call (eager, on CUDA, no LSE asked), or None."""
    if compiling or return_lse or q.device.type != "cuda":
        return None
    return _sm90_prefill(q, k, v, cfg, is_causal, sm_scale)


def quantized_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cfg: AttentionConfig,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
    blocks: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize then attend: through the two custom ops while ``torch.compile`` traces, by direct
    calls in eager mode (the same functions; the dispatcher's per-call cost is skipped).

    Args:
        q: ``(B, H, Nq, D)``; k, v: ``(B, Hkv, Nk, D)``, fp16/bf16, head_dim contiguous.
        cfg: numerics (must pass :func:`config_unsupported`).
        blocks: override of :func:`kernel_blocks` (benchmarks and tests): the Triton kernel with these tiles.

    Returns:
        ``o (B, H, Nq, D)`` in ``q``'s dtype, ``lse (B, H, Nq)`` float32 (empty unless asked).
    """
    compiling = torch.compiler.is_compiling()
    sm_scale = _sm_scale(q, scale)
    if blocks is None:
        prefill = _eager_sm90_prefill(q, k, v, cfg, is_causal, sm_scale, return_lse, compiling)
        if prefill is not None:
            return prefill(q, k, v)
    quantize = quantize_qkv_op if compiling else quantize_qkv
    quant_kw, options = prefill_options(cfg, q.device, q.shape[-1], q.shape[2], k.shape[2], is_causal=is_causal,
                                        sm_scale=sm_scale, return_lse=return_lse, out_dtype=q.dtype, blocks=blocks)
    parts = quantize(q, k, v, **quant_kw)
    attend = attn_qk_int8_pv_fp8_op if compiling else _attend
    o, lse = attend(*parts, *options)
    if return_lse and cfg.smooth_k:  # the kernel's LSE is that of the K-smoothed scores
        lse = lse + sm_scale * smooth_k_lse_shift(q.float(), parts[5])
    return o, lse


DELTA_S_LIMIT = 2**31  # smooth Q's ΔS (B, H, ⌈Nq / block_q⌉, Nk_pad) is read through 32-bit TMA coordinates
# ΔS entries (float32) a slice may hold where more than one head fits: 1 GiB, so that one call's extra memory stays
# near its output plus one quantized copy of Q, K and V (B=4, H=32, 32k tokens, D=128: ΔS alone would be 4 GiB)
DELTA_S_BUDGET = 2**28


def head_chunks(cfg: AttentionConfig, b: int, h: int, hkv: int, nq: int, nk: int) -> list[tuple[int, int, int, int]]:
    """``(b0, b1, h0, h1)`` slices of batch and query heads that each keep ΔS within :data:`DELTA_S_BUDGET` entries
    (or, where one head holds more, one head a slice under :data:`DELTA_S_LIMIT`); one slice for calls without smooth
    Q. Attention is independent per batch entry and per query head; a slice spans whole GQA groups, or part of one
    group."""
    if not cfg.smooth_q:
        return [(0, b, 0, h)]
    per_head = math.ceil(nq / cfg.block_q) * math.ceil(nk / KEY_BLOCK) * KEY_BLOCK
    if b * h * per_head <= DELTA_S_BUDGET:
        return [(0, b, 0, h)]
    if per_head >= DELTA_S_LIMIT:
        raise ValueError(f"smooth Q's ΔS of one head ({per_head} entries for Nq={nq}, Nk={nk}) exceeds 32-bit TMA "
                         "coordinates; use a mode without smooth Q (sage2-8b)")
    heads = max(DELTA_S_BUDGET // per_head, 1)
    if h <= heads:
        step = heads // h
        return [(i, min(i + step, b), 0, h) for i in range(0, b, step)]
    rep = h // hkv
    step = heads // rep * rep if heads >= rep else max(d for d in range(1, rep + 1) if rep % d == 0 and d <= heads)
    return [(i, i + 1, j, min(j + step, h)) for i in range(b) for j in range(0, h, step)]


def run(call):
    """The kernels on ``call`` (an ``AttentionCall`` that :func:`call_unsupported` accepts): ``o``, or ``(o, lse)``
    where it asks for the LSE; smooth-Q calls whose ΔS would pass its memory budget (or 32-bit TMA coordinates) in
    :func:`head_chunks` slices."""
    q, k, v = call.q, call.k, call.v
    chunks = head_chunks(call.config, q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2])
    if len(chunks) == 1:
        o, lse = quantized_attention(q, k, v, call.config, is_causal=call.is_causal, scale=call.scale,
                                     return_lse=call.return_lse)
        return (o, lse) if call.return_lse else o
    rep = q.shape[1] // k.shape[1]
    o = q.new_empty(q.shape)
    lse = q.new_empty(q.shape[:3], dtype=torch.float32) if call.return_lse else None
    for b0, b1, h0, h1 in chunks:
        hq, hkv = slice(h0, h1), slice(h0 // rep, (h1 - 1) // rep + 1)
        part, part_lse = quantized_attention(q[b0:b1, hq], k[b0:b1, hkv], v[b0:b1, hkv], call.config,
                                             is_causal=call.is_causal, scale=call.scale, return_lse=call.return_lse)
        o[b0:b1, hq] = part
        if lse is not None:
            lse[b0:b1, hq] = part_lse
    return (o, lse) if call.return_lse else o


def plan(call):
    """What :func:`run` launches for every call of ``call``'s signature, where that follows from the signature alone
    (``dispatch.Implementation.plan``): the sm90 route's :class:`Sm90Prefill` (eager, no mask, no LSE, one head
    slice); None elsewhere."""
    q, k = call.q, call.k
    if call.attn_mask is not None or len(head_chunks(call.config, q.shape[0], q.shape[1], k.shape[1], q.shape[2],
                                                      k.shape[2])) != 1:
        return None
    return _eager_sm90_prefill(q, k, call.v, call.config, call.is_causal, _sm_scale(q, call.scale), call.return_lse,
                               torch.compiler.is_compiling())


# last: the Gluon module needs Triton 3.6's triton.experimental.gluon
try:
    from . import one_warpgroup_gluon as _attn_sm90
    from . import pingpong_gluon as _attn_gluon

    _GLUON_IMPORT_ERROR = None
except ImportError as _err:
    _attn_gluon, _attn_sm90, _GLUON_IMPORT_ERROR = None, None, str(_err)
ATTENTION_GLUON = GluonGate("sage2 / int8-flash / fireq attention (head_dim 64, 128)", "the Triton attention kernel",
                            _GLUON_IMPORT_ERROR)
# the launch plans of the prefill path: quantization (3 launches), then the Triton or the Gluon attention kernel
PREFILL_PLANS = (qk_quant_triton._STATS_LAUNCH, qk_quant_triton._DELTA_S_LAUNCH, qk_quant_triton._KV_LAUNCH,
                 _attn_triton._ATTN_LAUNCH) + (() if _attn_gluon is None else (_attn_gluon._LAUNCH, _attn_sm90._LAUNCH))

__all__ = ["NUMERICS", "call_unsupported", "config_unsupported", "plan", "quantized_attention", "run"]
