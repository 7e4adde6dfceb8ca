"""The one rule for a process group that is not there yet, shared by every entry point
(``group_sharded_parallel``, ``parallelize``, ``init_mesh``): under torchrun (or ``zerokit
launch``) its environment says how to make it, so it is made; otherwise the call is refused,
saying what to do. Never a silent world of one on a launched rank."""

from __future__ import annotations

import os

import torch.distributed as dist

#: what torchrun (and ``zerokit launch``) set for every rank, and ``init_process_group``'s
#: default ``env://`` reads
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def ensure_process_group(who: str) -> None:
    """Make the default process group from torchrun's environment when there is none yet;
    with neither, refuse by ``who``'s name."""
    if dist.is_initialized():
        return
    if all(name in os.environ for name in LAUNCHER_ENV):
        # no backend named: torch picks gloo for CPU tensors and, where CUDA is available,
        # nccl for CUDA tensors
        dist.init_process_group()
        return
    raise RuntimeError(
        f"{who} found no torch.distributed process group. Launch with torchrun "
        "(`torchrun --nproc-per-node 2 train.py`, zerokit then initializes from its "
        "environment) or call torch.distributed.init_process_group('gloo' or 'nccl') "
        "first; for one process: init_process_group('gloo', rank=0, world_size=1, "
        "init_method='tcp://127.0.0.1:29500')."
    )
