"""Cutting a model into stage-3 units, and giving every trainable parameter to exactly one.

A unit is a module whose parameters are gathered together just before it runs and freed after.
Parameters outside every unit, and parameters shared between units (a tied embedding and
output head in different units), belong to the root unit, which stays gathered from the
model's forward to the end of its backward, so a shared parameter is there whenever any user
of it runs.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from torch import nn
from torch.distributed import ProcessGroup

from .bucket_layout import BucketLayout, ParamSpec, plan_buckets, with_owners
from .checks import is_distributed
from .optimizer_needs import Need


@dataclass(frozen=True)
class UnitPlan:
    """One unit: its module (the model itself for the root) and the parameters it owns."""

    name: str
    module: nn.Module
    params: tuple[tuple[str, nn.Parameter], ...]
    keep_whole: bool = False  # an ``exclude_layer``: gathered once and never freed
    full_precision: bool = False  # mixed precision leaves it in its own dtype (BatchNorm)
    # its own shard group (a layer's experts, over the expert-data-parallel ranks: zerokit/moe/);
    # None: the model's shard group
    group: ProcessGroup | None = None


def plan_units(
    model: nn.Module,
    trainable: Sequence[tuple[str, nn.Parameter]],
    *,
    segment_size: int,
    wrap: tuple[type[nn.Module], ...] = (),
    exclude: Sequence[nn.Module | type[nn.Module]] = (),
    full_precision: tuple[type[nn.Module], ...] = (),
    shape_of: Callable[[nn.Parameter], tuple[int, ...]] | None = None,
    own_groups: Mapping[nn.Module, ProcessGroup] | None = None,
) -> list[UnitPlan]:
    """Units in the order of their first parameter's registration; the root unit included.

    Default policy: every child of an ``nn.ModuleList``/``nn.Sequential`` (the repeated blocks),
    and every module whose own (direct) parameters reach ``segment_size`` elements. With
    ``wrap``, instances of those classes instead of the list children (modules reaching
    ``segment_size`` still become units). A container that is never called (``_never_called``:
    a ``ModuleDict`` block in a ``ModuleList``) is never a unit, whatever the policy: its
    children take its place (a list's children's children are then the blocks). ``exclude``
    (modules or classes) become units that are kept whole, gathered without being called.
    Rank-local (``is_distributed``) parameters belong to no unit.
    ``shape_of``: a parameter's true shape, where it differs from ``p.shape`` (the parameters
    of a model wrapped at 'p_g_os' are empty between uses); default ``p.shape``.
    ``own_groups``: modules that are units of their own (inside another unit or not), sharded
    over the process group given for each instead of the model's (an MoE layer's experts).
    """
    shape_of = shape_of or _shape
    trainable = [(n, p) for n, p in trainable if not is_distributed(p)]
    chosen: list[tuple[str, nn.Module, bool]] = []

    def is_excluded(module: nn.Module) -> bool:
        return any(module is e or (isinstance(e, type) and isinstance(module, e)) for e in exclude)

    def visit(prefix: str, module: nn.Module, in_list: bool) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            has_params = any(_shared(p) for p in child.parameters())
            if not has_params:
                continue
            if is_excluded(child):
                chosen.append((path, child, True))
            elif _never_called(child):  # its children run instead: they are the units
                visit(path + ".", child, in_list or isinstance(child, nn.ModuleList))
            elif wrap and isinstance(child, wrap):
                chosen.append((path, child, False))
            elif (in_list and not wrap) or _own_numel(child, shape_of) >= segment_size:
                chosen.append((path, child, False))
            else:
                visit(path + ".", child, isinstance(child, nn.ModuleList | nn.Sequential))

    visit("", model, isinstance(model, nn.ModuleList | nn.Sequential))
    if wrap and not chosen:
        names = ", ".join(cls.__name__ for cls in wrap)
        warnings.warn(
            f"the wrap policy ({names}) matches no module of {type(model).__name__}: the whole "
            "model is one unit (gathered whole for forward and backward)",
            stacklevel=3,
        )
    if full_precision:
        taken = {id(m) for _, m, _ in chosen}
        chosen += [
            (name, m, False)
            for name, m in model.named_modules()
            if name
            and isinstance(m, full_precision)
            and id(m) not in taken
            and any(_shared(p) for p in m.parameters())
        ]
    plans = _with_own_groups(model, trainable, chosen, own_groups or {})
    if not full_precision:
        return plans
    return [
        replace(
            plan,
            full_precision=plan.module is not model and isinstance(plan.module, full_precision),
        )
        for plan in plans
    ]


def _with_own_groups(model, trainable, chosen, own_groups) -> list[UnitPlan]:
    """The units' plans, the modules of ``own_groups`` units of their own on their group."""
    own = {id(m): g for m, g in own_groups.items()}
    if own:
        chosen = [c for c in chosen if id(c[1]) not in own]
        chosen += [(name, m, False) for name, m in model.named_modules() if id(m) in own]
    plans = _assign_params(model, trainable, chosen)
    return [replace(plan, group=own.get(id(plan.module))) for plan in plans] if own else plans


