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

from .core.collectives import Pending, start_all_reduce_mean
from .core.flat_param import FlatParamBucket
from .grad_sync import BucketedGradSync


class AllReduceGrads(BucketedGradSync):
    def __init__(
        self,
        buckets: list[FlatParamBucket],
        group: ProcessGroup,
        sync_comm: bool,
        reduce_dtype: torch.dtype | None = None,
    ):
        self.grad_buffers = [
            torch.zeros(
                b.layout.padded_numel, dtype=reduce_dtype or b.data.dtype, device=b.data.device
            )
            for b in buckets
        ]
        # Mixed precision: the optimizer's pieces are fp32 masters; if gradients are reduced
        # in another dtype, the pieces get fp32 copies of their shard of the reduced buffer.
        self.piece_grad_shards = [
            buf_shard
            if (buf_shard.dtype, buf_shard.device) == (b.shard_data.dtype, b.shard_data.device)
            else torch.zeros_like(b.shard_data)
            for b, buf_shard in ((b, b.shard(g)) for b, g in zip(buckets, self.grad_buffers))
        ]
        super().__init__(buckets, group, sync_comm)

    def _aliases_param(self, b: int) -> bool:
        """Can ``param.grad`` be a view of the buffer (same dtype: no mixed precision)?"""
        return self.grad_buffers[b].dtype == self.buckets[b].data.dtype

    def _take_grad(self, b: int, i: int, param: nn.Parameter) -> bool:
        slot = self.buckets[b].slot_view(self.grad_buffers[b], i)
        grad = param.grad
        accumulated = bool(self.has_grad[b][i])  # the slot holds reduced gradients since zero_grad
        if grad is None:
            if not (accumulated and not self._aliases_param(b)):
                slot.zero_()
            return False
        if grad.data_ptr() == slot.data_ptr():  # autograd accumulated into the bucket itself
            return True
        if accumulated and not self._aliases_param(b):
            slot.add_(grad)  # mixed precision: the slot cannot be param.grad, so add here
        else:
            slot.copy_(grad)
        # later backwards accumulate straight into the bucket (if it is param's dtype)
        param.grad = slot if self._aliases_param(b) else None
        return True

    def _start_reduce(self, b: int) -> Pending:
        return start_all_reduce_mean(self.grad_buffers[b], self.group)

    def _publish(self, b: int) -> None:
        bucket, flags, buffer = self.buckets[b], self.has_grad[b], self.grad_buffers[b]
        alias = self._aliases_param(b)
        for i, param in enumerate(bucket.params):
            param.grad = bucket.slot_view(buffer, i) if flags[i] and alias else None
        piece_grads = self.piece_grad_shards[b]
        if piece_grads.data_ptr() != bucket.shard(buffer).data_ptr():
            piece_grads.copy_(bucket.shard(buffer))
        for piece, piece_param, grad in zip(
            bucket.pieces, bucket.param_pieces, bucket.piece_views(piece_grads)
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
        copies = [
            g for g, buf in zip(self.piece_grad_shards, self.grad_buffers) if g._base is not buf
        ]
        return self.grad_buffers + copies
