"""The four conjugate communication functions of tensor parallelism (Megatron's names).

Each is an identity at tp degree 1. ``copy_to`` and ``reduce_from`` are conjugates (identity
forward / all-reduce backward, and the reverse), as are ``scatter_to`` and ``gather_from``
(keep this rank's slice of the last dimension / concatenate every rank's slice).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


def _all_reduce(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    if group.size() == 1:
        return x
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


def _split_last(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    size = group.size()
    if x.shape[-1] % size:
        raise ValueError(
            f"cannot split a last dimension of {x.shape[-1]} evenly across {size} tp ranks"
        )
    return x.chunk(size, dim=-1)[group.rank()].contiguous()


def _gather_last(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    if group.size() == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(group.size())]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=-1)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


def copy_to_tp_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Forward: identity. Backward: sum the gradient over the tp group (each rank's branch
    used the same input)."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Forward: sum the partial results over the tp group. Backward: identity."""
    return _ReduceFromTP.apply(x, group)


def scatter_to_tp_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Forward: this rank's equal slice of the last dimension. Backward: all-gather."""
    return _ScatterToTP.apply(x, group)


def gather_from_tp_region(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Forward: concatenate every rank's slice along the last dimension. Backward: split."""
    return _GatherFromTP.apply(x, group)
