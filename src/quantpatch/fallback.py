"""Fallback reporting: one warning per distinct reason, or an error under ``strict=True``."""

from __future__ import annotations

import logging
import warnings

logger = logging.getLogger("quantpatch")

_WARNED: set[str] = set()


class QuantpatchFallbackWarning(UserWarning):
    """A quantized path could not honour a call and a full-precision path ran instead."""


class UnsupportedError(ValueError):
    """Raised under ``strict=True`` where quantpatch would otherwise fall back."""


def fall_back(what: str, reason: str, *, strict: bool) -> None:
    """Report that ``what`` falls back because of ``reason``: raise if strict, else warn once per message."""
    message = f"{what}: {reason}; falling back to PyTorch SDPA"
    if strict:
        raise UnsupportedError(f"{what}: {reason} (strict=True forbids the SDPA fallback)")
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)
        warnings.warn(message, QuantpatchFallbackWarning, stacklevel=3)


def reset_fallback_warnings() -> None:
    """Forget which fallbacks were reported (tests use this to observe the once-only warning)."""
    _WARNED.clear()
