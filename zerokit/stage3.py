"""Level 'p_g_os' (ZeRO stage 3): parameters too are sharded; each unit's flat bucket is
all-gathered by hooks just before the unit runs and freed after.

Buffers: every bucket keeps this rank's shard (``shard_data``, which the optimizer's pieces are
views of) for the whole run. Its full buffer ``data`` has storage only while gathered: the
parameters are views of ``data`` and freeing resizes the storage to zero, so a parameter used
outside its unit fails loudly instead of reading stale values. Gradients go through stage 2's
``ReduceScatterGrads`` unchanged; when a unit's reduce-scatter has started, its full parameters
are freed.

Hook order in one step (units U1..Uk in forward order, R the root unit):
  forward:  R pre-forward (gather R, prefetch U1) -> U1 pre-forward (wait U1, prefetch U2)
            -> U1 forward -> U1 post-forward (free U1; hook U1's outputs for backward) -> ...
            -> R post-forward (R stays gathered for backward; freed at once under no_grad)
  backward: Uk output-grad hook (gather Uk, prefetch Uk-1) -> Uk backward -> Uk's gradients
            accumulate -> Uk's reduce-scatter starts -> free Uk -> ... -> end of backward
            (finish every reduce-scatter, free R and anything still gathered)
  step:     the optimizer updates the shards; nothing to gather.

Note: every rank must run the same units in the same order: each gather is a collective.
"""

from __future__ import annotations

import enum
import functools

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.utils._pytree import tree_flatten

from .core.collectives import Pending, start_all_gather_
from .core.flat_param import FlatParamBucket
from .core.layout import BucketLayout
from .stage2 import ReduceScatterGrads
from .core.units import UnitPlan


class ParamState(enum.Enum):
    SHARDED = "sharded"  # only this rank's shard exists
    GATHERING = "gathering"  # an all-gather into the full buffer is in flight
    GATHERED = "gathered"  # full parameters usable


class ShardedParamBucket(FlatParamBucket):
    """A flat bucket whose full buffer exists only between ``start_unshard`` and ``reshard``.

    Note: freeing resizes the full buffer's *storage* to zero rather than dropping the tensor.
    Autograd keeps views of weights for backward (``weight.t()`` in a linear layer); those views
    share the storage, so memory really is freed between forward and backward, and gathering
    again refills the same storage before backward reads them. While sharded, each parameter
    points at an empty tensor: code that reads a parameter outside its unit's forward gets a
    shape error, never freed memory (use ``model.state_dict()`` for full values).
    """

    def __init__(
        self,
        layout: BucketLayout,
        params: list[nn.Parameter],
        rank: int,
        group: ProcessGroup,
        compute_dtype: torch.dtype | None = None,
        master_device: torch.device | None = None,
    ):
        super().__init__(layout, params, rank, compute_dtype, master_device)
        self.group = group
        self._nbytes = self.data.untyped_storage().nbytes()
        self._empty = self.data.new_empty(0)
        self._pending: Pending | None = None
        self.state = ParamState.GATHERED
        self.reshard()

    def _make_shard(self, full: torch.Tensor, own: bool, device: torch.device) -> torch.Tensor:
        # a tensor of its own: it outlives the full buffer
        return self.shard(full).to(device, copy=True)

    def start_unshard(self) -> None:
        if self.state is not ParamState.SHARDED:
            return
        self.data.untyped_storage().resize_(self._nbytes)
        self.shard(self.data).copy_(self.shard_data)
        self._pending = start_all_gather_(self.data, self.group)
        self.state = ParamState.GATHERING

    def wait_unshard(self) -> None:
        self.start_unshard()
        if self.state is ParamState.GATHERING:
            self._pending.finish()
            self._pending = None
            for i, param in enumerate(self.params):
                param.data = self.slot_view(self.data, i)
            self.state = ParamState.GATHERED

    def reshard(self) -> None:
        if self.state is ParamState.GATHERING:
            self.wait_unshard()  # never free memory a collective is writing into
        if self.state is ParamState.GATHERED:
            for param in self.params:
                param.data = self._empty
            self.data.untyped_storage().resize_(0)
            self.state = ParamState.SHARDED


class Unit:
    """A module whose buckets are gathered together and freed together."""

    def __init__(self, plan: UnitPlan, buckets: list[ShardedParamBucket]):
        self.name = plan.name
        self.module = plan.module
        self.keep_whole = plan.keep_whole
        self.buckets = buckets
        self.in_backward = False

    def start_unshard(self) -> None:
        for bucket in self.buckets:
            bucket.start_unshard()

    def wait_unshard(self) -> None:
        for bucket in self.buckets:
            bucket.wait_unshard()

    def reshard(self) -> None:
        if not self.keep_whole:
            for bucket in self.buckets:
                bucket.reshard()

    def gathered_numel(self) -> int:
        return sum(b.layout.padded_numel for b in self.buckets if b.state is not ParamState.SHARDED)


