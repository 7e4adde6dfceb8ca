"""``finalize_grads``: what a stage's gradients need after the schedule's last backward, before
any clip or step (Megatron's ``finalize_model_grads``). The one place a new cross-rank
reduction of a pipeline's gradients goes. In this order:

1. the sequence-parallel sum: a stage not wrapped by ZeRO has its ``sequence_parallel``
   marked gradients summed over its tp group (a wrapped stage's are summed by ZeRO's own
   reduction, step 3);
2. tied weights: each copy's gradient summed over the stages holding a copy, so that each
   holds the gradient of every use, as one process's single tensor would;
3. the data-parallel reduction of a wrapped stage: done by its last backward, overlapped with
   it, unless the backwards deferred it (every one ran under ``no_sync()``: a stage with a tied
   copy, whose sum of step 2 must come first, on whole gradients); then it runs here.

Clipping and loss scaling are not here: ``zerokit.clip_grad_norm_`` and the scalers do them as
without a pipeline, reducing over the stages where a norm or an overflow flag must be.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..core import state_of
from ..runtime.teardown import hand
from ..tensor_parallel.layers import allreduce_sequence_parallel_grads


def finalize_grads(
    stage: nn.Module, tied: list[tuple[nn.Parameter, dist.ProcessGroup]], deferred: bool
) -> None:
    """``tied``: this stage's copies of tied weights, each with the group of the ranks holding
    its other copies. ``deferred``: the stage is wrapped and its backwards ran under
    ``no_sync()``. Collective over those groups (and the tp, data-parallel groups)."""
    state = state_of(stage)
    if state is None:
        allreduce_sequence_parallel_grads(stage)
    _sum_tied(stage, tied)
    if deferred:
        stage.reduce_gradients()


def _sum_tied(stage: nn.Module, tied: list[tuple[nn.Parameter, dist.ProcessGroup]]) -> None:
    """Note: the copies of a tied weight are separate parameters on separate stages, each given
    the gradient of its own uses; one process's gradient is their sum. Under ZeRO these are
    still autograd's full, unreduced gradients (every backward ran in ``no_sync()``); a sum of
    averages is the average of sums, so the data-parallel reduction may come after."""
    if not tied:
        return
    state = state_of(stage)
    buckets = state.buckets if state is not None else []
    shapes = {id(p): s.shape for b in buckets for p, s in zip(b.params, b.layout.slots)}
    for weight, group in tied:
        if weight.grad is None:  # full shape even where ZeRO left the parameter empty
            shape = shapes.get(id(weight), weight.shape)
            weight.grad = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
        dist.all_reduce(hand(weight.grad), group=group)
