"""The tests' spawn helper: N local gloo CPU ranks (zerokit.launch.spawn_local)."""

import os
import tempfile

import torch.multiprocessing as mp

from zerokit.launch import _entry


def run_distributed(fn, world_size: int, *args) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` forked ranks; re-raise a failure.

    Note: forked, not spawned as ``zerokit.launch.spawn_local`` does: a spawned rank imports
    torch again (seconds of CPU each), which was most of the fast subset's time. The ranks
    start from the test process as it is; each sets one thread before any work.
    """
    with tempfile.TemporaryDirectory(prefix="zerokit-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        mp.start_processes(
            _entry,
            args=(world_size, init_file, "gloo", fn, args),
            nprocs=world_size,
            join=True,
            start_method="fork",
        )
