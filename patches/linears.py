"""FP8 linear layers for ``patch_model(..., linear="fp8")``, for Transformers and Diffusers models alike.

Which linears: every plain ``nn.Linear`` of a transformer block, a block being the ``nn.ModuleList`` element
that holds an attention site the library patcher recorded (``model.layers.3`` for
``model.layers.3.self_attn``; ``transformer_blocks.0`` for ``transformer_blocks.0.attn.processor``). That is
the attention projections (q/k/v/o_proj; to_q/to_k/to_v/to_out, add_*_proj, to_add_out) and the MLP or
feed-forward (gate/up/down_proj; ff.net.*, proj_mlp, proj_out of single-stream blocks). Never swapped:
anything outside the blocks (embeddings, timestep / caption embedders, ``lm_head``, final norms and output
projections), linears inside normalization modules (a class name containing ``Norm``: adaLN modulation such
as ``AdaLayerNormZero.linear``), subclasses of ``nn.Linear`` (quantized or adapter layers: recorded as
kept), and for Diffusers everything but the transformer (VAE, text encoders). ``linear_include`` /
``linear_exclude`` filter by substrings of the layer's name (as ``report()`` lists it), like
``include`` / ``exclude`` for attention sites; the two filters are independent.

Cross-attention stays bf16 unless ``linear_exclude`` is given (``[]`` swaps it too): the projections of an attention
module that attends to another sequence (one whose ``is_cross_attention`` is true, as Wan's text cross-attention
``attn2``). They carry most of the FP8 error at no measured speed: Wan2.1-1.3B 480p with sage2-8b, output CosSim
0.99876 with them FP8 and 0.99980 without, 1.322× and 1.320× unpatched (two runs in one H200 call; the text K/V
projections, 512 rows, run bf16 under ``policy="speed"`` either way).

Shapes: ``torch._scaled_mm`` takes in/out features that are multiples of 16. A layer that is not keeps its
``nn.Linear`` (decided at patch time on every device, so CPU and GPU swap the same layers): one warning,
the reason in the report, ``UnsupportedError`` naming the layer under ``strict=True``. So does a layer whose weights
accelerate offloads (its hook loads them from the meta device per call) or tensor parallelism shards (DTensor
weights), since FP8 weights are made whole at patch time, and a layer with forward hooks, which its replacement
would not run.

Each swap is an entry of the parent's ``_modules`` recorded in the handle, so ``remove()`` puts the original
``nn.Linear`` back (its weights are kept in memory while patched: :class:`~quantpatch.fp8_linear.FP8Linear`).

A Diffusers ``FeedForward`` whose two linears both became FP8 (``net = [GELU(proj), Dropout(0), Linear, ...]``, Wan's,
Flux's, CogVideoX's, HunyuanVideo's, LTX-Video's, SD3's) gets its GELU moved into the second layer's activation
quantization (:func:`fuse_feed_forward_gelus`): ``net[0]``'s ``gelu`` step becomes the identity (an instance
attribute), so it returns its ``proj`` output, the pre-activation, and ``net[2]`` applies the GELU as it quantizes
its input (``FP8Linear.activation``): one pass over the largest activation of the block where there were three (the
GELU's read and write, the quantization's read). The reference path computes the two steps as before; the GPU
kernel's GELU may differ from ``F.gelu``'s in the last bit (:mod:`~quantpatch.kernels.fp8_linear.fp8_quant_triton`).
Module names and the state dict do not change; ``remove()`` deletes the attribute again.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

from torch import nn

from quantpatch.fallback import fall_back, logger
from quantpatch.kernels.fp8_linear.fp8_linear_ref import ACTIVATIONS
from quantpatch.patches import _class_names, selected
from quantpatch.patching import PatchHandle

NORM_MARK = "Norm"  # class names of normalization modules: their linears (adaLN modulation) stay
# Diffusers GELU.approximate → FP8Linear.activation (the inverse of the reference's activation → F.gelu approximate)
GELU_ACTIVATIONS = {approximate: activation for activation, approximate in ACTIVATIONS.items()}


def transformer_root(model: Any) -> nn.Module:
    """The module whose blocks are patched: a Transformers model itself, a Diffusers pipeline's transformer."""
    if ("transformers", "PreTrainedModel") in _class_names(model):
        return model
    from quantpatch.patches.diffusers import find_transformer

    return find_transformer(model)


