"""Fallback reporting: one warning per distinct reason, or an error under ``strict=True``."""

from __future__ import annotations

import contextlib
import contextvars
import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

logger = logging.getLogger("quantpatch")

_WARNED: set[str] = set()


@dataclass
class SiteRecord:
    """One patched site of a model (an attention module, a linear layer), what it runs, and its fallbacks."""

    name: str
    kind: str
    runs: str
    fallbacks: set[str] = field(default_factory=set)
    routes: dict[str, int] = field(default_factory=dict)  # calls per route ("triton", "sdpa: <why>", ...)
    range_checked: bool = False  # quantpatch.range_check sampled this site's inputs

    def count(self, route: str) -> None:
        """One more call of this site took ``route`` (an implementation's name, or ``SDPA_ROUTE`` + why).

        Not while ``torch.compile`` traces: a count read in a graph becomes a guard on its value, so every later call
        of the compiled model would recompile (and ``fullgraph=True`` fail at the recompile limit). Calls that run a
        compiled graph are therefore not counted."""
        if torch.compiler.is_compiling():
            return
        self.routes[route] = self.routes.get(route, 0) + 1

    def count_sdpa(self, why: str) -> None:
        """One more call of this site ran SDPA by policy, because of ``why`` (route ``SDPA_ROUTE + why``).

        The route string is made once per reason: joining and hashing it on every call cost ~0.1 µs."""
        if torch.compiler.is_compiling():  # not counted in a graph (see count)
            return
        route = _SDPA_ROUTES.get(why)
        if route is None:
            route = _SDPA_ROUTES[why] = SDPA_ROUTE + why
        self.count(route)

    @property
    def implementations(self) -> set[str]:
        """The implementations that served a call of this site (its routes other than the original by policy)."""
        return {route for route in self.routes if not route.startswith(POLICY_ROUTES)}


SDPA_ROUTE = "sdpa: "  # the route of an attention call that ran SDPA by policy, followed by why
ORIGINAL_LINEAR_ROUTE = "original: "  # the route of a linear call that ran the original weights by policy, and why
POLICY_ROUTES = (SDPA_ROUTE, ORIGINAL_LINEAR_ROUTE)
_SDPA_ROUTES: dict[str, str] = {}  # why -> SDPA_ROUTE + why


# The patched site currently running, so that a fallback deep inside quantpatch.attention is
# attributed to its module in the PatchHandle report. torch.compile cannot trace a ContextVar
# (each access would break the graph), so while dynamo traces, a plain stack stands in for it.
_current_site: contextvars.ContextVar[SiteRecord | None] = contextvars.ContextVar("quantpatch_site", default=None)
_traced_sites: list[SiteRecord | None] = []


@contextlib.contextmanager
def running_site(record: SiteRecord | None) -> Iterator[None]:
    """Attribute fallbacks reported while the block runs to ``record``."""
    if torch.compiler.is_compiling():
        _traced_sites.append(record)
        try:
            yield
        finally:
            _traced_sites.pop()
        return
    token = _current_site.set(record)
    try:
        yield
    finally:
        _current_site.reset(token)


def current_site() -> SiteRecord | None:
    """The patched site whose call is running (None outside a patched model)."""
    if torch.compiler.is_compiling():
        return _traced_sites[-1] if _traced_sites else None
    return _current_site.get()


class QuantpatchFallbackWarning(UserWarning):
    """A quantized path could not honour a call and a full-precision path ran instead."""


class UnsupportedError(ValueError):
    """Raised under ``strict=True`` where quantpatch would otherwise fall back."""


def fall_back(what: str, reason: str, *, strict: bool, to: str = "full precision") -> None:
    """Report that ``what`` falls back to ``to`` because of ``reason``: raise if strict, else warn once per message."""
    message = f"{what}: {reason}; falling back to {to}"
    if strict:
        raise UnsupportedError(f"{what}: {reason} (strict=True forbids the fallback to {to})")
    site = current_site()
    if site is not None:
        site.fallbacks.add(reason)
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)
        warnings.warn(message, QuantpatchFallbackWarning, stacklevel=3)


def note_implementation(name: str) -> None:
    """Record on the running site (if any) which implementation served a call, and count the call."""
    site = current_site()
    if site is not None:
        site.count(name)


def note_sdpa_route(record: SiteRecord | None, why: str) -> None:
    """Count a call of ``record`` (or of the running site) that ran SDPA by policy, with why."""
    site = record if record is not None else current_site()
    if site is not None:
        site.count_sdpa(why)


def reset_fallback_warnings() -> None:
    """Forget which fallbacks were reported (tests use this to observe the once-only warning)."""
    _WARNED.clear()
