"""How a bucket's gradients are averaged across ranks: the collective a group's gradients
(``core/gradients.py``) start.

* ``AllReduce`` (``FullGradients``, 'os' with ``whole_grads=True``): every rank keeps the full
  averaged gradient.
* ``ReduceScatter`` (``ShardedGradients``, 'os_g', 'p_g_os'; ``ScatteredGradients``, 'os' by
  default): every rank keeps only its shard of the average; the staged (at 'os': the kept)
  full-size bucket is the collective's input, and on gloo a receive buffer of (N-1)/N of it
  (``scratch_numel``) takes the peers' chunks.
* ``ReduceScatterThenAllReduce``: reduce-scatter inside the shard group, then all-reduce the
  shard across replicas (hybrid sharding: shard inside a host, replicate across hosts).
* ``ReduceScatterThenReduceScatter``: hybrid sharding with the optimizer state sharded over
  replicas too (``ShardingConfig.shard_optimizer_over_replicas``): reduce-scatter inside the
  shard group, then reduce-scatter the shard across replicas, so each replica holds the
  average of its sub-shard only. The same bytes across replicas as the all-reduce it
  replaces, once the updated sub-shards are all-gathered after the step
  (``FlatParamBucket.start_gather_replicas``): reduce-scatter + all-gather = all-reduce.

Under hybrid sharding both consult the model's ``ReplicaSync`` (``core/replica_sync.py``):
while it is deferred, the replica step is skipped, so only the shard group's bytes move.

A reduction holds no buffers: the gradients object owns them and passes them in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup

from .collectives import (
    Pending,
    Ranges,
    reduce_scatter_scratch_numel,
    start_all_gather_,
    start_all_reduce_mean,
    start_reduce_scatter_mean,
)
from .replica_sync import ReplicaSync


@dataclass(frozen=True)
class AllReduce:
    """Average the whole bucket in place (over ``group``, then over ``replicas`` if any); the
    persistent gradient is full-size."""

    group: ProcessGroup
    replicas: ProcessGroup | None = None
    sync: ReplicaSync | None = None  # deferred: the replica step waits for the boundary

    def start(self, full: torch.Tensor, ranges: Ranges = None) -> Pending:
        pending = start_all_reduce_mean(full, self.group)
        if not _crosses(self.replicas, self.sync):
            return pending
        # Across replicas only this rank's shard travels (P/N bytes, not P), then the shards
        # are gathered inside the group again: the slow link carries what 'os_g' sends.
        own = _chunk(full, self.group, ranges)
        return pending.then(lambda: start_all_reduce_mean(own, self.replicas).finish()).then(
            lambda: start_all_gather_(full, self.group, ranges=ranges).finish()
        )


@dataclass(frozen=True)
class ReduceScatter:
    """Average a staged full-size bucket and add this rank's chunk into its gradient shard."""

    group: ProcessGroup

    def scratch_numel(self, numel: int, device: torch.device, ranges: Ranges = None) -> int:
        """Elements of the receive buffer ``start`` needs for a bucket of ``numel`` (0: none)."""
        return reduce_scatter_scratch_numel(self.group, numel, device, ranges)

    def start(
        self,
        full: torch.Tensor,
        shard: torch.Tensor,
        ranges: Ranges = None,
        scratch: torch.Tensor | None = None,
        accumulate: bool = True,
        then=None,
        replica_ranges: Ranges = None,
    ) -> Pending:
        """``accumulate``: add to what ``shard`` holds (backwards between steps add up); False:
        overwrite it (a shard just allocated, its contents undefined). ``then``: run once the
        shard group's average is in ``shard``, before any replica all-reduce.
        ``replica_ranges``: the sub-shards of ``ReduceScatterThenReduceScatter`` (unused here)."""
        pending = start_reduce_scatter_mean(
            full, shard, self.group, accumulate=accumulate, ranges=ranges, scratch=scratch
        )
        return pending if then is None else pending.then(then)


@dataclass(frozen=True)
class ReduceScatterThenAllReduce(ReduceScatter):
    """Hybrid sharding: reduce-scatter in ``group``, then average the shard over ``replicas``.

    Note: the all-reduce runs on the whole shard after the reduce-scatter's epilogue, so a shard
    that already held gradients (accumulation without ``zero_grad``) is averaged too: it holds
    the same values on every replica, so the average leaves it unchanged.
    """

    replicas: ProcessGroup | None = None
    sync: ReplicaSync | None = None  # deferred: the replica step waits for the boundary

    def start(
        self,
        full: torch.Tensor,
        shard: torch.Tensor,
        ranges: Ranges = None,
        scratch: torch.Tensor | None = None,
        accumulate: bool = True,
        then=None,
        replica_ranges: Ranges = None,
    ) -> Pending:
        pending = super().start(full, shard, ranges, scratch, accumulate, then)
        if not _crosses(self.replicas, self.sync):
            return pending
        return pending.then(lambda: start_all_reduce_mean(shard, self.replicas).finish())


def _crosses(replicas: ProcessGroup | None, sync: ReplicaSync | None) -> bool:
    """Does this reduction average across replicas now? (Not while the replica step is
    deferred to the step's last micro-batch: ``core/replica_sync.py``.)"""
    if replicas is None or replicas.size() == 1:
        return False
    return sync is None or not sync.skips_replicas()


@dataclass(frozen=True)
class ReduceScatterThenReduceScatter(ReduceScatter):
    """Hybrid sharding, optimizer state sharded over ``replicas``: reduce-scatter in
    ``group`` into this rank's chunk of the staged bucket, then reduce-scatter that chunk
    across ``replicas`` into this replica's sub-shard of ``shard`` (``replica_ranges``: the
    sub-shards inside the shard; None: equal). The rest of ``shard`` is not written: no
    piece this rank steps lies there.

    Note: the shard group's result is written into ``full``'s own chunk (the collective's
    scratch), not into ``shard``: the sub-shards of the other replicas in ``shard`` hold no
    average, so a gradient accumulated there since ``zero_grad`` is added only to this
    replica's sub-shard, after the average (``accumulate``).
    """

    replicas: ProcessGroup | None = None

    def start(
        self,
        full: torch.Tensor,
        shard: torch.Tensor,
        ranges: Ranges = None,
        scratch: torch.Tensor | None = None,
        accumulate: bool = True,
        then=None,
        replica_ranges: Ranges = None,
    ) -> Pending:
        """``then`` runs after the replicas' reduce-scatter: this reduction is never deferred
        (``ReplicaSync.cannot_defer``), so nothing accumulated waits to be averaged."""
        own = _chunk(full, self.group, ranges)
        pending = start_reduce_scatter_mean(
            full, own, self.group, accumulate=False, ranges=ranges, scratch=scratch
        )
        mine = _chunk(shard, self.replicas, replica_ranges)  # this replica's sub-shard
        pending = pending.then(
            lambda: start_reduce_scatter_mean(
                own, mine, self.replicas, accumulate=accumulate, ranges=replica_ranges
            ).finish()
        )
        return pending if then is None else pending.then(then)


def _chunk(flat: torch.Tensor, group: ProcessGroup, ranges: Ranges = None) -> torch.Tensor:
    """This rank's part of ``flat`` in ``group``: its range, or (None) its equal share."""
    rank = group.rank()
    if ranges is None:
        return flat.view(group.size(), -1)[rank]
    return flat[ranges[rank][0] : ranges[rank][1]]
