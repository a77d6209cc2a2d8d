"""The one CUDA check of the test suite: GPU tests skip, saying why, where no CUDA device is present."""

import pytest
import torch

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (run on the device machine)")
hopper = pytest.mark.skipif(not CUDA or torch.cuda.get_device_capability()[0] != 9, reason="needs an sm_90 GPU")
