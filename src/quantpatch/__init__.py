"""quantpatch: low-bit attention and linear kernels for Transformers and Diffusers.

Importing quantpatch imports torch only: no transformers, diffusers or Triton, and CUDA is
not initialised.
"""

from quantpatch.api import attention
from quantpatch.calibration import CalibrationStats, calibrate
from quantpatch.checkpoint import CheckpointError, load, save
from quantpatch.config import AttentionConfig, KVCacheConfig, LinearConfig, ModeConfig
from quantpatch.conversion import FireQOptions, convert
from quantpatch.fallback import QuantpatchFallbackWarning, UnsupportedError
from quantpatch.fp8_linear import FP8Linear
from quantpatch.head_precision import HeadPrecision
from quantpatch.metrics import all_metrics, cos_sim, mre, rel_l1, rmse
from quantpatch.modes import MODES, available_modes, get_mode
from quantpatch.patching import PatchHandle, patch_model
from quantpatch.range_check import QuantpatchAccuracyWarning
from quantpatch.w4a8_linear import W4A8Linear

__version__ = "0.1.0"

# Names served by a module that imports a heavy library (Transformers) or a calibration method (imported only
# by the modes that need it), loaded on first access.
_LAZY = {"TurboCache": "quantpatch.patches.transformers.turbo_cache",
         "calibrate_head_precision": "quantpatch.methods.turbo"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'quantpatch' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "AttentionConfig",
    "CalibrationStats",
    "CheckpointError",
    "FP8Linear",
    "FireQOptions",
    "HeadPrecision",
    "KVCacheConfig",
    "LinearConfig",
    "MODES",
    "ModeConfig",
    "PatchHandle",
    "QuantpatchAccuracyWarning",
    "QuantpatchFallbackWarning",
    "TurboCache",
    "UnsupportedError",
    "W4A8Linear",
    "all_metrics",
    "attention",
    "available_modes",
    "calibrate",
    "calibrate_head_precision",
    "convert",
    "cos_sim",
    "get_mode",
    "load",
    "mre",
    "patch_model",
    "rel_l1",
    "rmse",
    "save",
]
