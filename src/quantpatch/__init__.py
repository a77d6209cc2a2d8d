"""quantpatch: low-bit attention and linear kernels for Transformers and Diffusers.

Importing quantpatch imports torch only: no transformers, diffusers or Triton, and CUDA is
not initialised.
"""

from quantpatch.api import attention
from quantpatch.calibration import CalibrationStats, calibrate
from quantpatch.checkpoint import CheckpointError, load, save
from quantpatch.config import AttentionConfig, KVCacheConfig, LinearConfig, ModeConfig
from quantpatch.convert import FireQOptions, convert
from quantpatch.fallback import QuantpatchFallbackWarning, UnsupportedError
from quantpatch.metrics import all_metrics, cos_sim, mre, rel_l1, rmse
from quantpatch.modes import MODES, available_modes, get_mode
from quantpatch.patching import PatchHandle, patch_model
from quantpatch.w4a8_linear import W4A8Linear

__version__ = "0.1.0"

__all__ = [
    "AttentionConfig",
    "CalibrationStats",
    "CheckpointError",
    "FireQOptions",
    "KVCacheConfig",
    "LinearConfig",
    "MODES",
    "ModeConfig",
    "PatchHandle",
    "QuantpatchFallbackWarning",
    "UnsupportedError",
    "W4A8Linear",
    "all_metrics",
    "attention",
    "available_modes",
    "calibrate",
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
