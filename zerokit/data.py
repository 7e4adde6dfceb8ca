"""Data by layout: each dp rank reads its own part of the dataset; the tp ranks of one model
copy read the same batches (they compute one model together), and pipeline stages after the
first need no inputs (they receive activations), though reading them does no harm."""

from __future__ import annotations

from torch.utils.data import Dataset, DistributedSampler

from .layout import as_layout


def sampler(dataset: Dataset, mesh, shuffle: bool = True, seed: int = 0,
            drop_last: bool = False) -> DistributedSampler:  # fmt: skip
    """A ``DistributedSampler`` over the data-parallel ranks of ``mesh`` (a ``Layout`` or a
    ``DeviceMesh``) only: ranks differing only in tp (or pp) get identical indices. With
    hybrid sharding every rank of ``dp x shard`` is a data-parallel rank. Call
    ``set_epoch(epoch)`` on it every epoch, as with torch's."""
    layout = as_layout(mesh, "zerokit.data.sampler")
    replicas = layout.dp_degree * layout.sharding_degree
    rank = layout.dp_rank * layout.sharding_degree + layout.sharding_rank
    return DistributedSampler(dataset, num_replicas=replicas, rank=rank, shuffle=shuffle,
                              seed=seed, drop_last=drop_last)  # fmt: skip
