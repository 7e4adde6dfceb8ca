"""Start N local ranks without torchrun: gloo on CPU, one thread each.

Used by the examples and benchmarks; under torchrun, call your function directly instead.
"""

from __future__ import annotations

import gc
import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def spawn_local(fn: Callable[..., Any], nproc: int, *args: Any) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``nproc`` local gloo ranks and wait for them.

    ``fn`` must be importable (a module-level function). A failure on any rank is re-raised.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {nproc}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_entry, args=(nproc, port, fn, args), nprocs=nproc, join=True)


def _entry(rank: int, world_size: int, port: int, fn, args) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"  # ranks share the machine's cores
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        fn(rank, world_size, *args)
    finally:
        gc.collect()  # free wrapped models (which hold the group) before the group goes
        dist.destroy_process_group()
