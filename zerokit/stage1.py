"""Level 'os' (ZeRO stage 1): full gradients on every rank, averaged with one all-reduce per
bucket during backward; only the optimizer state is sharded.

Buffers (owned here): one persistent full-size flat gradient buffer per bucket. After backward
every parameter's ``.grad`` is a view of it (or None, as in single-process training) and the
optimizer's pieces' ``.grad`` are views of its shard.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup

from .collectives import Pending, start_all_reduce_mean
from .flat_param import FlatParamBucket
from .grad_sync import BucketedGradSync


class AllReduceGrads(BucketedGradSync):
    def __init__(self, buckets: list[FlatParamBucket], group: ProcessGroup, sync_comm: bool):
        self.grad_buffers = [torch.zeros_like(b.data) for b in buckets]
        super().__init__(buckets, group, sync_comm)

    def _take_grad(self, b: int, i: int, param: nn.Parameter) -> bool:
        slot = self.buckets[b].slot_view(self.grad_buffers[b], i)
        grad = param.grad
        if grad is None:
            slot.zero_()
            return False
        if grad.data_ptr() != slot.data_ptr():  # a fresh gradient from autograd
            slot.copy_(grad)
            param.grad = slot  # later backwards accumulate straight into the bucket
        return True

    def _start_reduce(self, b: int) -> Pending:
        return start_all_reduce_mean(self.grad_buffers[b], self.group)

    def _publish(self, b: int) -> None:
        bucket, flags, buffer = self.buckets[b], self.has_grad[b], self.grad_buffers[b]
        for i, param in enumerate(bucket.params):
            param.grad = bucket.slot_view(buffer, i) if flags[i] else None
        for piece, piece_param, grad in zip(
            bucket.pieces, bucket.param_pieces, bucket.piece_views(bucket.shard(buffer))
        ):
            piece_param.grad = grad if flags[piece.slot] else None

    def _zero(self, set_to_none: bool) -> None:
        for bucket, buffer in zip(self.buckets, self.grad_buffers):
            if set_to_none:
                for param in bucket.params:
                    param.grad = None
            else:
                buffer.zero_()

    def grads_to_scale(self) -> list[torch.Tensor]:
        return self.grad_buffers
