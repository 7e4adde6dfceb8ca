"""The wrapped model: the user's module, converted in place to also be a ``ShardedModule``.

As FSDP2 does, the model keeps its object identity, forward and ``state_dict`` keys; its class
becomes a subclass of the original that adds ``no_sync()``, DDP's
``require_backward_grad_sync`` switch, a ``zero_grad()`` that reaches zerokit's gradient
buffers and DDP's ``.module`` (the model itself). Stages 1-2 keep full parameters on
every rank (views of the flat buckets), so ``state_dict``/``load_state_dict`` work unchanged;
stage 3 adds state_dict hooks that gather on demand (``hooks.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
from torch import nn
from torch.distributed import ProcessGroup

from .checks import is_distributed
from .collectives import broadcast_
from .gradients import clear_own_grads
from .state import ShardState


class ShardedModule:
    """Mixed in front of the user's model class."""

    _zerokit: ShardState

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward after the block communicates.

        >>> # for x in micro_batches[:-1]:
        >>> #     with model.no_sync(): loss_fn(model(x)).backward()
        >>> # loss_fn(model(micro_batches[-1])).backward()   # reduces the accumulated sum
        """
        if self._zerokit.replica_sync.replaces_no_sync and self._zerokit.replica_sync.applies:
            with self.defer_replica_sync():  # no_sync_defers_replica_sync = True
                yield
            return
        state = self._zerokit
        previous, state.sync_enabled = state.sync_enabled, False
        try:
            yield
        finally:
            state.sync_enabled = previous

    @contextlib.contextmanager
    def defer_replica_sync(self) -> Iterator[None]:
        """Hybrid sharding: accumulate inside each shard group, cross replicas once per step.

        A backward inside reduce-scatters in the shard group and adds into the sharded
        gradient, but skips the cross-replica all-reduce; the first backward outside (the last
        micro-batch) averages the whole accumulated shard across replicas. Gradients stay
        sharded (unlike ``no_sync()``, which holds full ones). Without a replica group it
        changes nothing. ``optimizer.step()``, clipping and the scaler refuse until the
        boundary backward ran; ``zero_grad()`` drops what was accumulated.

        >>> # for x in micro_batches[:-1]:
        >>> #     with model.defer_replica_sync(): (loss_fn(model(x)) / k).backward()
        >>> # (loss_fn(model(micro_batches[-1])) / k).backward()   # crosses hosts once
        """
        sync = self._zerokit.replica_sync
        previous, sync.deferred = sync.deferred, True
        try:
            yield
        finally:
            sync.deferred = previous

    @property
    def requires_replica_sync(self) -> bool:
        """The switch behind ``defer_replica_sync()`` (FSDP2's ``set_requires_all_reduce``):
        False, each backward leaves the cross-replica average to the next backward with it
        True. Read by each backward, so set it before the backward."""
        return not self._zerokit.replica_sync.deferred

    @requires_replica_sync.setter
    def requires_replica_sync(self, value: bool) -> None:
        self._zerokit.replica_sync.deferred = not value

    @property
    def no_sync_defers_replica_sync(self) -> bool:
        """What ``no_sync()`` and ``require_backward_grad_sync = False`` mean under hybrid
        sharding; they are what Lightning's ``accumulate_grad_batches``, Fabric's
        ``no_backward_sync`` and accelerate's (HF Trainer's) accumulation call. False (the
        default, DDP's meaning): nothing is reduced, full gradients are held. True: they
        defer only the cross-replica reduction, as ``defer_replica_sync()`` does. No effect
        without a replica group."""
        return self._zerokit.replica_sync.replaces_no_sync

    @no_sync_defers_replica_sync.setter
    def no_sync_defers_replica_sync(self, value: bool) -> None:
        sync = self._zerokit.replica_sync
        if value and sync.applies and sync.cannot_defer:
            raise ValueError(sync.cannot_defer)
        sync.replaces_no_sync = bool(value)

    @property
    def require_backward_grad_sync(self) -> bool:
        """DDP's switch, which HF accelerate and Lightning set to ``False`` on the accumulation
        steps: while False, backward accumulates gradients locally exactly as inside
        ``no_sync()`` (the same flag; with ``no_sync_defers_replica_sync``, the replica step's
        flag). Read by each backward, so set it before the backward."""
        if self._defers():
            return not self._zerokit.replica_sync.deferred
        return self._zerokit.sync_enabled

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        if self._defers():
            self._zerokit.replica_sync.deferred = not value
        else:
            self._zerokit.sync_enabled = bool(value)

    def _defers(self) -> bool:
        sync = self._zerokit.replica_sync
        return sync.replaces_no_sync and sync.applies

    def zero_grad(self, set_to_none: bool = True) -> None:
        """DDP loops and transformers' Trainer clear gradients with ``model.zero_grad()``:
        clear zerokit's gradient buffers too (torch's own would only reach ``param.grad``,
        leaving the buffers to add into the next step), as every optimizer's ``zero_grad()``
        together would; a parameter in no bucket (rank-local) is cleared as torch does."""
        state = self._zerokit
        state.zero_grad(set_to_none)
        bucketed = {id(p) for bucket in state.buckets for p in bucket.params}
        own = [p for p in self.parameters() if id(p) not in bucketed]  # type: ignore[attr-defined]
        clear_own_grads(own, set_to_none)

    def reduce_gradients(self) -> None:
        """Reduce the gradients accumulated under ``no_sync()`` without another backward
        (collective: every rank calls it). Then ``optimizer.step()`` as usual."""
        self._zerokit.reduce_unsynced()


def _itself(model: nn.Module) -> nn.Module:
    return model


def convert_module_(model: nn.Module, state: ShardState) -> nn.Module:
    cls = type(model)
    # DDP's ``model.module`` (nanoGPT's ``raw_model = model.module``, accelerate's unwrap): the
    # model is converted in place, so it is its own module, unless it has an attribute so named
    extra = {} if hasattr(model, "module") else {"module": property(_itself)}
    model.__class__ = type(f"Sharded{cls.__name__}", (ShardedModule, cls), extra)
    model._zerokit = state
    return model


def restore_module_(model: nn.Module) -> nn.Module:
    """Undo ``convert_module_``: the user's class again, and no state (``zerokit.unwrap``)."""
    sharded = type(model)
    model.__class__ = sharded.__bases__[1]  # (ShardedModule, the user's class)
    del model._zerokit
    return model


def broadcast_module_state(
    model: nn.Module,
    group: ProcessGroup,
    *,
    params: bool,
    own_groups: Mapping[nn.Module, ProcessGroup] | None = None,
) -> None:
    """Make every rank's buffers (and parameters, if ``params``) equal to group rank 0's;
    rank-local (``is_distributed``) tensors stay each rank's own: they are different slices.
    ``own_groups``: modules whose tensors come from their own group's rank 0 instead (a
    layer's split experts: group rank 0 holds other experts), trainable or frozen."""
    with torch.no_grad():
        seen = set()
        for module, own_group in (own_groups or {}).items():
            for tensor in (*module.buffers(), *(module.parameters() if params else ())):
                if id(tensor) not in seen:
                    seen.add(id(tensor))
                    broadcast_(tensor.data, own_group)
            seen.update(id(p) for p in module.parameters())  # not from ``group`` either
        tensors = list(model.buffers()) + (list(model.parameters()) if params else [])
        for tensor in tensors:
            if id(tensor) not in seen and not is_distributed(tensor):
                seen.add(id(tensor))
                broadcast_(tensor.data, group)
