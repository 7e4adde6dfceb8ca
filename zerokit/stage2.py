"""Level 'os_g' (ZeRO stage 2): gradients reduce-scattered bucket by bucket during backward.

Buffers (owned here): one persistent shard-size gradient buffer per bucket, which the
optimizer's pieces' ``.grad`` are views of; and, during backward only, a small pool of
bucket-size staging buffers. A bucket takes a staging buffer when its first gradient arrives
(gradients are copied in and autograd's full-size ``.grad`` is released at once) and gives it
back, with the receive buffer of its reduce-scatter, when that finishes. One reduction is in
flight at a time and it is finished before the next takes its receive buffer, so the pool holds
at most three bucket-size buffers (the one filling, and the one in flight with its receive
buffer) whatever the model size; it is dropped when backward ends, so between steps a rank
holds only gradient shards. Parameters' own ``.grad`` is always None after backward.

Note: the pool exists because a fresh buffer for every bucket is slow on CPU. A 32 MiB bucket
is at glibc's largest mmap threshold, so each one is a new mapping, and the first write to
every 4 KiB page faults: measured at 165 ms per step for 108 MB of gradients on 2 ranks here,
against 10 ms for the same copy into reused memory (``benchmarks/step_time.py``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup

from .core.collectives import Pending, start_reduce_scatter_mean
from .core.flat_param import FlatParamBucket
from .grad_sync import BucketedGradSync


class StagingPool:
    """Reusable buffers of the largest bucket's size; a bucket uses a prefix of one."""

    def __init__(self, buckets: list[FlatParamBucket], dtype: torch.dtype | None = None):
        largest = max(buckets, key=lambda b: b.layout.padded_numel).layout
        self._numel, self._device = largest.padded_numel, largest.device
        self._dtype = dtype or largest.dtype
        self._free: list[torch.Tensor] = []
        self.buffers: list[torch.Tensor] = []  # every buffer ever made, for memory accounting

    def acquire(self, numel: int) -> torch.Tensor:
        if not self._free:
            self.buffers.append(torch.empty(self._numel, dtype=self._dtype, device=self._device))
            self._free.append(self.buffers[-1])
        return self._free.pop()[:numel]

    def release(self, buffer: torch.Tensor) -> None:
        self._free.append(buffer._base if buffer._base is not None else buffer)

    def clear(self) -> None:
        """Drop every buffer (all must have been released)."""
        assert len(self._free) == len(self.buffers), "a staging buffer is still in use"
        self._free, self.buffers = [], []


class ReduceScatterGrads(BucketedGradSync):
    max_in_flight = 1

    def __init__(
        self,
        buckets: list[FlatParamBucket],
        group: ProcessGroup,
        sync_comm: bool,
        reduce_dtype: torch.dtype | None = None,
    ):
        # in the masters' dtype (fp32 under mixed precision), whatever dtype they're reduced in
        self.grad_shards = [torch.zeros_like(b.shard_data) for b in buckets]
        self._full: list[torch.Tensor | None] = [None] * len(buckets)
        self.staging = StagingPool(buckets, reduce_dtype) if buckets else None
        super().__init__(buckets, group, sync_comm)

    def _full_buffer(self, b: int) -> torch.Tensor:
        if self._full[b] is None:
            bucket = self.buckets[b]
            full = self.staging.acquire(bucket.layout.padded_numel)
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
        scratch = self.staging.acquire(full.numel()) if self.group.size() > 1 else None
        # Always accumulate: zero_grad() zeroes the shard, and backwards between steps add up.
        pending = start_reduce_scatter_mean(
            full, self.grad_shards[b], self.group, accumulate=True, scratch=scratch
        )
        return pending.then(lambda: self._release(full, scratch))

    def _release(self, *buffers: torch.Tensor | None) -> None:
        for buffer in buffers:
            if buffer is not None:
                self.staging.release(buffer)

    def _end_of_backward(self) -> None:
        super()._end_of_backward()
        # Between steps a rank holds only gradient shards; the pool is rebuilt next backward
        # (from malloc's heap: buckets below its 32 MiB mmap threshold don't page-fault again).
        self.staging.clear()

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