def block_of(root: nn.Module, fqn: str) -> str:
    """The innermost ``nn.ModuleList`` element of ``root`` that contains module ``fqn`` (``fqn`` itself if none)."""
    parts = fqn.split(".")
    for i in range(len(parts) - 1, 0, -1):
        if parts[i].isdigit() and isinstance(root.get_submodule(".".join(parts[:i])), nn.ModuleList):
            return ".".join(parts[: i + 1])
    return fqn


def _linears_under(module: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Linear]]:
    """``(fqn, linear)`` of every ``nn.Linear`` (or subclass) below ``module``, not entering normalization modules."""
    for name, child in module.named_children():
        fqn = f"{prefix}.{name}"
        if isinstance(child, nn.Linear):
            yield fqn, child
        elif NORM_MARK not in type(child).__name__:
            yield from _linears_under(child, fqn)


def weights_unavailable(linear: nn.Linear) -> str | None:
    """Why ``linear`` cannot become an FP8 layer at patch time: accelerate offloads its weights (on the meta device
    until its hook loads them for a call), tensor parallelism shards them (a ``DTensor``), or forward hooks are
    registered on it (a swapped module would not run them)."""
    if hasattr(linear, "_hf_hook") or linear.weight.device.type == "meta":
        return "weights offloaded by accelerate (or on the meta device): FP8 weights are made at patch time"
    if type(linear.weight).__name__ == "DTensor":
        return "weights sharded by tensor parallelism (DTensor): FP8 linears take whole, local weights"
    if linear._forward_hooks or linear._forward_pre_hooks:
        return "forward hooks on the layer, which a swapped module would not run"
    return None


def in_cross_attention(root: nn.Module, fqn: str) -> bool:
    """Whether a module above ``fqn`` (under ``root``) is a cross-attention (its ``is_cross_attention`` true)."""
    parts = fqn.split(".")
    return any(getattr(root.get_submodule(".".join(parts[:i])), "is_cross_attention", False) is True
               for i in range(1, len(parts)))


def block_linears(root: nn.Module, attention_modules: list[str]) -> dict[str, nn.Linear]:
    """``{fqn: linear}`` of the blocks holding ``attention_modules`` (FQNs under ``root``), in module order."""
    blocks = dict.fromkeys(block_of(root, fqn) for fqn in attention_modules)
    found: dict[str, nn.Linear] = {}
    for block in blocks:
        found.update(_linears_under(root.get_submodule(block), block))
    return found


