"""The four conjugate communication functions of tensor parallelism (Megatron's names).

Each is an identity at tp degree 1. ``copy_to`` and ``reduce_from`` are conjugates (identity
forward / all-reduce backward, and the reverse), as are ``scatter_to`` and ``gather_from``
(keep this rank's slice of the last dimension / concatenate every rank's slice).

Sequence parallelism adds three more over the sequence dimension, dim 0 of sequence-first
activations ``[s, b, h]``; inside a sequence-parallel region each tp rank holds ``[s/t, b, h]``,
its own consecutive block of positions. ``scatter_to_sequence_parallel_region`` and
``gather_from_sequence_parallel_region`` are conjugates (split / all-gather forward, all-gather /
reduce-scatter backward; split instead when what follows is replicated, not tensor-parallel),
and ``reduce_scatter_to_sequence_parallel_region`` replaces a row
layer's all-reduce (reduce-scatter forward, all-gather backward). A sequence length not
divisible by the tp degree is refused. Each takes ``dim``, the sequence dimension: 0 by
default, 1 for batch-first ``[b, s, h]`` models (Hugging Face's, under a plan's "sequence").
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..runtime.teardown import hand, hand_all


def _all_reduce(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    if group.size() == 1:
        return x
    x = x.contiguous().clone()
    dist.all_reduce(hand(x), group=group)
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
    dist.all_gather(hand_all(parts), hand(x), group=group)
    return torch.cat(parts, dim=-1)


def _check_sequence(x: torch.Tensor, size: int, dim: int = 0) -> None:
    if x.shape[dim] % size:
        layout = "[s, b, h]" if dim == 0 else "batch-first [b, s, h]"
        raise ValueError(
            f"sequence parallelism needs the sequence length (dim {dim} of {layout}) divisible "
            f"by the tp degree: {x.shape[dim]} is not divisible by {size}; pad the sequence"
        )


def _split_first(x: torch.Tensor, group: ProcessGroup, dim: int = 0) -> torch.Tensor:
    size = group.size()
    _check_sequence(x, size, dim)
    return x.chunk(size, dim=dim)[group.rank()].contiguous()


def _gather_first(x: torch.Tensor, group: ProcessGroup, dim: int = 0) -> torch.Tensor:
    if group.size() == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(group.size())]
    dist.all_gather(hand_all(parts), hand(x), group=group)
    return torch.cat(parts, dim=dim)  # [s, ...] from every rank's [s/t, ...]


def _reduce_scatter_first(x: torch.Tensor, group: ProcessGroup, dim: int = 0) -> torch.Tensor:
    """Sum over the group, keep this rank's block of ``dim``. An all-to-all of the blocks and
    a local sum: on gloo that is faster than its reduce_scatter (see core/collectives.py)."""
    size = group.size()
    if size == 1:
        return x
    _check_sequence(x, size, dim)
    if dim != 0:  # the all-to-all splits dim 0
        return _reduce_scatter_first(x.movedim(dim, 0), group).movedim(0, dim).contiguous()
    x = x.contiguous()
    received = torch.empty_like(x)  # block r of every rank, in rank order
    dist.all_to_all_single(hand(received), hand(x), group=group)
    return received.view(size, x.shape[0] // size, *x.shape[1:]).sum(dim=0)


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


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split_first(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first(grad, ctx.group, ctx.dim), None, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad, dim):
        ctx.group, ctx.partial, ctx.dim = group, tensor_parallel_output_grad, dim
        return _gather_first(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        back = _reduce_scatter_first if ctx.partial else _split_first
        return back(grad, ctx.group, ctx.dim), None, None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter_first(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _gather_first(grad, ctx.group, ctx.dim), None, None


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


def scatter_to_sequence_parallel_region(
    x: torch.Tensor, group: ProcessGroup, dim: int = 0
) -> torch.Tensor:
    """Forward: this rank's block of the sequence, ``[s, b, h] -> [s/t, b, h]`` (the input is
    the same on every rank). Backward: all-gather the blocks' gradients."""
    return _ScatterToSP.apply(x, group, dim)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, group: ProcessGroup, tensor_parallel_output_grad: bool = True, dim: int = 0
) -> torch.Tensor:
    """Forward: all-gather ``[s/t, b, h] -> [s, b, h]``. Backward (Megatron's flag): with
    ``tensor_parallel_output_grad`` the gathered tensor feeds a tensor-parallel op whose
    gradient on each rank is a partial sum, so reduce-scatter; without it, it feeds layers
    replicated on every tp rank, whose gradient is whole everywhere, so keep this rank's block."""
    return _GatherFromSP.apply(x, group, tensor_parallel_output_grad, dim)


def reduce_scatter_to_sequence_parallel_region(
    x: torch.Tensor, group: ProcessGroup, dim: int = 0
) -> torch.Tensor:
    """Forward: sum the partial ``[s, b, h]`` over the tp group and keep this rank's block
    ``[s/t, b, h]``. Backward: all-gather."""
    return _ReduceScatterToSP.apply(x, group, dim)