class ShardedParamGrads(ReduceScatterGrads):
    """Stage 2's gradient reduction, plus: free a unit's full parameters once its gradients are
    on their way, and free everything still gathered when backward ends."""

    def __init__(self, buckets, group, sync_comm, units: list[Unit], reduce_dtype=None):
        super().__init__(buckets, group, sync_comm, reduce_dtype)
        self.units = units
        # Buckets start in descending index order and a unit's buckets are contiguous, so a
        # unit's reductions have all started once its lowest-index bucket has.
        index = {id(b): i for i, b in enumerate(buckets)}
        self._unit_done_at = {min(index[id(b)] for b in u.buckets): u for u in units}

    def _start_reduce(self, b: int) -> Pending:
        pending = super()._start_reduce(b)
        if b in self._unit_done_at:
            self._unit_done_at[b].reshard()
        return pending

    def _end_of_backward(self) -> None:
        super()._end_of_backward()
        for unit in self.units:
            unit.in_backward = False
            unit.reshard()


class Stage3Runtime:
    """Registers and owns the forward/backward hooks of every unit; records the forward order
    of units to prefetch the next one (forward) or the previous one (backward)."""

    def __init__(self, model: nn.Module, units: list[Unit]):
        self.units = units
        self.root = next((u for u in units if u.module is model), None)
        self.forward_order: list[Unit] = []  # first calls of the last complete forward
        self._recording: list[Unit] | None = None
        self.peak_gathered_numel = 0  # the most parameters gathered at once during forwards
        self.handles = [
            model.register_forward_pre_hook(self._root_pre_forward),
            model.register_forward_hook(self._root_post_forward),
            model.register_state_dict_pre_hook(self._gather_for_io),
            # torch tags this hook with an attribute, which a bound method cannot take
            model.register_state_dict_post_hook(
                functools.partial(Stage3Runtime._after_state_dict, self)
            ),
            model.register_load_state_dict_pre_hook(self._gather_for_io),
            model.register_load_state_dict_post_hook(self._after_load),
        ]
        for unit in units:
            if unit is not self.root:
                self.handles.append(
                    unit.module.register_forward_pre_hook(
                        functools.partial(self._pre_forward, unit)
                    )
                )
                self.handles.append(
                    unit.module.register_forward_hook(functools.partial(self._post_forward, unit))
                )
        for unit in units:
            if unit.keep_whole:
                unit.wait_unshard()

    # -- forward -------------------------------------------------------------------------------
    def _root_pre_forward(self, module, args) -> None:
        self._recording = []
        self.peak_gathered_numel = 0
        if self.root is not None:
            self.root.wait_unshard()
        if self.forward_order:
            self.forward_order[0].start_unshard()

    def _root_post_forward(self, module, args, output) -> None:
        if self._recording is not None:
            self.forward_order, self._recording = self._recording, None
        if not torch.is_grad_enabled():  # no backward will come: leave nothing gathered
            for unit in self.units:
                unit.reshard()

    def _pre_forward(self, unit: Unit, module, args) -> None:
        unit.wait_unshard()
        if unit.in_backward:  # recomputation inside backward (activation checkpointing)
            return
        if self._recording is not None and unit not in self._recording:
            self._recording.append(unit)
        following = self._neighbour(unit, +1)
        if following is not None:
            following.start_unshard()
        self.peak_gathered_numel = max(self.peak_gathered_numel, self.gathered_numel())

    def _post_forward(self, unit: Unit, module, args, output):
        if unit.in_backward:
            return None
        unit.reshard()
        if torch.is_grad_enabled():
            hook = functools.partial(self._pre_backward, unit)
            for tensor in tree_flatten(output)[0]:
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(hook)
        return None

    # -- backward ------------------------------------------------------------------------------
    def _pre_backward(self, unit: Unit, grad: torch.Tensor) -> None:
        if not unit.in_backward:
            unit.in_backward = True
            unit.wait_unshard()
            previous = self._neighbour(unit, -1)
            if previous is not None:
                previous.start_unshard()

    def _neighbour(self, unit: Unit, step: int) -> Unit | None:
        order = self.forward_order
        if unit not in order:
            return None
        i = order.index(unit) + step
        return order[i] if 0 <= i < len(order) else None

    # -- between steps -------------------------------------------------------------------------
    def after_step(self) -> None:
        """The shards changed: drop any gathered copy, re-gather the units kept whole."""
        for unit in self.units:
            for bucket in unit.buckets:
                bucket.reshard()
            if unit.keep_whole:
                unit.wait_unshard()

    def gathered_numel(self) -> int:
        return sum(unit.gathered_numel() for unit in self.units)

    # -- state_dict: full tensors with the original keys, gathered on demand -------------------
    def _gather_for_io(self, *args, **kwargs) -> None:
        self._was_sharded = [u for u in self.units if u.gathered_numel() == 0]
        for unit in self.units:
            unit.wait_unshard()

    def _after_state_dict(self, module, state_dict, prefix, local_metadata) -> None:
        full = {b.data.untyped_storage().data_ptr() for u in self.units for b in u.buckets}
        for key, value in state_dict.items():
            if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in full:
                state_dict[key] = value.detach().clone()
        self._restore()

    def _after_load(self, module, incompatible_keys) -> None:
        with torch.no_grad():
            for unit in self.units:
                for bucket in unit.buckets:
                    if not bucket.separate_masters:  # else the fp32 masters were loaded directly
                        bucket.shard_data.copy_(bucket.shard(bucket.data))
        self._restore()

    def _restore(self) -> None:
        for unit in self._was_sharded:
            unit.reshard()