def patch_linears(model: Any, handle: PatchHandle, *, strict: bool, include: list[str] | None,
                  exclude: list[str] | None, fast_accum: bool = False) -> None:
    """Swap the block linears of ``model`` for :class:`~quantpatch.fp8_linear.FP8Linear`, recording each swap
    (and each layer kept) in ``handle`` as a site of kind ``"linear"``. Call after the attention patcher. Under the
    handle's ``policy="speed"`` each FP8 layer calls its original where FP8 cannot be faster. ``exclude=None``
    keeps the cross-attention linears (:func:`in_cross_attention`; module docstring). ``fast_accum``: the layers'
    GPU GEMMs accumulate in the tensor cores' precision (:class:`~quantpatch.config.LinearConfig`)."""
    from quantpatch.fp8_linear import FP8Linear, scaled_mm_unsupported, shape_unsupported

    root = transformer_root(model)
    attention = [s.name.removesuffix(".processor") for s in handle.sites if s.kind == "attention"]
    linears = block_linears(root, attention)
    swapped = {}  # id(original) -> replacement: a linear shared by two blocks is quantized once
    for fqn, linear in linears.items():
        if type(linear) is not nn.Linear:
            handle.add_site(fqn, "linear", f"original {type(linear).__name__} (not a plain nn.Linear)")
            continue
        if not selected(fqn, include, exclude):
            handle.add_site(fqn, "linear", "original nn.Linear (excluded)")
            continue
        if exclude is None and in_cross_attention(root, fqn):
            handle.add_site(fqn, "linear", "original nn.Linear (cross-attention: kept bf16 unless linear_exclude "
                                           "is given)")
            continue
        reason = shape_unsupported(linear.in_features, linear.out_features) or weights_unavailable(linear)
        if reason is not None:
            fall_back(f"FP8 linear {fqn}", reason, strict=strict, to="the original nn.Linear")
            handle.add_site(fqn, "linear", "original nn.Linear").fallbacks.add(reason)
            continue
        fp8 = swapped.get(id(linear))
        if fp8 is None:
            fp8 = swapped[id(linear)] = FP8Linear.from_linear(linear)
            fp8.original, fp8.speed_policy, fp8.fast_accum = (linear,), handle.policy == "speed", fast_accum
            fp8.site = handle.add_site(fqn, "linear", "quantpatch FP8Linear (e4m3 weights per channel, activations "
                                                      f"per token{', fast accumulation' if fast_accum else ''})")
        parent, _, child = fqn.rpartition(".")
        handle.setitem(root.get_submodule(parent)._modules, child, fp8)
        # route decided now for the weights' device and dtype, so that calls (and torch.compile traces) only read it
        weight = linear.weight
        scaled_mm_unsupported(weight.device, weight.dtype, linear.bias is not None)
    if not swapped:
        message = f"linear='fp8': no nn.Linear of {type(root).__name__}'s transformer blocks was swapped"
        handle.remarks.append(message)
        logger.warning(message)
        return
    fused = fuse_feed_forward_gelus(root, handle)
    if fused:
        handle.remarks.append(f"the GELU of {fused} feed-forwards runs in their second FP8 linear's activation "
                              "quantization")


def _diffusers_class(module: nn.Module, name: str) -> bool:
    """Whether ``module``'s class is Diffusers' class ``name`` itself (not a subclass, which may change forward)."""
    cls = type(module)
    return cls.__name__ == name and cls.__module__.startswith("diffusers.")


def _plain(module: nn.Module) -> bool:
    """No hooks and no instance ``forward`` or ``gelu`` on ``module``: its class's methods are what a call runs."""
    return not (module._forward_hooks or module._forward_pre_hooks or {"forward", "gelu"} & vars(module).keys())


def _pre_activation(x):
    """The identity: a fused feed-forward's ``GELU.gelu`` (the next layer applies it)."""
    return x


def gelu_fusable(ff: nn.Module, users: Counter) -> bool:
    """Whether Diffusers ``FeedForward`` ``ff`` computes ``net[2](net[0].gelu(net[0].proj(x)))`` (Diffusers' own
    ``GELU`` and a dropout of 0) with both linears FP8 layers used nowhere else (``users``: how often each module
    object occurs in the model), so that the GELU can move into ``net[2]``."""
    from quantpatch.fp8_linear import FP8Linear

    net = getattr(ff, "net", None)
    if not (_diffusers_class(ff, "FeedForward") and _plain(ff) and isinstance(net, nn.ModuleList) and len(net) >= 3):
        return False
    gelu, dropout, second = net[0], net[1], net[2]
    first = getattr(gelu, "proj", None)
    return (_diffusers_class(gelu, "GELU") and getattr(gelu, "approximate", None) in GELU_ACTIVATIONS
            and (type(dropout) is nn.Identity or (type(dropout) is nn.Dropout and dropout.p == 0))
            and all(type(m) is FP8Linear and m.activation is None and users[id(m)] == 1 for m in (first, second))
            and all(_plain(m) for m in (gelu, dropout, first, second)))


def fuse_feed_forward_gelus(root: nn.Module, handle: PatchHandle) -> int:
    """Move the GELU of each :func:`gelu_fusable` feed-forward of ``root`` into its second FP8 layer (module
    docstring), recorded in ``handle``; returns how many were fused."""
    users = Counter(id(m) for _, m in root.named_modules(remove_duplicate=False))
    fused = 0
    for ff in root.modules():
        if gelu_fusable(ff, users):
            gelu, second = ff.net[0], ff.net[2]
            handle.setattr(second, "activation", GELU_ACTIVATIONS[gelu.approximate])
            handle.setattr(gelu, "gelu", _pre_activation)
            fused += 1
    return fused
