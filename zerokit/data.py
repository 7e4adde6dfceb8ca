"""Data by layout: each dp rank reads its own part of the dataset; the tp ranks of one model
copy read the same batches (they compute one model together), and pipeline stages after the
first need no inputs (they receive activations), though reading them does no harm."""

from __future__ import annotations

import os

import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler

from .layout import Grid, as_layout


def sampler(dataset: Dataset, mesh=None, shuffle: bool = True, seed: int = 0,
            drop_last: bool = False) -> DistributedSampler:  # fmt: skip
    """A ``DistributedSampler`` over the data-parallel ranks of ``mesh`` (a ``Layout`` or a
    ``DeviceMesh``) only: ranks differing only in tp (or pp) get identical indices. With
    hybrid sharding every rank of ``dp x shard`` is a data-parallel rank. ``mesh`` None: the
    strategy ``zerokit launch --strategy`` hands every rank (``$ZEROKIT_STRATEGY``), the mesh
    ``zerokit.parallelize`` builds from it. Call ``set_epoch(epoch)`` on it every epoch, as
    with torch's."""
    replicas, rank = _data_rank(mesh)
    return DistributedSampler(dataset, num_replicas=replicas, rank=rank, shuffle=shuffle,
                              seed=seed, drop_last=drop_last)  # fmt: skip


def _data_rank(mesh) -> tuple[int, int]:
    """The data-parallel ranks and this rank's place among them."""
    if mesh is None:
        from .strategy import ENV, Strategy

        strategy = Strategy.from_env()
        if strategy is not None:
            return _strategy_rank(strategy)
        as_layout(None, f"zerokit.data.sampler (outside `zerokit launch`, no ${ENV})")
    return as_layout(mesh, "zerokit.data.sampler").data_parallel


def _strategy_rank(strategy) -> tuple[int, int]:
    """``init_mesh(dp, tp, pp)``'s order (tp fastest: rank = (pp_i * dp + dp_i) * tp + tp_i),
    read from this rank's number alone: no process group is made."""
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:  # torchrun's environment, before init_process_group
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    strategy.check_world(world)
    _, dp_rank, _, _ = Grid(pp=strategy.pp, dp=strategy.dp, tp=strategy.tp).coords(rank)
    return strategy.dp, dp_rank
