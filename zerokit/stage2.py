"""Level 'os_g' (ZeRO stage 2): gradients reduce-scattered bucket by bucket during backward.

Buffers (owned here): one persistent shard-size gradient buffer per bucket, which the
optimizer's pieces' ``.grad`` are views of. A full-size bucket buffer exists only while that
bucket is being reduced in backward: it is allocated when the bucket's first gradient arrives
and dropped when its reduce-scatter finishes, with at most ``max_in_flight`` of them waiting at
once. Parameters' own ``.grad`` is always None after backward: the full gradient is gone.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup

from .collectives import Pending, start_reduce_scatter_mean
from .flat_param import FlatParamBucket
from .grad_sync import BucketedGradSync


class ReduceScatterGrads(BucketedGradSync):
    max_in_flight = 2

    def __init__(self, buckets: list[FlatParamBucket], group: ProcessGroup, sync_comm: bool):
        self.grad_shards = [torch.zeros_like(b.shard(b.data)) for b in buckets]
        self._full: list[torch.Tensor | None] = [None] * len(buckets)
        super().__init__(buckets, group, sync_comm)

    def _full_buffer(self, b: int) -> torch.Tensor:
        if self._full[b] is None:
            bucket = self.buckets[b]
            full = torch.empty_like(bucket.data)
            full[bucket.layout.numel :].zero_()  # padding
            self._full[b] = full
        return self._full[b]

    def _take_grad(self, b: int, i: int, param: nn.Parameter) -> bool:
        slot = self.buckets[b].slot_view(self._full_buffer(b), i)
        if param.grad is None:
            slot.zero_()
            return False
        slot.copy_(param.grad)
        param.grad = None  # release the full-size gradient autograd made
        return True

    def _start_reduce(self, b: int) -> Pending:
        full, self._full[b] = self._full_buffer(b), None
        # Always accumulate: zero_grad() zeroes the shard, and backwards between steps add up.
        return start_reduce_scatter_mean(full, self.grad_shards[b], self.group, accumulate=True)

    def _publish(self, b: int) -> None:
        bucket, flags = self.buckets[b], self.has_grad[b]
        for piece, piece_param, grad in zip(
            bucket.pieces, bucket.param_pieces, bucket.piece_views(self.grad_shards[b])
        ):
            piece_param.grad = grad if flags[piece.slot] else None

    def _zero(self, set_to_none: bool) -> None:
        for shard in self.grad_shards:
            shard.zero_()

    def grads_to_scale(self) -> list[torch.Tensor]:
        return self.grad_shards