def _never_called(module: nn.Module) -> bool:
    """Is ``module`` a container whose ``forward`` is ``nn.Module``'s own (``ModuleList``,
    ``ModuleDict``, ``ParameterList``, ``ParameterDict``)? Calling it raises, so no hook of it
    ever fires: it cannot be a unit, which is gathered when its module runs. Its children
    (blocks kept as a ``ModuleDict`` inside a ``ModuleList``, the forward reaching in:
    ``b["ln"](x)``) are looked at instead; parameters it holds itself go to the unit around it
    (or the root unit), whose module's forward reads them."""
    return type(module).forward is nn.Module.forward


def _shared(p: nn.Parameter) -> bool:
    """Trainable and not rank-local: ZeRO reduces, shards and steps it."""
    return p.requires_grad and not is_distributed(p)


def _shape(p: nn.Parameter) -> tuple[int, ...]:
    return tuple(p.shape)


def _own_numel(module: nn.Module, shape_of) -> int:
    return sum(math.prod(shape_of(p)) for p in module.parameters(recurse=False) if _shared(p))


def _assign_params(model, trainable, chosen) -> list[UnitPlan]:
    order = {id(p): i for i, (_, p) in enumerate(trainable)}
    holders: dict[int, set[int]] = {}  # parameter -> the units whose subtree holds it
    for u, (_, module, _) in enumerate(chosen):
        for p in module.parameters():
            holders.setdefault(id(p), set()).add(u)
    outside = _params_outside_units(model, {id(m) for _, m, _ in chosen})
    owned: list[list[tuple[str, nn.Parameter]]] = [[] for _ in chosen]
    root: list[tuple[str, nn.Parameter]] = []
    inside = {u: {id(m) for m in chosen[u][1].modules()} for u in range(len(chosen))}
    for name, p in trainable:
        units = holders.get(id(p), set())
        # the innermost unit: one that every other holder contains (nested units)
        innermost = [u for u in units if all(id(chosen[u][1]) in inside[v] for v in units)]
        if len(innermost) == 1 and id(p) not in outside:
            owned[innermost[0]].append((name, p))
        else:  # outside every unit, or shared between units: the root unit
            root.append((name, p))
    plans = [
        UnitPlan(name, module, tuple(params), keep)
        for (name, module, keep), params in zip(chosen, owned)
        if params
    ]
    if root:
        plans.append(UnitPlan("<root>", model, tuple(root)))
    return sorted(plans, key=lambda plan: order[id(plan.params[0][1])])


def _params_outside_units(module: nn.Module, unit_ids: set[int]) -> set[int]:
    """Parameters held directly by a module that is not inside any unit."""
    if id(module) in unit_ids:
        return set()
    found = {id(p) for p in module.parameters(recurse=False)}
    for child in module.children():
        found |= _params_outside_units(child, unit_ids)
    return found


def plan_groups(
    plans: Sequence[UnitPlan],
    world_size: int,
    buffer_max_size: int,
    shape_of: Callable[[nn.Parameter], tuple[int, ...]] | None = None,
    needs: Mapping[int, Need] | None = None,
    replicas: int = 1,
) -> list[tuple[UnitPlan, tuple[BucketLayout, ...]]]:
    """Each unit's flat buckets: one per dtype, split further at ``buffer_max_size`` elements
    (``shape_of`` as for ``plan_units``). ``needs``: ``id(parameter)`` -> what its optimizer
    needs of the layout (``core/optimizer_needs.needs_of``); owners are balanced over all
    the model's buckets together. ``replicas`` > 1: each shard cut into that many sub-shards
    (optimizer state sharded over replicas too: ``core/bucket_layout``), owners over all of them.

    >>> import torch
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    >>> named = list(model.named_parameters())
    >>> groups = plan_groups(plan_units(model, named, segment_size=2**20), 3, 16)
    >>> [(plan.name, [b.numel for b in buckets]) for plan, buckets in groups]
    [('0', [16, 4]), ('1', [10])]
    """
    shape_of = shape_of or _shape
    needs = needs or {}
    units = [
        [
            ParamSpec(n, tuple(shape_of(p)), p.dtype, p.device, **_need(needs.get(id(p))))
            for n, p in plan.params
        ]
        for plan in plans
    ]
    # a unit on a group of its own (split experts) is laid out over that group's size, with no
    # replicas (expert parallelism refuses hybrid sharding); the rest over world_size x replicas
    sizes = [
        (plan.group.size(), 1) if plan.group is not None else (world_size, replicas)
        for plan in plans
    ]
    for size in sorted(set(sizes)):  # owners over all units of one size at once, not in order
        ks = [k for k, s in enumerate(sizes) if s == size]
        specs = iter(with_owners([s for k in ks for s in units[k]], size[0] * size[1]))
        for k in ks:
            units[k] = [next(specs) for _ in units[k]]
    return [
        (plan, plan_buckets(unit, size, buffer_max_size, replicas=parts))
        for plan, unit, (size, parts) in zip(plans, units, sizes)
    ]


def _need(need: Need | None) -> dict:
    """A ``Need``'s layout fields, which ``ParamSpec`` takes by the same names (its
    ``whole_numel`` is for the optimizer alone: the layout plans the part a rank holds)."""
    fields = {} if need is None else dataclasses.asdict(need)
    fields.pop("whole_numel", None)
    return fields
