"""Fixtures shared by every test folder."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_cpu_thread():
    """Tiny models run fastest on one thread; two OpenMP threads on a busy 2-core CI box spin ~5x longer."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
