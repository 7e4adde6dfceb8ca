"""Build the core for a validated model and optimizer: units -> buckets -> unit groups ->
``ShardState`` -> hooks -> the model and optimizer converted in place.

The level is decoded here, once (``LevelRules.decode``, which ``group_sharded_parallel`` calls
before anything changes): which gradients a group holds (full or sharded, and how they are
reduced) and how parameters are held (whole or stage 3's sharded). Nothing else asks which
level it is: the rest holds the objects built from the level's rules, or asks them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed import ProcessGroup

from ..mixed_precision import MixedPrecision
from . import checks
from .flat_param import FlatParamBucket
from .gradients import FullGradients, ScatteredGradients, ShardedGradients
from .group import UnitGroup
from .hooks import register_hooks
from .module import broadcast_module_state, convert_module_
from .optimizer import shard_optimizer_
from .optimizer_needs import Need
from .params import ShardedParams, WholeParams
from .reduction import (
    AllReduce,
    ReduceScatter,
    ReduceScatterThenAllReduce,
    ReduceScatterThenReduceScatter,
)
from .replica_sync import ReplicaSync
from .staging import StagingPool
from .state import ShardState
from .units import UnitPlan, plan_groups

_CPU = torch.device("cpu")  # where offload=True keeps master shards and optimizer state


@dataclass(frozen=True, kw_only=True)
class CoreOptions:
    rules: LevelRules
    group: ProcessGroup
    buffer_max_size: int
    sync_comm: bool
    sync_buffers: bool
    offload: bool
    mixed_precision: MixedPrecision
    tp_group: ProcessGroup | None
    replica_group: ProcessGroup | None = None  # hybrid sharding: replicas of this shard group
    debug_agreement: bool = False  # stage 3: check before every gather that ranks agree
    # a model built on meta ('p_g_os'): this rank's initial shard of each bucket, keyed by the
    # ids of its parameters (zerokit/meta_init.py); every rank computed them alike
    initial_shards: dict[tuple[int, ...], torch.Tensor] | None = None
    outer: nn.Module | None = None  # what the user passed: a torch.compile wrapper of the model
    # id(parameter) -> what its optimizer needs of the layout (core/optimizer_needs.py)
    needs: dict[int, Need] | None = None
    # hybrid sharding: the optimizer state sharded over the replicas too (each steps 1/R of
    # its shard: ShardingConfig.shard_optimizer_over_replicas); no-op without replicas
    optimizer_over_replicas: bool = False
    # modules whose tensors start from their own group's rank 0, trainable or frozen (a
    # layer's split experts: world rank 0 holds other experts); their units' groups
    own_groups: Mapping[nn.Module, ProcessGroup] = field(default_factory=dict)

    @property
    def optimizer_replicas(self) -> int:
        """Sub-shards per shard: the replica group's size where the optimizer state is sharded
        over it, else 1."""
        if not self.optimizer_over_replicas or self.replica_group is None:
            return 1
        return self.replica_group.size()


def _reduce_scatter(
    group: ProcessGroup, replicas: ProcessGroup | None, sync: ReplicaSync | None = None
) -> ReduceScatter:
    return ReduceScatterThenAllReduce(group, replicas, sync) if replicas else ReduceScatter(group)


_WHOLE_GRADS_OVER_REPLICAS = (
    "shard_optimizer_over_replicas needs the reduce-scatter of the gradients: whole_grads=True "
    "all-reduces whole gradients on every rank; drop one of them"
)


_NO_DEFER = (
    "defer_replica_sync() (and no_sync_defers_replica_sync) cannot be combined with "
    "shard_optimizer_over_replicas yet: each replica keeps only its sub-shard of the gradient, "
    "so there is no shard to accumulate into between micro-batches. Use no_sync() for the "
    "accumulating micro-batches (the same bytes across hosts, unsharded gradients held), or "
    "turn shard_optimizer_over_replicas off"
)


@dataclass(frozen=True)
class LevelRules:
    """A level, decoded: what varies between the stages, as the classes to build."""

    name: str  # 'os', 'os_g' or 'p_g_os': for reports and checkpoints
    gradients: type[FullGradients | ShardedGradients]  # what each unit group holds
    #: (shard group, replica group or None, the model's ReplicaSync) -> how the gradients are
    #: averaged
    reduction: Callable[..., AllReduce | ReduceScatter]
    params: type[WholeParams | ShardedParams]  # how the state holds parameters between uses

    @property
    def shard_params(self) -> bool:
        """Buckets free their full parameters between uses (stage 3)."""
        return self.params is ShardedParams

    @property
    def shard_grads(self) -> bool:
        """Each rank keeps only its shard of the reduced gradients (stages 2 and 3)."""
        return self.gradients is ShardedGradients

    def reduction_for(
        self,
        group: ProcessGroup,
        replicas: ProcessGroup | None,
        sub_shards: int,
        sync: ReplicaSync | None = None,
    ):
        """The reduction this level builds; ``sub_shards`` > 1 (the optimizer state sharded
        over the replicas): reduce-scatter across them, not all-reduce (its replica step is
        never deferred: ``ReplicaSync.cannot_defer``)."""
        if sub_shards == 1:
            return self.reduction(group, replicas, sync)
        if self.reduction is AllReduce:  # refused by ``check`` before anything changed
            raise ValueError(_WHOLE_GRADS_OVER_REPLICAS)
        return ReduceScatterThenReduceScatter(group, replicas)

    @staticmethod
    def decode(level: str, *, whole_grads: bool = False) -> LevelRules:
        """``whole_grads`` (``ShardingConfig``'s): 'os' all-reduces, so ``.grad`` is whole."""
        if not isinstance(whole_grads, bool):
            raise TypeError(f"whole_grads must be True or False, got {whole_grads!r}")
        if whole_grads and level != "os":
            raise ValueError(
                f"whole_grads only applies to level 'os' (stage 1), not {level!r}: at 'os_g' and "
                "'p_g_os' each rank keeps only its shard of the gradient; drop whole_grads"
            )
        if level == "os":  # stage 1: the full gradient buffer kept, the paper's reduce-scatter
            if whole_grads:  # or all-reduced, so every rank's .grad is the whole average
                return LevelRules(level, FullGradients, AllReduce, WholeParams)
            return LevelRules(level, ScatteredGradients, _reduce_scatter, WholeParams)
        # stages 2 and 3: this rank's shard of the gradients, reduce-scattered (hybrid: then
        # all-reduced across replicas)
        if level == "os_g":
            return LevelRules(level, ShardedGradients, _reduce_scatter, WholeParams)
        if level == "p_g_os":
            return LevelRules(level, ShardedGradients, _reduce_scatter, ShardedParams)
        raise ValueError(
            f"unknown level {level!r}; valid levels: 'os' (stage 1), 'os_g' (stage 2), "
            "'p_g_os' (stage 3), or the stage numbers 1, 2, 3"
        )

    def check(self, *, step_in_backward: bool, exclude_layer, over_replicas: bool = False) -> None:
        """Refuse the options this level cannot honour."""
        if over_replicas and self.reduction is AllReduce:
            raise ValueError(_WHOLE_GRADS_OVER_REPLICAS)
        if step_in_backward and issubclass(self.gradients, FullGradients):
            raise ValueError(
                "step_in_backward needs sharded gradients (level 'os_g' or 'p_g_os'), "
                f"not {self.name!r}"
            )
        if exclude_layer and not self.shard_params:
            raise ValueError(
                "exclude_layer only applies to level 'p_g_os' (stage 3): at 'os' and 'os_g' "
                "every rank keeps full parameters anyway"
            )


def build(
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    plans: list[UnitPlan],
    opts: CoreOptions,
) -> ShardState:
    """Everything that changes the model and optimizer happens here, after validation."""
    mp, group = opts.mixed_precision, opts.group
    local = [n for n, p in model.named_parameters() if checks.is_distributed(p)]
    if local and mp.param_dtype is not None:  # agreed: every rank raises it, before changes
        raise ValueError(
            f"rank-local (is_distributed) parameters {local[:3]} stay in their own dtype, "
            "outside zerokit's buckets, so mixed_precision cannot cast them for compute; cast "
            "the model to the compute dtype yourself, or train these models without a "
            "mixed_precision policy"
        )
    # every rank starts from rank 0's model: replica 0's, then shard-group rank 0's (each
    # rank keeps its own rank-local parameters: they are different slices)
    from_shards = opts.initial_shards is not None
    if opts.replica_group is not None:  # a replica is a copy: all of replica 0's
        broadcast_module_state(model, opts.replica_group, params=not from_shards)
    broadcast_module_state(
        model, group, params=not from_shards, own_groups=opts.own_groups
    )  # split experts from their own group's rank 0 (frozen ones too: no unit plans them)
    full_precision = [  # trainable ones are units of their own (plan.full_precision)
        m
        for m in model.modules()
        if mp.param_dtype is not None
        and isinstance(m, mp.full_precision_modules)
        and any(True for _ in m.parameters())
    ]
    _cast_frozen_params(model, mp.param_dtype, keep=full_precision)
    replicas = opts.replica_group
    rules = opts.rules
    device = next((p.device for plan in plans for _, p in plan.params), _CPU)
    staging = StagingPool(device)
    # one per model: its reductions and its state read it
    replica_sync = ReplicaSync(
        replicas, cannot_defer=_NO_DEFER if opts.optimizer_replicas > 1 else None
    )
    groups, root, units = _build_groups(model, plans, opts, staging, replica_sync)
    checks.remember_wrapped(model.parameters())
    state = ShardState(
        model,
        rules.name,
        group,
        groups,
        root,
        staging,
        rules.params(groups, sync_comm=opts.sync_comm, debug_agreement=opts.debug_agreement),
        tp_group=opts.tp_group,
        replica_group=replicas,
        sync_comm=opts.sync_comm,
        frozen=[(n, p) for n, p in model.named_parameters() if not p.requires_grad],
        replica_sync=replica_sync,
    )
    convert_module_(model, state)
    register_hooks(
        model,
        state,
        units,
        policy=mp,
        full_precision=[(m, next(m.parameters()).dtype) for m in full_precision],
        sync_buffers=opts.sync_buffers,
        outer=opts.outer if opts.outer is not None else model,
    )
    state.params.after_wrap(state)  # stage 3: gathers the units kept whole
    for optimizer in optimizers:
        shard_optimizer_(optimizer, state, opts.needs)
    return state


def _build_groups(
    model: nn.Module, plans: list[UnitPlan], opts: CoreOptions, staging, replica_sync
):
    """One ``UnitGroup`` per unit (its buckets, its gradients), the root unit's, and the
    (module, index) of every other unit, for the hooks."""
    mp, group, rules = opts.mixed_precision, opts.group, opts.rules
    reduce_dtype = mp.gradient_reduce_dtype()  # None: the parameters' own dtype
    sub_shards = opts.optimizer_replicas
    reduction = rules.reduction_for(group, opts.replica_group, sub_shards, replica_sync)
    groups, root, units = [], None, []
    for plan, layouts in plan_groups(
        plans, group.size(), opts.buffer_max_size, needs=opts.needs, replicas=sub_shards
    ):
        own = plan.group if plan.group is not None else group
        buckets = [
            FlatParamBucket(
                layout,
                [plan.params[s.param_index][1] for s in layout.slots],
                own,
                compute_dtype=None if plan.full_precision else mp.param_dtype,
                master_device=_CPU if opts.offload else None,
                shard_params=rules.shard_params,
                initial_shard=_initial_shard(opts, plan, layout),
                replica_group=opts.replica_group if sub_shards > 1 else None,
            )
            for layout in layouts
        ]
        shard_group = UnitGroup(
            plan.name,
            buckets,
            rules.gradients(
                buckets,
                reduction if plan.group is None else rules.reduction(plan.group, None),
                staging,
                reduce_dtype=reduce_dtype,
                tp_group=opts.tp_group,
                defer_staging=plan.module is model,  # the root unit: see gradients.py
            ),
            keep_whole=plan.keep_whole,
            tp_group=opts.tp_group,
        )
        if plan.module is model:
            root = shard_group
        else:
            units.append((plan.module, len(groups)))
        groups.append(shard_group)
    return groups, root, units


def _initial_shard(opts: CoreOptions, plan: UnitPlan, layout) -> torch.Tensor | None:
    if opts.initial_shards is None:
        return None
    return opts.initial_shards[tuple(id(plan.params[s.param_index][1]) for s in layout.slots)]


def _cast_frozen_params(model: nn.Module, dtype: torch.dtype | None, keep) -> None:
    if dtype is None:
        return
    kept = {id(p) for m in keep for p in m.parameters()}
    for p in model.parameters():
        if not p.requires_grad and p.is_floating_point() and id(p) not in kept:
            p.data = p.data.to(dtype)
