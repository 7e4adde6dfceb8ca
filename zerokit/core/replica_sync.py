"""Hybrid accumulation: when a backward's gradients cross the replica group (the slow link
between hosts), and when that is left to the step's last micro-batch.

Under hybrid sharding a synchronised backward reduce-scatters each bucket inside the shard
group, then averages the shard across replicas (``ReduceScatterThenAllReduce``). While
``ReplicaSync.deferred`` is set (``model.defer_replica_sync()``, or
``model.requires_replica_sync = False``, FSDP2's ``set_requires_all_reduce(False)``), a backward
reduce-scatters and adds into the sharded gradient as usual, but skips the replica step; the
first backward with it unset (the boundary) averages the whole accumulated shard once.

Note: the mean comes out as one process's. After micro-batches k = 1..K, replica r's shard
holds the sum over k of its shard group's mean g_rk (every reduction adds into the shard, the
deferred ones included); the boundary's average over R replicas gives
sum_k (1/R) sum_r g_rk = sum_k (the mean over all S x R ranks of micro-batch k), exactly what
reducing every micro-batch accumulates (each loss divided by K, as with ``no_sync()``).

One object per wrapped model, shared by its reductions (which read ``deferred``) and its
``ShardState`` (which keeps ``owed`` and refuses a step before the boundary). Without a replica
group nothing crosses hosts, so deferring is a no-op (the same script runs on one host).
"""

from __future__ import annotations

from torch.distributed import ProcessGroup

_OWED = (
    "gradients were accumulated with the cross-replica reduction deferred "
    "(defer_replica_sync() / requires_replica_sync = False) and never averaged across "
    "replicas: run the last micro-batch's backward outside `with model.defer_replica_sync():` "
    "(or set model.requires_replica_sync = True before it), then {call}"
)


class ReplicaSync:
    """Whether this model's backwards average across replicas now or at the boundary."""

    def __init__(self, replica_group: ProcessGroup | None, cannot_defer: str | None = None):
        self.applies = replica_group is not None and replica_group.size() > 1
        self.cannot_defer = cannot_defer  # why deferring is refused here (None: it is not)
        self._deferred = False  # set by the user between backwards; read by the reductions
        self.owed = False  # a backward skipped the replica step since the last boundary
        # the integrations' switch (no_sync(), require_backward_grad_sync): False, they hold
        # unsharded gradients (DDP's meaning); True, they defer only the replica step
        self.replaces_no_sync = False

    @property
    def deferred(self) -> bool:
        return self._deferred

    @deferred.setter
    def deferred(self, value: bool) -> None:
        if value and self.applies and self.cannot_defer:
            raise ValueError(self.cannot_defer)
        self._deferred = bool(value)

    def skips_replicas(self) -> bool:
        """Do reductions leave out the replica group now?"""
        return self.applies and self.deferred

    def backward_done(self) -> None:
        """A synchronised backward ended: its reductions skipped the replicas or averaged
        everything accumulated across them."""
        if self.applies:
            self.owed = self.deferred

    def check_step(self, call: str = "optimizer.step()") -> None:
        if self.owed:
            raise RuntimeError(_OWED.format(call=call))

    def clear(self) -> None:
        """``zero_grad``: the accumulated shard is cleared, so nothing is owed."""
        self.owed = False
