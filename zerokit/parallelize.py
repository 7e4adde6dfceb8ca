"""``zerokit.parallelize``: an unmodified model onto a pp x dp x tp mesh, in one fixed order
(torchtitan's): the pipeline split (pp > 1), tensor parallelism by a plan, then ZeRO over dp.

Every check that can fail (plan and split-point names, styles, head and feature divisibility,
degrees against the world size) runs first, without communication, so a bad input raises the
same ``ValueError`` on every rank instead of leaving ranks waiting in a collective.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from .api import group_sharded_parallel
from .config import (
    DEFAULT_LEVEL,
    ShardingConfig,
    given_knobs,
    knob_names,
    merge_arguments,
    parse_level,
)
from .core import as_optimizer_list, needs_of, refuse_whole_on_slices
from .layout import Layout, as_layout, check_ep, init_mesh, mesh_dim_names
from .plans import BUILT_IN
from .runtime.world import ensure_process_group
from .strategy import Strategy
from .tensor_parallel.apply_plan import apply_plan, no_such_module, resolve_plan


def parallelize(
    model: nn.Module,
    optimizer,
    mesh=None,
    plan: dict[str, str] | str | None = None,
    level: str | int | None = None,
    split_points: list[str] | None = None,
    schedule: str | None = None,
    micro_batches: int | None = None,
    strategy: Strategy | None = None,
    *,
    config: ShardingConfig | None = None,
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Parallelize ``model`` and carry ``optimizer`` (built over its parameters; param groups
    and hyperparameters kept, no state yet) over to the result; returns both.

    Args:
        model: an ordinary ``nn.Module`` (a Hugging Face model as it is).
        optimizer: a fresh torch optimizer over ``model``'s parameters, or a list of them
            over disjoint parameters (Muon beside AdamW; a list comes back). Build LR
            schedulers from the returned ones.
        mesh: ``zerokit.init_mesh(dp=, tp=, pp=)`` or a ``DeviceMesh`` with dims named "pp",
            "dp", "tp". None: built from ``strategy``, else from ``$ZEROKIT_STRATEGY`` (set by
            ``zerokit launch --strategy``), else data parallelism over the whole world.
        plan: ``{module name pattern: style}`` or a built-in name ("llama", "gpt2"); see
            ``zerokit.tensor_parallel.apply_plan``. Needed when tp > 1.
        level: ZeRO level over dp: 'os', 'os_g' or 'p_g_os' (or 1, 2, 3); None: the one in
            ``config``, else ``zerokit.config.DEFAULT_LEVEL`` ('p_g_os').
        split_points: pp > 1: names of the modules where a new pipeline stage begins.
        schedule, micro_batches: the pipeline schedule and its micro-batches (pp > 1); None:
            the strategy's, else "1f1b" and 1.
        strategy: a ``zerokit.Strategy``: its degrees build the mesh, its recompute applies,
            and the fields it is given (level, schedule, micro-batches, plan, any ZeRO knob)
            fill the arguments above and ``config``.
        config: any ZeRO knob, a ``zerokit.ShardingConfig`` (``zerokit.load_config``'s).

    A setting given twice (an argument, the strategy, ``config``) is compared, whatever its
    value, the default too: the same value passes, another is refused naming both; None is
    "not given".
    """
    if strategy is None and mesh is None:
        strategy = Strategy.from_env()
    if strategy is not None and mesh is not None:
        raise ValueError("pass a mesh or a strategy, not both: the strategy builds its mesh")
    recompute = strategy is not None and strategy.recompute
    plan = _one_value("plan", plan, strategy)
    schedule = _one_value("schedule", schedule, strategy) or "1f1b"
    micro_batches = _one_value("micro_batches", micro_batches, strategy) or 1
    config = _one_config(config, strategy, level)
    ensure_process_group("parallelize")  # the world size below is the launched one
    optimizers = as_optimizer_list(optimizer)
    degrees = _degrees(mesh, strategy)
    _check_expert_parallel(model, degrees)
    plan = _plan_of(plan, degrees["tp"])
    if plan:  # the whole model: every name must exist; nothing is changed before the checks
        planned = resolve_plan(model, plan, degrees["tp"])
        if degrees["tp"] > 1:
            _refuse_whole_on_planned_slices(model, planned, optimizers)
    _check_split_points(model, split_points, degrees["pp"])
    _check_sequence_with_pp(plan, degrees["pp"])
    group_of = [_groups_by_name(model, opt) for opt in optimizers]
    if recompute:  # on the whole model, before any split: its blocks keep the setting
        _enable_recompute(model)
    layout = as_layout(mesh, "parallelize") if mesh is not None else init_mesh(**degrees)

    if layout.pp_degree > 1:
        model = _split(model, split_points, layout, schedule, micro_batches)
    stage = getattr(model, "stage", model)  # a pipeline's local stage, else the model
    if layout.tp_degree > 1 and plan:
        local = resolve_plan(stage, plan, layout.tp_degree, partial=layout.pp_degree > 1)
        apply_plan(stage, local, layout)  # a split finds its tied copies by name: still found
    _expert_parallel(stage, layout, strategy)  # after tp, before ZeRO (ep > 1)
    carried = [_carry_over(opt, stage, names) for opt, names in zip(optimizers, group_of)]
    model, carried, _ = group_sharded_parallel(
        model, carried, config=config, shard_group=layout.shard_group,
        replica_group=layout.replica_group,
    )  # fmt: skip
    return model, carried if isinstance(optimizer, (list, tuple)) else carried[0]


