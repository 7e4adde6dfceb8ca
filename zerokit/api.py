"""``group_sharded_parallel``: the one call that shards a model and its optimizer.

Levels (PaddlePaddle's names; each means exactly what it says):

* ``'os'``   — stage 1: optimizer state sharded. Every rank keeps full parameters and a full
  gradient buffer; gradients are reduce-scattered bucket by bucket during backward into the
  rank's shard (``whole_grads=True``: all-reduced, so ``.grad`` is whole); each rank steps only
  its shard; updated shards are all-gathered so parameters stay identical.
* ``'os_g'`` — stage 2: stage 1 plus sharded gradients. Gradients are reduce-scattered bucket
  by bucket during backward; each rank keeps only its gradient shard.
* ``'p_g_os'`` — stage 3: parameters, gradients and optimizer state all sharded. The model
  is cut into units (repeated blocks by default); each unit's parameters are all-gathered by
  hooks just before it runs and freed after, gradients are reduce-scattered as in stage 2.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .clip import global_grad_norm
from .config import LEVELS as LEVELS  # re-exported: zerokit.LEVELS
from .config import (
    ShardingConfig,
    agreement_fields,
    debug_agreement,
    merge_arguments,
    resolve_level,
)
from .core import (
    CoreOptions,
    LevelRules,
    UnitPlan,
    agree_arguments,
    build,
    check_dense_gradients,
    check_not_wrapped,
    check_optimizer,
    is_stand_in,
    layout_summary,
    needs_of,
    plan_units,
    refuse_whole_on_slices,
    state_of,
    unwrap_compiled,
    with_whole_numel,
)
from .memory import format_bytes, measure
from .meta_init import materialize, on_meta
from .mixed_precision import MixedPrecision
from .moe.plan import expert_groups_of, expert_parts
from .pipeline.module import PipelineModule
from .runtime.world import ensure_process_group
from .scaler import ShardedGradScaler
from .tensor_parallel.layers import tensor_parallel_params, tp_group_of

_log = logging.getLogger("zerokit")


def group_sharded_parallel(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    level: str | int | None = None,
    scaler: Any = None,
    group: dist.ProcessGroup | None = None,
    offload: bool | None = None,
    sync_buffers: bool | None = None,
    buffer_max_size: int | None = None,
    segment_size: int | None = None,
    sync_comm: bool | None = None,
    dp_group: dist.ProcessGroup | None = None,
    exclude_layer: Sequence[Any] | None = None,
    *,
    mixed_precision: MixedPrecision | None = None,
    config: ShardingConfig | None = None,
    step_in_backward: bool | None = None,
    init_fn: Callable[[nn.Module], None] | None = None,
    shard_group: dist.ProcessGroup | None = None,
    replica_group: dist.ProcessGroup | None = None,
) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """Shard the optimizer state (from 'os_g' also gradients, at 'p_g_os' also parameters) of
    ``model`` across ``shard_group``.

    Every rank of ``shard_group`` must call this with the same model architecture. The model
    and the optimizer are converted in place and returned, with ``scaler`` unchanged. A model
    already compiled (``torch.compile(model)``) is returned as given, compiled, with the module
    inside it sharded and ``state_dict`` names free of ``_orig_mod.``. The signature is
    PaddlePaddle's; its knobs are ``ShardingConfig``'s fields, documented there once.

    Args:
        model: the model to train; its trainable parameters must all be on one device. A
            ``PipelineModule``: the stage this rank holds is sharded (as if ``model.stage``
            were given) and the ``PipelineModule`` is returned.
        optimizer: a torch optimizer over parameters of ``model``, or a list of them over
            disjoint parameters (Muon for the hidden matrices beside AdamW for the rest),
            returned as a list in the same order. Elementwise ones (SGD, Adam, AdamW, Adagrad,
            RMSprop, ...) step each rank's shard; whole-parameter ones (``torch.optim.Muon``,
            ``torch.optim.Adafactor``, or declared with ``ShardingConfig(
            whole_parameter_optimizer=True)``) step each parameter on the one rank that owns
            it whole; torchao's low-bit AdamW steps shards aligned to its quantization blocks.
            Create LR schedulers from them before or after.
        level: ``'os'`` (stage 1), ``'os_g'`` (stage 2) or ``'p_g_os'`` (stage 3), or the
            stage number 1, 2, 3; None reads ``$ZEROKIT_LEVEL``. See the module docstring.
        scaler: a loss scaler for fp16: a ``zerokit.ShardedGradScaler``, or a
            ``torch.amp.GradScaler`` (replaced by a ``ShardedGradScaler`` with its settings,
            which is returned), so the inf/nan check is agreed across ranks. A disabled one
            (``enabled=False``) stays disabled: nothing is scaled, as with torch's.
        group: Paddle's name for ``shard_group``.
        offload, sync_buffers, buffer_max_size, segment_size, sync_comm, exclude_layer,
            mixed_precision, step_in_backward: ``ShardingConfig``'s fields (None: not given).
        dp_group: Paddle's name for ``replica_group``.
        config: every knob in one ``ShardingConfig`` (``zerokit.load_config``'s); the
            arguments fill it (one given both ways differently, a default too: refused).
        init_fn: for a model built on ``meta`` (``torch.device("meta")`` or
            ``zerokit.empty_init()``): called on every module, children before parent, as
            ``model.apply(init_fn)``, to set its parameters (and, under
            ``torch.device("meta")``, its buffers) in place. None calls each module's
            ``reset_parameters()``. Every rank gets the values one process would get from
            rank 0's random state; at 'p_g_os' a rank materialises one unit at a time and
            keeps only its shards (see ``zerokit/meta_init.py``).
        shard_group: the ranks that split the state (Paddle's ``group``); None: the default
            group. ``layout.shard_group`` of a ``zerokit.Layout``.
        replica_group: hybrid sharding: the ranks holding copies of this rank's shards, on
            other hosts (Paddle's ``dp_group``): a gradient is reduce-scattered in
            ``shard_group``, then its shard all-reduced across ``replica_group`` ('os' with
            ``whole_grads=True``: all-reduced in both). ``layout.replica_group``.
    """
    call = _resolve(
        model, optimizer, scaler, init_fn, config,
        shard_group=_one_name(shard_group, group, "shard_group", "group"),
        replica_group=_one_name(replica_group, dp_group, "replica_group", "dp_group"),
        knobs={
            "level": level, "mixed_precision": mixed_precision, "offload": offload,
            "sync_buffers": sync_buffers, "buffer_max_size": buffer_max_size,
            "segment_size": segment_size, "sync_comm": sync_comm,
            "exclude_layer": exclude_layer, "step_in_backward": step_in_backward,
        },
    )  # fmt: skip
    return _build(call, _validate(call))


@dataclass(frozen=True)
class _Call:
    """A call's arguments, resolved (phase 1): the one config, the groups, the optimizers."""

    given: nn.Module  # what the user passed: a PipelineModule, a compiled model or the model
    model: nn.Module  # the module to shard (a pipeline's local stage, a compiled model's own)
    optimizer: Any  # as given: one optimizer or a list
    optimizers: list[torch.optim.Optimizer]
    config: ShardingConfig  # every knob, its level resolved
    shard_group: dist.ProcessGroup
    replica_group: dist.ProcessGroup | None  # as given (hybrid sharding), maybe of size 1
    scaler: Any
    init_fn: Callable[[nn.Module], None] | None
    meta: bool  # built on meta: materialised while sharding


@dataclass(frozen=True)
class _Checked:
    """What validation (phase 2) decided, for the build (phase 3)."""

    level: LevelRules
    scaler: ShardedGradScaler | None
    policy: MixedPrecision
    needs: dict
    named: list[tuple[str, nn.Parameter]]
    plans: list[UnitPlan]


def _one_name(ours, paddle, our_name: str, paddle_name: str):
    """A group given by our name or Paddle's (both are accepted), never both differently."""
    if ours is not None and paddle is not None and ours is not paddle:
        raise TypeError(
            f"{our_name} is given twice, as {our_name}= and as Paddle's {paddle_name}=: give "
            "it once"
        )
    return ours if ours is not None else paddle


def _resolve(model, optimizer, scaler, init_fn, config, *, shard_group, replica_group, knobs):
    """Phase 1: the arguments as one config, the groups and the optimizers (types checked,
    nothing changed)."""
    _check_argument_order(model, optimizer, init_fn)
    given = model
    if isinstance(model, PipelineModule):
        model = model.stage  # a rank holds, runs and shards only its own stage
    model = unwrap_compiled(model)  # shard the module torch.compile wraps
    # Paddle's positional signature is a thin layer: its knobs fill the one ShardingConfig
    config = merge_arguments(config, **knobs)
    config = replace(config, level=resolve_level(config.level))
    shard_group = _resolve_group(shard_group)
    _check_member(shard_group, "shard_group")
    if replica_group is not None:
        _check_member(replica_group, "replica_group")
    optimizers = _optimizer_list(optimizer)
    for opt in optimizers:
        check_not_wrapped(model, opt)
    meta = on_meta(model)
    if init_fn is not None and not meta:
        raise ValueError(
            "init_fn initialises a model built on meta (under torch.device('meta') or "
            "zerokit.empty_init()); this model's parameters already have values: drop init_fn"
        )
    return _Call(
        given, model, optimizer, optimizers, config, shard_group, replica_group, scaler,
        init_fn, meta,
    )  # fmt: skip


def _agree(call: _Call) -> None:
    """Every rank compares what it was given before anything else: a rank whose arguments or
    model differ makes the same error on every rank, never a hang or an abort inside gloo.
    Every knob is compared by its ``ShardingConfig`` name (a new field too)."""
    replicas = call.replica_group
    agree_arguments(
        {
            **agreement_fields(call.config, call.model),
            "scaler": type(call.scaler).__name__,
            "replica_group size": replicas.size() if replicas is not None else None,
            "built on meta": call.meta,
            "parameters": layout_summary(call.model),
            "optimizer": [
                (type(opt).__name__, [len(g["params"]) for g in opt.param_groups])
                for opt in call.optimizers
            ],
        },
        [call.shard_group] + ([replicas] if replicas is not None else []),
    )


def _validate(call: _Call) -> _Checked:
    """Phase 2: every check, agreed across ranks; nothing is changed, so each can fail
    without side effects."""
    model, config = call.model, call.config
    # tp ranks hold different slices (shapes): refuse a group spanning them before comparing
    _check_group_spans_no_tp_pair(model, call.shard_group)
    _agree(call)
    level = LevelRules.decode(config.level, whole_grads=config.whole_grads)  # decoded, once
    level.check(
        step_in_backward=config.step_in_backward, exclude_layer=config.exclude_layer,
        over_replicas=config.shard_optimizer_over_replicas,
    )  # fmt: skip
    scaler = _sharded_scaler(call.scaler)
    if config.step_in_backward and scaler is not None and scaler.is_enabled():
        raise ValueError(
            "step_in_backward cannot take a loss scaler: an fp16 overflow must skip the whole "
            "step, but each unit is stepped as soon as its gradients are reduced. Use bf16 "
            "(MixedPrecision(param_dtype=torch.bfloat16), no scaler) or step_in_backward=False"
        )
    policy = config.mixed_precision or MixedPrecision()
    for opt in call.optimizers:
        check_optimizer(
            opt, elementwise=config.elementwise_optimizer, whole=config.whole_parameter_optimizer
        )
    check_dense_gradients(model)
    if call.replica_group is not None:
        _check_group_spans_no_tp_pair(model, call.replica_group)
        _check_orthogonal(call.shard_group, call.replica_group)
    named = _trainable_params(model)
    _check_optimizer_params(model, call.optimizers)
    needs = needs_of(call.optimizers, whole_declared=config.whole_parameter_optimizer)
    split = tensor_parallel_params(model)
    refuse_whole_on_slices(needs, {id(p): n for n, p in model.named_parameters() if id(p) in split})
    experts = expert_groups_of(model)  # split experts: units on their own shard group
    if experts:
        _check_experts(call, experts, needs)
        needs = with_whole_numel(needs, expert_parts(model))  # torchao's rule: the unsplit
    plans = plan_units(
        model, named, segment_size=config.segment_size, wrap=config.wrap,
        exclude=config.exclude_layer,
        full_precision=policy.full_precision_modules if policy.param_dtype is not None else (),
        own_groups=experts,
    )  # fmt: skip
    return _Checked(level, scaler, policy, needs, named, plans)


def _check_experts(call: _Call, experts: dict, needs: dict) -> None:
    """Experts split across ep ranks (``zerokit.moe``): the dense parameters' shard group must
    be every data-parallel rank the experts' groups were made from, with no replicas; their
    optimizer steps elementwise."""
    dense = {m.groups.dense_group for m in experts}
    whole = [
        (f"{name}.{pname}", type(call.optimizers[needs[id(p)].optimizer]).__name__)
        for name, m in call.model.named_modules()
        if m in experts
        for pname, p in m.named_parameters()
        if id(p) in needs and needs[id(p)].whole
    ]
    if whole:
        (param, optimizer), *_ = whole
        raise ValueError(
            f"{optimizer} reads each parameter whole, and {param!r} is a rank's E / ep experts "
            "of a 3-D expert parameter: Adafactor scales its step by the whole parameter's "
            "RMS, Muon orthogonalises 2-D matrices (torch's refuses 3-D parameters; an "
            "expert-wise one needs each expert's matrix whole on one rank, not yet placed so), "
            "so its step would not be one process's. Step the experts with an elementwise "
            "optimizer (AdamW, torchao's low-bit AdamW) beside it for the rest, or use ep = 1"
        )
    problem = None
    if len(dense) != 1 or dist.get_process_group_ranks(next(iter(dense))) != (
        dist.get_process_group_ranks(call.shard_group)
    ):
        problem = "the shard group is not the data-parallel group the ep groups were made from"
    elif call.replica_group is not None and call.replica_group.size() > 1:
        problem = "hybrid sharding (a replica group) with split experts is not supported yet"
    if problem:
        raise ValueError(
            f"{problem}: shard the model with split experts over the ranks given to "
            "zerokit.moe.init_expert_groups (parallelize(..., strategy=Strategy(ep=...)) does)"
        )


def _build(call: _Call, checked: _Checked):
    """Phase 3: everything that changes the model and the optimizers."""
    model, config, group = call.model, call.config, call.shard_group
    replicas = call.replica_group if call.replica_group and call.replica_group.size() > 1 else None
    shards = None
    sub_shards = replicas.size() if replicas and config.shard_optimizer_over_replicas else 1
    # A dry run's stand-in ranks (``zerokit plan``) keep the model on meta: no values to make
    if call.meta and not is_stand_in(group):  # fails alike on every rank, leaving it on meta
        shards = materialize(
            model, checked.plans, shard_params=checked.level.shard_params, group=group,
            replica_group=replicas, buffer_max_size=config.buffer_max_size,
            init_fn=call.init_fn, needs=checked.needs, sub_shards=sub_shards,
        )  # fmt: skip
    compiled = call.given if not isinstance(call.given, PipelineModule) else call.given.stage
    options = CoreOptions(
        rules=checked.level, group=group, buffer_max_size=config.buffer_max_size,
        sync_comm=config.sync_comm, debug_agreement=debug_agreement(config),
        sync_buffers=config.sync_buffers, offload=config.offload,
        mixed_precision=checked.policy, tp_group=tp_group_of(model), replica_group=replicas,
        initial_shards=shards, outer=compiled, needs=checked.needs,
        optimizer_over_replicas=config.shard_optimizer_over_replicas,
        own_groups=expert_groups_of(model),
    )  # fmt: skip
    state = build(model, call.optimizers, checked.plans, options)
    state.grad_norm = global_grad_norm
    if config.step_in_backward:
        state.enable_step_in_backward(call.optimizers)
    if group.rank() == 0 and (call.replica_group is None or call.replica_group.rank() == 0):
        _log_wrap(state, call.optimizers, checked.named, model)
    optimizer = call.optimizer
    return (
        call.given,
        optimizer if isinstance(optimizer, torch.optim.Optimizer) else call.optimizers,
        checked.scaler,
    )


def num_params(model: nn.Module) -> int:
    """The model's parameter count, each tied parameter once, also at 'p_g_os' (where
    ``sum(p.numel() for p in model.parameters())`` counts 0 between uses: the parameters are
    empty there and live as shards)."""
    state = state_of(model)
    if state is None:
        return sum(p.numel() for p in model.parameters())
    in_buckets = {id(p) for b in state.buckets for p in b.params}
    outside = sum(p.numel() for p in model.parameters() if id(p) not in in_buckets)
    return outside + sum(s.numel for b in state.buckets for s in b.layout.slots)


def _log_wrap(state, optimizer, named, model) -> None:
    """One line at wrap time (DeepSpeed prints one too): what was built and what it holds.
    Silence it with ``logging.getLogger("zerokit").setLevel(logging.WARNING)``, before or
    after the first wrap: a level the user set is kept."""
    if not _log.handlers:  # a library's default: print to stderr unless told otherwise
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        _log.addHandler(handler)
        _log.propagate = False
    if _log.level == logging.NOTSET:  # only when nobody chose a level
        _log.setLevel(logging.INFO)
    if not _log.isEnabledFor(logging.INFO):
        return
    # at 'p_g_os' the parameters are empty now: count the bucket slots (each tied parameter
    # once) and, whole, the trainable parameters outside the buckets
    in_buckets = {id(p) for b in state.buckets for p in b.params}
    trainable = sum(s.numel for b in state.buckets for s in b.layout.slots) + sum(
        p.numel() for _, p in named if id(p) not in in_buckets
    )
    held = measure(model, optimizer)  # what this rank holds, each storage once
    names = {"os": "stage 1", "os_g": "stage 2", "p_g_os": "stage 3"}
    replicas = state.replica_group.size() if state.replica_group is not None else 1
    _log.info(
        "zerokit: level %r (%s) sharded over %d rank(s)%s: %d unit(s), %d bucket(s), "
        "%s trainable parameters; this rank holds %s of parameters, %s of gradients and %s "
        "of optimizer state so far",
        state.level,
        names[state.level],
        state.process_group.size(),
        f" x {replicas} replicas" if replicas > 1 else "",
        len(state.groups),
        len(state.buckets),
        f"{trainable:,}",
        format_bytes(held.params),
        format_bytes(held.grads),
        format_bytes(held.optimizer),
    )


def _check_argument_order(model, optimizer, init_fn) -> None:
    """The model first, then its optimizer(s): a swapped pair is named as such, not met later
    as a missing attribute (``_optimizer_list`` checks the optimizers themselves)."""
    given = model if isinstance(model, (list, tuple)) else [model]
    if isinstance(optimizer, nn.Module) and all(
        isinstance(o, torch.optim.Optimizer) for o in given
    ):
        raise TypeError(
            f"group_sharded_parallel takes the model first, then the optimizer: got "
            f"({type(model).__name__}, {type(optimizer).__name__}); call "
            "group_sharded_parallel(model, optimizer, level)"
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if init_fn is not None and not callable(init_fn):
        raise TypeError(f"init_fn must be a callable taking a module, got {init_fn!r}")
    _check_optimizer_instances(optimizer)


def _check_optimizer_instances(optimizer) -> None:
    """An optimizer class where its instance belongs (``torch.optim.AdamW`` for
    ``torch.optim.AdamW(model.parameters())``) is named as such: zerokit converts the user's
    optimizer in place, it never builds one."""
    given = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]
    for cls in given:
        if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer):
            name = cls.__name__
            raise TypeError(
                f"optimizer must be an optimizer instance, got the class {name}: build it over "
                f"the model's parameters first and pass that, e.g. "
                f"group_sharded_parallel(model, {name}(model.parameters(), lr=1e-3), level)"
            )


def _sharded_scaler(scaler):
    if scaler is None or isinstance(scaler, ShardedGradScaler):
        return scaler
    if isinstance(scaler, torch.amp.GradScaler):
        return ShardedGradScaler.like(scaler)
    raise TypeError(
        f"scaler must be a zerokit.ShardedGradScaler or torch.amp.GradScaler, got {type(scaler).__name__}"
    )


def _resolve_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    if group is not None:
        return group
    ensure_process_group("group_sharded_parallel")
    return dist.group.WORLD


def _check_member(group, what: str) -> None:
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(
            f"{what} is not a process group of this rank (got {group!r}: "
            "torch.distributed.new_group returns a placeholder on ranks outside the group); "
            f"pass the {what} this rank belongs to, e.g. layout.{what} of "
            "zerokit.init_hybrid_parallel"
        )


def _check_orthogonal(shard_group: dist.ProcessGroup, replica_group: dist.ProcessGroup) -> None:
    shards = dist.get_process_group_ranks(shard_group)
    replicas = dist.get_process_group_ranks(replica_group)
    both = set(shards) & set(replicas)
    if len(both) != 1:
        raise ValueError(
            f"shard_group (ranks {shards}) and replica_group (ranks {replicas}) must share "
            f"exactly this rank; they share {sorted(both)}. shard_group splits the state, "
            "replica_group holds copies of it: use layout.shard_group and layout.replica_group "
            "from zerokit.init_hybrid_parallel(dp_degree, tp_degree, sharding_degree)"
        )


def _check_group_spans_no_tp_pair(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Tensor-parallel ranks hold different slices of a layer: ZeRO must never average them."""
    tp_group = tp_group_of(model)
    if tp_group is None or tp_group.size() == 1:
        return
    shared = set(dist.get_process_group_ranks(tp_group)) & set(dist.get_process_group_ranks(group))
    if len(shared) > 1:
        raise ValueError(
            f"ranks {sorted(shared)} are in one tensor-parallel group and also in the group to "
            "shard across; they hold different slices of the tensor-parallel layers, which ZeRO "
            "would average. Shard along the data-parallel ranks: "
            "group_sharded_parallel(..., shard_group=layout.shard_group) (in Paddle's names, "
            "group=layout.dp_group)"
        )


def _trainable_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Trainable parameters in registration order, each once (tied parameters are shared)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # deduplicated
    devices = {p.device for _, p in named}
    if len(devices) > 1:
        listing = ", ".join(f"{n} on {p.device}" for n, p in named[:8])
        raise ValueError(
            f"trainable parameters are on more than one device ({listing}, ...); move the "
            "whole model to one device (model.to(device)) before group_sharded_parallel"
        )
    for name, p in named:
        if p.layout != torch.strided:
            raise ValueError(
                f"parameter {name!r} is not a dense tensor; zerokit shards dense tensors only"
            )
    return named


def _optimizer_list(optimizer) -> list[torch.optim.Optimizer]:
    """One optimizer, or a list or tuple of them (each over its own parameters)."""
    given = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else optimizer
    if isinstance(given, (list, tuple)) and given:
        wrong = [type(o).__name__ for o in given if not isinstance(o, torch.optim.Optimizer)]
        if not wrong:
            return list(given)
    else:
        wrong = [type(optimizer).__name__]
    raise TypeError(
        f"optimizer must be a torch.optim.Optimizer or a non-empty list of them, got {wrong}: "
        "call group_sharded_parallel(model, optimizer, level) (or [muon, adamw])"
    )


def _check_optimizer_params(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
    names = {id(p): n for n, p in model.named_parameters()}
    owner: dict[int, int] = {}
    for k, opt in enumerate(optimizers):
        for group in opt.param_groups:
            for p in group["params"]:
                if owner.setdefault(id(p), k) != k:
                    raise ValueError(
                        f"parameter {names.get(id(p), tuple(p.shape))!r} is in optimizers "
                        f"{owner[id(p)]} ({type(optimizers[owner[id(p)]]).__name__}) and {k} "
                        f"({type(opt).__name__}); each parameter must be stepped by one "
                        "optimizer: give the optimizers disjoint parameter sets"
                    )
    model_params = set(names)
    foreign = [
        (g, tuple(p.shape))
        for opt in optimizers
        for g, group in enumerate(opt.param_groups)
        for p in group["params"]
        if id(p) not in model_params
    ]
    if foreign:
        raise ValueError(
            f"the optimizer holds {len(foreign)} tensor(s) that are not parameters of the model "
            f"(param_group, shape): {foreign[:5]}; build the optimizer from model.parameters()"
        )
