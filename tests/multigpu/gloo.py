"""Run a function on two CPU processes joined by a gloo process group: the distributed engines' own code paths
(Diffusers' context parallelism, Transformers' tensor parallelism) on a machine without GPUs."""

from __future__ import annotations

import os
import pickle
import socket
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, port: int, fn: Callable, args: tuple, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank), CUDA_VISIBLE_DEVICES="")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        # plain pickle bytes: a queue would pass tensors as shared memory that dies with this process
        results.put((rank, pickle.dumps(fn(rank, *args))))
    except BaseException as err:  # the parent reports it: a child's traceback is otherwise lost
        results.put((rank, pickle.dumps(RuntimeError(f"{type(err).__name__}: {err}"))))
        raise
    finally:
        dist.destroy_process_group()


def run_on_gloo(fn: Callable, *args: Any) -> list[Any]:
    """``[fn(rank, *args) for each rank]`` from :data:`WORLD` spawned processes sharing a gloo process group.

    ``fn`` must be importable (a module-level function); its results must pickle. A rank's exception is re-raised.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(rank, port, fn, args, results)) for rank in range(WORLD)]
    for p in procs:
        p.start()
    got = {rank: pickle.loads(data) for rank, data in (results.get(timeout=TIMEOUT_S) for _ in range(WORLD))}
    for p in procs:
        p.join(timeout=TIMEOUT_S)
    for rank in range(WORLD):
        if isinstance(got[rank], BaseException):
            raise RuntimeError(f"rank {rank} failed") from got[rank]
    return [got[rank] for rank in range(WORLD)]
