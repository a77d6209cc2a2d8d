"""Where a kernel runs: whether a tensor's device can run a GPU kernel (CUDA, not ROCm, of at least a compute
capability), and where the Gluon kernels run (``triton.experimental.gluon``, Triton 3.6+, written for sm_90).

Each Gluon kernel has a Triton kernel of the same numerics that serves everywhere else. A :class:`GluonGate`
answers, once per device, whether its Gluon kernel runs there (and logs why not, once), and closes on a device
where the kernel fails to compile (another Triton's Gluon API), with one warning. Importing this module imports
neither Triton nor Gluon.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("quantpatch")
gate_closures = 0  # how many times a GluonGate closed in this process: planned calls made before one are dropped


def cuda_unsupported(t: torch.Tensor, min_capability: tuple[int, int], needs: str) -> str | None:
    """Why ``t``'s device cannot run a kernel whose ``needs`` ask for ``min_capability`` (None if it can)."""
    if not t.is_cuda:
        return "inputs are not CUDA tensors"
    if torch.version.hip is not None:
        return "ROCm is not supported by these kernels"
    cap = torch.cuda.get_device_capability(t.device)
    if cap < min_capability:
        return f"{needs} need compute capability >= {min_capability[0]}.{min_capability[1]}, got {cap[0]}.{cap[1]}"
    return None


def gluon_reason(capability: tuple[int, int] | None, import_error: str | None) -> str | None:
    """Why a Gluon kernel cannot run on a CUDA device of ``capability`` (None: not CUDA), or None."""
    if import_error is not None:
        return f"triton.experimental.gluon does not import ({import_error})"
    if capability is None:
        return "not a CUDA device"
    if capability[0] != 9:
        return f"it needs sm_90, got compute capability {capability[0]}.{capability[1]}"
    return None


class GluonGate:
    """Whether the Gluon kernel ``kernel`` runs on a device; ``serves`` names what runs where it does not.

    Args:
        kernel: what the Gluon kernel does, for the log (e.g. ``"W4A8 decode (M ≤ 16)"``).
        serves: the kernel that serves instead (e.g. ``"the Triton decode kernel"``).
        import_error: why the Gluon module did not import, or None.
    """

    def __init__(self, kernel: str, serves: str, import_error: str | None):
        self.kernel, self.serves, self.import_error = kernel, serves, import_error
        self.reasons: dict[torch.device, str | None] = {}

    def unsupported(self, device: torch.device) -> str | None:
        """:func:`gluon_reason` for ``device``, asked once per device; a reason is logged once."""
        if device not in self.reasons:
            cuda = device.type == "cuda" and torch.version.hip is None
            reason = self.reasons[device] = gluon_reason(torch.cuda.get_device_capability(device) if cuda else None,
                                                         self.import_error)
            if reason is not None and device.type == "cuda":
                logger.info("%s on %s: %s, not the Gluon one: %s", self.kernel, device, self.serves, reason)
        return self.reasons[device]

    def close(self, device: torch.device, error: Exception) -> None:
        """The Gluon kernel failed to compile on ``device``: from now on ``serves`` runs there (one warning)."""
        import triton

        global gate_closures
        gate_closures += 1
        self.reasons[device] = f"the Gluon kernel does not compile with Triton {triton.__version__}"
        logger.warning("%s on %s: %s (%s); %s serves", self.kernel, device, self.reasons[device], str(error)[:300],
                       self.serves)