def _check_sequence_with_pp(plan, pp: int) -> None:
    if plan and pp > 1 and "sequence" in plan.values():
        raise ValueError(
            "a plan's 'sequence' style with pp > 1 is not supported yet (a stage boundary would "
            "carry one block of the sequence); drop the 'sequence' entries or use pp = 1"
        )


def _check_expert_parallel(model: nn.Module, degrees: dict[str, int]) -> None:
    """The run's ep (the strategy's or the mesh's), checked before anything changes: ep > 1
    runs on a dp-only mesh, over experts the plan knows."""
    ep = degrees["ep"]
    if ep == 1:
        return
    check_ep(ep, degrees["dp"], tp=degrees["tp"], pp=degrees["pp"])
    from .moe.plan import check_plan

    check_plan(model, ep)


def _expert_parallel(model: nn.Module, layout: Layout, strategy) -> None:
    """ep > 1 (the layout's): the experts split over its ep groups inside the shard group."""
    if layout.ep_degree == 1:
        return
    from .moe import apply_expert_parallel
    from .moe.groups import expert_groups_of_layout

    aux_loss = strategy.aux_loss if strategy is not None else "global"
    apply_expert_parallel(model, expert_groups_of_layout(layout), aux_loss=aux_loss)


def _one_value(name: str, argument, strategy: Strategy | None):
    """``parallelize``'s argument ``name``, or the strategy's when the argument is None; both
    given (the strategy's field given, not defaulted), differently: refused, naming both."""
    given = strategy is not None and name in given_knobs(strategy)
    held = getattr(strategy, name) if given else None
    if argument is not None and held is not None and argument != held:
        raise ValueError(
            f"{name} is given twice, as {name}= ({argument!r}) and by the strategy ({held!r}): "
            "give it once"
        )
    if argument is not None or strategy is None:
        return argument
    return getattr(strategy, name)


def _one_config(config: ShardingConfig | None, strategy: Strategy | None, level) -> ShardingConfig:
    """The ZeRO knobs of ``config``, the strategy (those it is given) and ``level``, merged (a
    knob given twice, differently, is refused naming both sources); no level anywhere: the
    strategy's, else ``DEFAULT_LEVEL``. Checked here, before anything is built or
    communicated."""
    fallback = DEFAULT_LEVEL
    if strategy is not None:
        if level is not None:  # compared with the strategy's here, to name both sources
            level = _one_value("level", parse_level(level), strategy)
        given = {k: getattr(strategy, k) for k in knob_names() if k in given_knobs(strategy)}
        config = merge_arguments(config, source="the strategy", **given)
        fallback = strategy.level
    config = merge_arguments(config, source="level=", level=level)
    return config if config.level is not None else replace(config, level=fallback)


def _refuse_whole_on_planned_slices(model: nn.Module, planned: dict[str, str], optimizers) -> None:
    """Before the plan changes anything: a parameter of a module the plan splits (every style
    but "replicate" and "sequence") stepped by Muon or Adafactor is refused."""
    modules = dict(model.named_modules())
    sliced = {
        id(p): f"{name}.{pname}" if name else pname
        for name, style in planned.items()
        if style not in ("replicate", "sequence")
        for pname, p in modules[name].named_parameters()
    }
    refuse_whole_on_slices(needs_of(optimizers), sliced)


