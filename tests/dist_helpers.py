"""Spawn a gloo process group of N CPU ranks and run a function on each (tests and benchmarks)."""

from __future__ import annotations

import faulthandler
import gc
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world_size: int, init_file: str, fn, args) -> None:
    faulthandler.enable()  # a native abort in a rank prints that rank's Python stack
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        fn(rank, world_size, *args)
    finally:
        # Wrapped models hold the process group inside reference cycles (hooks); free them
        # now, or the group is destroyed at interpreter exit, after gloo's threads, and aborts.
        gc.collect()
        dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; re-raise a failure.

    ``fn`` must be a module-level function (it is pickled into the child processes).
    """
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.spawn(_entry, args=(world_size, init_file, fn, args), nprocs=world_size, join=True)
