"""``clip_grad_norm_`` across shards: the single-process global norm, each element counted once."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .collectives import all_reduce_


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip the gradients of a model wrapped by ``group_sharded_parallel``, like
    ``torch.nn.utils.clip_grad_norm_`` on the unsharded model; returns the total norm.

    Collective: every rank must call it (after backward, before ``optimizer.step()``).
    """
    state = getattr(model, "_zerokit", None)
    if state is None:
        raise TypeError("clip_grad_norm_ takes a model returned by zerokit.group_sharded_parallel")
    grad_sync = state.grad_sync
    grad_sync.check_ready_for_step()
    grads = grad_sync.owned_grads()
    norm_type = float(norm_type)
    device = grad_sync.buckets[0].shard_data.device if grad_sync.buckets else torch.device("cpu")
    if norm_type == float("inf"):
        local = (
            torch.stack([g.abs().max() for g in grads]).max()
            if grads
            else torch.zeros((), device=device)
        )
        total = all_reduce_(local.float(), state.group, op=dist.ReduceOp.MAX)
    else:
        powered = [g.float().abs().pow(norm_type).sum() for g in grads]
        local = torch.stack(powered).sum() if powered else torch.zeros((), device=device)
        total = all_reduce_(local, state.group).pow(1.0 / norm_type)
    clip_coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for buffer in grad_sync.grads_to_scale():
        buffer.mul_(clip_coef.to(buffer.dtype))
    return total