def _degrees(mesh, strategy: Strategy | None) -> dict[str, int]:
    """The pp, dp, tp degrees, checked against the world size (no communication)."""
    world = dist.get_world_size()
    if strategy is not None:
        strategy.check_world(world)
        return {"dp": strategy.dp, "tp": strategy.tp, "pp": strategy.pp, "ep": strategy.ep}
    if mesh is None:
        return {"dp": world, "tp": 1, "pp": 1, "ep": 1}
    if isinstance(mesh, Layout):
        return {"dp": mesh.data_parallel[0], "tp": mesh.tp_degree, "pp": mesh.pp_degree,
                "ep": mesh.ep_degree}  # fmt: skip
    names = mesh_dim_names(mesh)
    size = {n: mesh.size(i) for i, n in enumerate(names)}
    return {"dp": size.get("dp", 1) * size.get("shard", 1), "tp": size.get("tp", 1),
            "pp": size.get("pp", 1), "ep": 1}  # fmt: skip


def _plan_of(plan, tp: int) -> dict[str, str] | None:
    if isinstance(plan, str):
        if plan not in BUILT_IN:
            raise ValueError(f"no built-in plan {plan!r}; the built-in plans: {sorted(BUILT_IN)}")
        plan = BUILT_IN[plan]()
    if tp > 1 and not plan:
        raise ValueError(
            f"tp = {tp} needs a plan saying which layers to split: plan=zerokit.plans.llama() "
            "(or .gpt2(), or your own {module pattern: style})"
        )
    return plan


def _check_split_points(model: nn.Module, split_points, pp: int) -> None:
    if pp > 1 and not split_points:
        raise ValueError(
            f"pp = {pp} needs split_points: the names of the {pp - 1} modules where a stage begins"
        )
    if pp == 1 and split_points:
        raise ValueError(f"split_points {split_points} given, but pp = 1: set pp in the mesh")
    modules = dict(model.named_modules())
    for name in split_points or ():
        if name not in modules:
            raise ValueError(no_such_module("split_points", name, modules))


def _split(model, split_points, layout, schedule, micro_batches):
    try:
        from .pipeline.split import split_model
    except ImportError as e:
        raise NotImplementedError(
            "parallelize with pp > 1 needs zerokit.pipeline.split (split_model), which this "
            "build does not have yet; use pp = 1, or build a PipelineModule by hand"
        ) from e
    return split_model(model, split_points, layout, schedule=schedule, micro_batches=micro_batches)


def _groups_by_name(model: nn.Module, optimizer) -> dict[str, int]:
    """Each parameter name of ``model`` -> the index of the optimizer's param group holding it
    (frozen parameters the optimizer does not hold are left out)."""
    if optimizer.state:
        raise ValueError(
            "parallelize carries over a fresh optimizer (param groups, hyperparameters), not "
            "its state: build it before training, or load its state after parallelize"
        )
    index = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
    names = {
        n: index[id(p)] for n, p in model.named_parameters(remove_duplicate=False) if id(p) in index
    }
    held = {id(p) for p in model.parameters()}
    if any(id(p) not in held for g in optimizer.param_groups for p in g["params"]):
        raise ValueError("the optimizer holds parameters that are not the model's")
    return names


def _carry_over(optimizer, model: nn.Module, group_of: dict[str, int]) -> torch.optim.Optimizer:
    """The same optimizer class, param groups and hyperparameters over the parallelized
    model's parameters, matched by name: a swapped tensor-parallel layer's slices and a
    pipeline stage's copy of a tied weight join their original's group; parameters on other
    pipeline stages are left out."""
    params: list[list[nn.Parameter]] = [[] for _ in optimizer.param_groups]
    seen = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if name in group_of and id(p) not in seen:
            seen.add(id(p))
            params[group_of[name]].append(p)
    old = [list(g["params"]) for g in optimizer.param_groups]
    if all(len(a) == len(b) and all(x is y for x, y in zip(a, b)) for a, b in zip(old, params)):
        return optimizer  # nothing was replaced or moved: the user's own optimizer
    groups = [
        {**group, "params": mine} for group, mine in zip(optimizer.param_groups, params) if mine
    ]
    try:
        return type(optimizer)(groups, **optimizer.defaults)
    except TypeError:  # a defaults key the constructor does not take: the groups carry them
        return type(optimizer)(groups)


def _enable_recompute(model: nn.Module) -> None:
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if enable is None:
        raise ValueError(
            f"recompute=True needs a model with gradient_checkpointing_enable() (Hugging Face); "
            f"{type(model).__name__} has none: wrap its blocks in torch.utils.checkpoint"
        )
    enable()
