"""quantpatch: low-bit attention and linear kernels for Transformers and Diffusers.

Importing quantpatch imports torch only: no transformers, diffusers or Triton, and CUDA is
not initialised.
"""

from quantpatch.api import attention
from quantpatch.config import AttentionConfig, KVCacheConfig, LinearConfig, ModeConfig
from quantpatch.fallback import QuantpatchFallbackWarning, UnsupportedError
from quantpatch.metrics import all_metrics, cos_sim, mre, rel_l1, rmse
from quantpatch.modes import MODES, available_modes, get_mode
from quantpatch.patching import PatchHandle, patch_model

__version__ = "0.1.0"

__all__ = [
    "MODES",
    "AttentionConfig",
    "KVCacheConfig",
    "LinearConfig",
    "ModeConfig",
    "PatchHandle",
    "QuantpatchFallbackWarning",
    "UnsupportedError",
    "all_metrics",
    "attention",
    "available_modes",
    "cos_sim",
    "get_mode",
    "mre",
    "patch_model",
    "rel_l1",
    "rmse",
]
