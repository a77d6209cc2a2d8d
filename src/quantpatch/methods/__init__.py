"""Calibration methods: one module per method, registered by key, imported only when a mode needs it.

A method is what ``calibrate``, ``convert`` and the checkpoint need to know about one family of modes
(FireQ, TurboAttention). Its module (``quantpatch.methods.fireq``, ``quantpatch.methods.turbo``) defines a
:class:`Method` named ``METHOD``; :data:`METHODS` maps the method's key (a mode's
:func:`~quantpatch.calibration.calibration_key`: its KV-cache kind, else ``"fireq"`` for W4A8 linears) to
that module, imported on first use. Patching a model imports no method module: what the patched model
reads at run time lives apart (:mod:`quantpatch.crs`, :mod:`quantpatch.head_precision`).

The checkpoint stores one record per attention site (``quantpatch_config.json`` ``"attention"``), tagged
with its KV kind (``"kv"``); :attr:`Method.site_kinds` says which tags a method writes, so ``load`` and
``info`` hand each site to the method that wrote it, whatever mode the checkpoint names.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Method:
    """The hooks of one calibration method.

    Attributes:
        key: the calibration key of the modes it serves (``"fireq"``, ``"turbo"``).
        site_kinds: the ``"kv"`` tags of the attention-site records its converter writes.
        calibrate: ``fn(model, samples, config, progress) -> CalibrationStats`` with ``samples`` a list of
            ``(1, N)`` int64 token tensors.
        convert: ``fn(model, stats, config, *, quantize, options, include, exclude, progress) -> ConvertState``:
            changes the model in place and fills ``ConvertState.attention`` / ``.linears``, the records ``save``
            writes.
        add_site: the load hook, ``fn(attention_module, site_record)``: on the rebuilt model (parameters on
            meta), registers what the site's record says the checkpoint holds (buffers on meta, filled by
            ``load_state_dict``).
        summarize: ``fn(site_records) -> dict``: this method's fields of ``checkpoint.info``, given the
            checkpoint's site records of its kinds (an empty list when it has none).
    """

    key: str
    site_kinds: tuple[str, ...]
    calibrate: Callable[..., Any]
    convert: Callable[..., Any]
    add_site: Callable[[Any, dict[str, Any]], None]
    summarize: Callable[[list[dict[str, Any]]], dict[str, Any]]


# key -> the module defining ``METHOD`` (imported on first use), or a Method.
METHODS: dict[str, Method | str] = {
    "fireq": "quantpatch.methods.fireq",
    "turbo": "quantpatch.methods.turbo",
}


def register_method(key: str, method: Method | str) -> None:
    """Add (or replace) the method of modes whose calibration key is ``key`` (a :class:`Method` or a module)."""
    METHODS[key] = method


def get_method(key: str) -> Method:
    """The method registered under ``key``, its module imported now; ``ValueError`` if there is none."""
    if key not in METHODS:
        raise ValueError(f"no calibration method for {key!r}; registered: {sorted(METHODS)}")
    method = METHODS[key]
    if isinstance(method, str):
        try:
            method = importlib.import_module(method).METHOD
        except (ImportError, AttributeError) as err:
            raise ValueError(f"calibration method {key!r} ({METHODS[key]}) is not available: {err}") from err
    return method


def all_methods() -> list[Method]:
    """Every registered method, in registration order."""
    return [get_method(key) for key in METHODS]


def method_of_site(kind: Any) -> Method:
    """The method whose converter writes attention-site records tagged ``kind``; ``ValueError`` if none."""
    for method in all_methods():
        if kind in method.site_kinds:
            return method
    raise ValueError(f"no calibration method writes attention sites of KV kind {kind!r}")
