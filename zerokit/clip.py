"""``clip_grad_norm_`` across shards: the single-process global norm, each element counted once."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .core import all_reduce_, meet, state_of
from .grad_scope import grad_scope
from .tensor_parallel.gather_batch import distributed_params
from .tensor_parallel.layers import tensor_parallel_params, tp_group_of


def counted_grads(model: nn.Module, state, tp_group):
    """What a norm over ``model`` counts, each element once across its shards: (parameter,
    gradient) pairs (this rank's ZeRO pieces, or whole gradients; a parameter replicated
    across tp on tp rank 0 only), the groups their sums are reduced over (the ZeRO group, the
    tp group), and every gradient buffer a clip must scale (``clip_grad_norm_`` and the
    pipeline's clip count the same way). Rank-local parameters are not included."""
    if state is not None:
        owned = state.owned_grad_pieces()  # every element once across the ZeRO group
        groups = state.piece_groups  # (and its replicas, where they split the pieces too)
        to_scale = state.grads_to_scale()
    else:
        owned = [(p, p.grad) for p in model.parameters() if p.grad is not None]
        groups, to_scale = [], [g for _, g in owned]
    if tp_group is not None:
        groups.append(tp_group)
        if tp_group.rank() != 0:  # replicated parameters: the same gradient on every tp rank
            split = tensor_parallel_params(model)
            owned = [(p, g) for p, g in owned if id(p) in split]
    return owned, groups, to_scale


_EVERY_RANK = (
    ". clip_grad_norm_ is collective (the norm is summed over the ranks' shards): call it on "
    "every rank, after backward and before optimizer.step()"
)


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of a model wrapped by ``group_sharded_parallel`` (or of a bare
    tensor-parallel model, or of a ``PipelineModule`` or its stage, wrapped or not), like
    ``torch.nn.utils.clip_grad_norm_`` on the plain model; returns the total norm.

    Collective: every rank must call it (after backward, before ``optimizer.step()``); for a
    pipeline, every rank of every stage (the norm is the whole model's: summed over the
    stages, a tied weight counted on its first stage only).

    Rank-local (``is_distributed``) parameters hold a different slice on each rank: their
    squares are summed over the ranks that share them (a ``BatchGatherLinear``'s group, else
    the ZeRO group), each element once.
    """
    total, to_scale = global_grad_norm(model, norm_type, call="zerokit.clip_grad_norm_()")
    clip_coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for buffer in to_scale:
        buffer.mul_(clip_coef.to(buffer.dtype))
    return total


def global_grad_norm(
    model: nn.Module, norm_type: float = 2.0, only: set[int] | None = None, *, call: str
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The norm one process would compute over the gradients of ``model`` (of the parameters
    whose ids are in ``only``, if given: torch's clip over those parameters alone), and every
    buffer a clip must scale. Collective."""
    scope = grad_scope(model) if only is None else None
    if scope is not None:  # a pipeline: this rank's stage, and the stages holding the rest
        model = scope.holder
    state = state_of(model)
    tp_group = state.tp_group if state is not None else tp_group_of(model)
    if state is not None:
        state.check_ready_for_step()
        state.presence.mark(call)
        # before any collective: a rank that clips alone waits here, named, instead of
        # pairing its all-reduce with another call's collectives on the other ranks
        meet(call, state.process_group, _EVERY_RANK)
    elif tp_group is None and scope is None:
        raise TypeError(
            "clip_grad_norm_ takes a model returned by zerokit.group_sharded_parallel, one "
            "with tensor-parallel layers or a PipelineModule; use "
            "torch.nn.utils.clip_grad_norm_ for a plain model"
        )
    left_out = scope.left_out if scope is not None else frozenset()

    def counted(p: nn.Parameter) -> bool:
        return (only is None or id(p) in only) and id(p) not in left_out

    owned, groups, to_scale = counted_grads(model, state, tp_group)
    local: dict[int, tuple] = {}  # id(group) -> (group, its rank-local gradients)
    if state is not None:
        for d in distributed_params(model).values():
            if d.param.grad is not None and counted(d.param):
                group = d.group if d.group is not None else state.process_group
                local.setdefault(id(group), (group, []))[1].append(d.param.grad)
    grads = [g for p, g in owned if counted(p)]
    first = next(model.parameters(), None)  # a stage of functions only holds none
    device = grads[0].device if grads else first.device if first is not None else "cpu"
    norm_type = float(norm_type)
    is_max = norm_type == float("inf")
    op = dist.ReduceOp.MAX if is_max else dist.ReduceOp.SUM

    def partial(grads: list[torch.Tensor]) -> torch.Tensor:
        parts = [
            g.abs().max().float() if is_max else g.float().abs().pow(norm_type).sum() for g in grads
        ]
        total = torch.zeros((), device=device)
        if parts:
            total = torch.stack(parts).max() if is_max else torch.stack(parts).sum()
        if state is not None:  # offloaded shards: reduce where the group communicates (the GPU)
            total = total.to(state.communication_device)
        return total

    total = partial(grads)
    for group in groups:
        all_reduce_(total, group, op=op)
    for group, local_grads in local.values():  # the same order on every rank: the model's
        part = partial(local_grads)
        all_reduce_(part, group, op=op)
        total = torch.maximum(total, part) if is_max else total + part
        to_scale = [*to_scale, *local_grads]
    for group in scope.across if scope is not None else ():  # the other stages' sums
        all_reduce_(total, group, op=op)
    if not is_max:
        total = total.pow(1.0 / norm_type)
    return total, to_scale
