"""The sharded optimizer: the user's optimizer, updating only this rank's pieces.

``shard_optimizer_`` converts the user's optimizer in place, as FSDP2 converts a module: its
class becomes a subclass of the original (``ShardedAdamW`` is still an ``AdamW``), each param
group keeps its dict (so ``lr`` and schedulers keep working) but holds this rank's 1-D pieces
instead of whole parameters, and existing state is sliced to match. Each piece's update is the
original elementwise algorithm on that slice, so the result equals the unsharded step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.distributed import ProcessGroup

from .core.collectives import start_all_gather_
from .core.flat_param import FlatParamBucket
from .grad_sync import BucketedGradSync


class ShardedOptimizer:
    """Mixed in front of the user's optimizer class."""

    _zerokit: OptimizerShardState

    def step(self, closure=None):
        state = self._zerokit
        state.grad_sync.check_ready_for_step()
        loss = super().step(closure)  # type: ignore[misc]
        state.after_step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._zerokit.grad_sync.zero_grad(set_to_none)


class OptimizerShardState:
    def __init__(
        self,
        grad_sync: BucketedGradSync,
        after_step: Callable[[], None],
        group_params: list[list[torch.Tensor]],
    ):
        self.grad_sync = grad_sync
        self.after_step = after_step  # what a level does once the shards are updated
        self.group_params = group_params  # each param group's whole parameters, as given
        # groups a per-step decision (the scaler's inf/nan skip) must be agreed over: the ZeRO
        # group, and the tp group when tensor-parallel ranks hold different gradients
        self.agree_groups = [grad_sync.group]


def gather_params(buckets: list[FlatParamBucket], group: ProcessGroup) -> None:
    """Every rank's updated shard to every rank: full parameters everywhere again."""
    for bucket in buckets:
        bucket.refresh_compute_shard()
    pending = [start_all_gather_(bucket.data, group) for bucket in buckets]
    for work in pending:
        work.finish()


def shard_optimizer_(
    optimizer: torch.optim.Optimizer,
    buckets: list[FlatParamBucket],
    grad_sync: BucketedGradSync,
    after_step: Callable[[], None],
) -> torch.optim.Optimizer:
    """Point ``optimizer`` at this rank's pieces, in place. Validation happens before this."""
    piece_of = {}  # id(original param) -> its pieces on this rank
    for bucket in buckets:
        for piece, piece_param in zip(bucket.pieces, bucket.param_pieces):
            param = bucket.params[piece.slot]
            shape = bucket.layout.slots[piece.slot].shape  # param.shape may be empty (stage 3)
            piece_of.setdefault(id(param), []).append((piece, piece_param, shape))

    group_params = [list(group["params"]) for group in optimizer.param_groups]
    old_state = optimizer.state
    new_state: dict = {}
    for group_dict in optimizer.param_groups:
        pieces = []
        for param in group_dict["params"]:
            for piece, piece_param, shape in piece_of.get(id(param), []):
                pieces.append(piece_param)
                if param in old_state:
                    new_state[piece_param] = _slice_state(old_state[param], shape, piece)
        group_dict["params"] = pieces
    optimizer.state.clear()
    optimizer.state.update(new_state)

    cls = type(optimizer)
    optimizer.__class__ = type(f"Sharded{cls.__name__}", (ShardedOptimizer, cls), {})
    optimizer._zerokit = OptimizerShardState(grad_sync, after_step, group_params)
    _repoint_scheduler_patch(optimizer)
    return optimizer


def _slice_state(state: dict, shape: tuple[int, ...], piece) -> dict:
    """A piece's share of a parameter's optimizer state: per-element tensors are sliced."""
    out = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and tuple(value.shape) == shape and value.dim() > 0:
            out[key] = value.detach().reshape(-1)[piece.start : piece.end].clone()
        elif isinstance(value, torch.Tensor):
            out[key] = value.detach().clone()
        else:
            out[key] = value
    return out


def _repoint_scheduler_patch(optimizer: torch.optim.Optimizer) -> None:
    # An LR scheduler created before wrapping replaced ``optimizer.step`` on the instance with a
    # wrapper around the *original* class's step, which would skip the sharded step. Re-wrap.
    if "step" not in vars(optimizer):
        return
    sharded_step = type(optimizer).step

    @functools.wraps(sharded_step)
    def step(*args, **kwargs):
        optimizer._opt_called = True
        return sharded_step(optimizer, *args, **kwargs)

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = step
