"""``patch_model`` and the reversible :class:`PatchHandle` it returns.

Patching is per instance: every change is a recorded ``(owner, attribute, original)``
(or a dict entry) that :meth:`PatchHandle.remove` restores in reverse order, so outputs
after ``remove()`` are bitwise those of the unpatched model. Library-specific work lives
in ``quantpatch.patches``; this module only dispatches and keeps the books.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from quantpatch.config import AttentionConfig, LinearConfig, ModeConfig
from quantpatch.dispatch import check_policy, preload_kernels
from quantpatch.fallback import SiteRecord, logger
from quantpatch.modes import get_mode

_MISSING = object()
PATCHED_MARK = "_quantpatch_handle"


class PatchHandle:
    """Undo log and report of one :func:`patch_model` call; a context manager that removes itself."""

    def __init__(self, model: torch.nn.Module, mode: ModeConfig, overrides: dict[str, dict[str, Any]] | None = None,
                 policy: str = "speed"):
        self.model = model
        self.mode = mode
        self.policy = check_policy(policy)
        if overrides is not None and not isinstance(overrides, Mapping):
            raise TypeError(f"overrides takes a dict {{site name: {{option: value}}}}, got {type(overrides).__name__}")
        self.overrides = dict(overrides or {})
        for site, options in self.overrides.items():
            if not isinstance(options, Mapping):
                raise TypeError(f"overrides maps a site name to a dict of attention options, e.g. {{{site!r}: "
                                f"{{'qk_qmax': 7}}}}; got {options!r} for {site!r}")
        self.sites: list[SiteRecord] = []
        self.remarks: list[str] = []
        self._undo: list[tuple[Any, str, Any]] = []
        self.active = True

    # -- recording ----------------------------------------------------------------
    def setattr(self, owner: Any, name: str, value: Any) -> None:
        """``setattr(owner, name, value)``, remembering the original (or its absence)."""
        # Only an instance attribute is restored; one that came from the class is deleted again.
        self._undo.append((owner, name, vars(owner).get(name, _MISSING)))
        setattr(owner, name, value)

    def setitem(self, mapping: Any, key: Any, value: Any) -> None:
        """``mapping[key] = value``, remembering the original entry (or its absence)."""
        self._undo.append((mapping, ("item", key), mapping[key] if key in mapping else _MISSING))
        mapping[key] = value

    def add_undo(self, undo: Any) -> None:
        """Run ``undo()`` on :meth:`remove`, in order with the recorded changes."""
        self._undo.append((undo, None, None))

    def attention_config(self, site: str) -> AttentionConfig:
        """The attention numerics of ``site``: the mode's, with that site's overrides applied."""
        options = self.overrides.get(site)
        return self.mode.attention.replace(**options) if options else self.mode.attention

    def add_site(self, name: str, kind: str, runs: str) -> SiteRecord:
        record = SiteRecord(name, kind, runs)
        self.sites.append(record)
        return record

    # -- undo ---------------------------------------------------------------------
    def remove(self) -> None:
        """Restore every original object, newest change first. Idempotent."""
        if not self.active:
            return
        for owner, name, original in reversed(self._undo):
            if name is None:  # a callable registered with add_undo
                owner()
            elif isinstance(name, tuple):
                key = name[1]
                if original is _MISSING:
                    del owner[key]
                else:
                    owner[key] = original
            elif original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._undo.clear()
        self.active = False

    def __enter__(self) -> PatchHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    # -- report -------------------------------------------------------------------
    def report(self) -> str:
        """Each patched site, what it now runs, its calls per route (calls inside a ``torch.compile`` graph are not
        counted) and every fallback with its reason."""
        lines = [f"quantpatch mode {self.mode.name!r} (policy {self.policy!r}) on {type(self.model).__name__} "
                 f"({'active' if self.active else 'removed'})"]
        for site in self.sites:
            ran = f" [{', '.join(sorted(site.implementations))}]" if site.implementations else ""
            lines.append(f"  {site.kind:<9} {site.name}: {site.runs}{ran}")
            lines.extend(f"      {calls:>6} calls: {route}" for route, calls in sorted(site.routes.items()))
            lines.extend(f"      fallback: {reason}" for reason in sorted(site.fallbacks))
        lines.extend(f"  note: {note}" for note in self.remarks)
        return "\n".join(lines)

    def fallbacks(self) -> dict[str, set[str]]:
        """``{site name: reasons}`` for every site that fell back at least once."""
        return {s.name: set(s.fallbacks) for s in self.sites if s.fallbacks}


def _is_compiled(model: Any) -> bool:
    return type(model).__name__ == "OptimizedModule" or hasattr(model, "_orig_mod")


def patch_model(
    model: Any,
    mode: str | ModeConfig = "sage2-8b",
    *,
    strict: bool = False,
    include: list[str] | None = None,
    exclude: list[str] | None = None,
    overrides: dict[str, dict[str, Any]] | None = None,
    policy: str = "speed",
    linear: str | LinearConfig | None = None,
    linear_include: list[str] | None = None,
    linear_exclude: list[str] | None = None,
) -> PatchHandle:
    """Swap the attention (and with ``linear="fp8"`` the block linears) of a loaded Transformers model (or Diffusers
    pipeline/transformer).

    Args:
        model: a ``transformers.PreTrainedModel``, a Diffusers pipeline or transformer.
        mode: a registered mode name or a ``ModeConfig``.
        strict: raise instead of falling back to the original attention.
        include / exclude: module-name substrings selecting which attention sites to patch (a string is one
            substring).
        overrides: per-site attention options keyed by the site's full name (as in ``report()``),
            e.g. ``{"model.layers.0.self_attn": {"qk_format": "int8", "qk_qmax": 127}}``.
        policy: ``"speed"`` (default): each call runs the mode's kernel only where this GPU's crossover
            table (:mod:`quantpatch.routing`, re-measured by ``quantpatch tune``) says it beats SDPA, else
            the model's own attention, so a patched model is never slower (on the CPU, every call runs
            SDPA). ``"always"``: every call runs the mode's numerics (accuracy studies, CPU reference).
            ``report()`` counts each site's calls per route.
        linear: ``"fp8"`` swaps the transformer blocks' ``nn.Linear`` layers (attention projections, MLP /
            feed-forward; never embeddings, norms, the LM head, VAE or text encoders) for
            :class:`~quantpatch.fp8_linear.FP8Linear` (e4m3 weights per output channel, e4m3 activations per
            token; no calibration; :mod:`quantpatch.patches.linears`); ``"none"`` keeps them. Overrides the
            mode's ``linear`` part (``get_mode(mode, linear=...)``); ``None`` keeps the mode's. Layers whose
            in/out features are not multiples of 16 keep their ``nn.Linear`` (reported; an error under
            ``strict``). While patched the handle holds the original linears (their weights stay in memory).
            A :class:`~quantpatch.config.LinearConfig` sets the options too, e.g.
            ``LinearConfig(kind="fp8", fast_accum=True)`` (the GEMMs' faster accumulation).
        linear_include / linear_exclude: substrings of a linear's name selecting which block linears become
            FP8 (default: the mode's ``linear.include``, else all); independent of ``include`` / ``exclude``.
            ``linear_exclude=None`` also keeps cross-attention projections (Wan's ``attn2``) bf16: most of the
            FP8 error, no measured speed (:mod:`quantpatch.patches.linears`); ``[]`` swaps them too.

    Returns:
        A :class:`PatchHandle`: ``.remove()`` (or leaving its ``with`` block) restores the model.

    Raises:
        ValueError: the model is already patched, is ``torch.compile``-d, or is of an unsupported kind; ``linear``
            names no kind (or ``"w4a8_fp8"``, which ``quantpatch.convert`` makes); linear filters without FP8 linears.
    """
    from quantpatch.patches import name_filter, selected

    include, exclude = name_filter("include", include), name_filter("exclude", exclude)
    linear_include = name_filter("linear_include", linear_include)
    linear_exclude = name_filter("linear_exclude", linear_exclude)
    if getattr(linear, "kind", linear) == "w4a8_fp8":
        raise ValueError("patch_model swaps in linear='fp8' (or 'none'); W4A8 linears are made by quantpatch.convert "
                         "and loaded from its checkpoints")
    config = get_mode(mode, linear=linear)
    if config.linear.kind != "fp8" and (linear_include is not None or linear_exclude is not None):
        raise ValueError(f"linear_include / linear_exclude select FP8 linears, but mode {config.name!r} has linear "
                         f"{config.linear.kind!r}: pass linear='fp8'")
    if _is_compiled(model):
        raise ValueError(
            "patch_model got a torch.compile-d model; patch the original module first, then compile it"
        )
    if getattr(model, PATCHED_MARK, None) is not None:
        raise ValueError("this model is already patched by quantpatch; call .remove() on its handle first")
    handle = PatchHandle(model, config, overrides, policy)
    preload_kernels()  # not on a first call under torch.compile (an import there breaks the graph)
    from quantpatch.patches import patch_for

    try:
        patch_for(model)(model, config, handle, strict=strict, include=include, exclude=exclude)
        attention_sites = [site.name for site in handle.sites if site.kind == "attention"]  # what overrides tune
        unknown = set(handle.overrides) - set(attention_sites)
        if unknown:
            raise ValueError(f"overrides name unknown sites {sorted(unknown)}; sites are {attention_sites}")
        if attention_sites and not any(selected(name, include, exclude) for name in attention_sites):
            message = (f"include={include!r} / exclude={exclude!r} select none of {type(model).__name__}'s "
                       f"{len(attention_sites)} attention sites (e.g. {attention_sites[0]!r}): attention stays "
                       "unpatched")
            handle.remarks.append(message)
            logger.warning(message)
        if config.linear.kind == "fp8":
            from quantpatch.patches.linears import patch_linears

            patch_linears(model, handle, strict=strict, exclude=linear_exclude,
                          include=linear_include if linear_include is not None else list(config.linear.include),
                          fast_accum=config.linear.fast_accum)
        handle.setattr(model, PATCHED_MARK, handle)
    except BaseException:
        handle.remove()
        raise
    return handle
