"""Host time of a call on the GPU: the enqueue cost the caller pays, measured while a ``torch.cuda._sleep`` keeps
the GPU busy so that it never waits for the host, beside the eager wall time of the same calls."""

import time
from collections.abc import Callable

import torch


def host_and_wall(fn: Callable[[], object], calls: int = 200, warmup: int = 10) -> tuple[float, float]:
    """``fn`` ``warmup`` times, then ``calls`` times behind a sleep kernel (host µs a call), then ``calls`` times
    timed to a synchronize (wall µs a call)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(40_000_000)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return host, (time.perf_counter() - t0) / calls * 1e6
