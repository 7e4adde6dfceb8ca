"""Models built on the ``meta`` device: materialised and initialised where their shards live.

``group_sharded_parallel`` calls ``materialize`` for a model whose parameters are all on
``meta`` (built under ``torch.device("meta")`` or ``zerokit.empty_init()``). Every rank gives
the values one process would give: it adopts the random state of rank 0, gives each parameter
storage (one ``nn.Parameter`` under all its names: ties kept, the optimizer's references
kept) and runs ``init_fn`` over the modules in ``nn.Module.apply``'s order, children before
parent. The one-process reference is

    torch.manual_seed(s); with torch.device("meta"): model = Net()
    <storage for every parameter and buffer, ties kept>; model.apply(init_fn)

Note: at level ``'p_g_os'`` the walk materialises one unit at a time. On entering a unit's
module its parameters get storage; once ``init_fn`` has run on that module (so on its whole
subtree, children first) the rank copies its shard of each of the unit's buckets and the full
parameters go back to ``meta``. The root unit (parameters outside every unit, ties between
units) and frozen parameters are materialised first and kept to the end. So a rank holds its
shards plus the root unit and the unit being initialised (with its enclosing units, if units
nest). ``init_fn`` therefore sees, on a module, the parameters of that module's unit; using a
parameter of a unit already sharded (a parent reaching into a finished child) is an error,
never a silent no-op. Every rank runs the whole initialisation (random draws are sequential:
a rank cannot skip to its shard's numbers), paying its compute but not its memory.

Every rank must end with one model whatever ``init_fn`` draws from: each tensor's digest is
compared across ranks once every rank has finished; a whole tensor (frozen, the root unit's)
that differs takes rank 0's values, a unit's that differs (each rank kept only its shard of
its own draw) is refused by name (``_same_on_every_rank``).
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .core import (
    UnitPlan,
    all_reduce_,
    broadcast_,
    communication_device,
    gather,
    is_distributed,
    plan_groups,
)

InitFn = Callable[[nn.Module], None]
ShardKey = tuple[int, ...]  # the ids of a bucket's parameters, in slot order


class MetaInitError(RuntimeError):
    """Materialising a meta model failed on some rank; raised on every rank, the model left
    as it was given (parameters on ``meta``)."""


@contextlib.contextmanager
def empty_init() -> Iterator[None]:
    """Build a model with its **parameters** on ``meta`` and its buffers real.

    As accelerate's ``init_empty_weights``: buffers computed in ``__init__`` (rotary
    ``inv_freq``, causal masks) keep their values, while parameters take no memory until
    ``group_sharded_parallel`` materialises each rank's shards. A parameter's values drawn in
    ``__init__`` are discarded (each is made on the CPU, then moved to ``meta``); ``init_fn``
    (or ``reset_parameters``) sets them at wrap time.

    >>> import torch, zerokit
    >>> with zerokit.empty_init():
    ...     layer = torch.nn.BatchNorm1d(4)
    >>> layer.weight.device.type, layer.running_mean.device.type
    ('meta', 'cpu')
    """
    original = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            moved = type(param)(param.detach().to("meta"), param.requires_grad)
            moved.__dict__.update(param.__dict__)
            param = moved
        original(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def on_meta(model: nn.Module) -> bool:
    """True if every parameter is on ``meta``, False if none is; a mix is refused."""
    params = dict(model.named_parameters())
    meta = [n for n, p in params.items() if p.is_meta]
    if not meta:
        return False
    real = [n for n, p in params.items() if not p.is_meta]
    if real:
        raise ValueError(
            f"parameters are on more than one device: {len(meta)} on meta ({meta[:3]}, ...) "
            f"and {len(real)} not ({real[:3]}, ...); build the whole model under torch.device('meta') or "
            "zerokit.empty_init(), or give every parameter storage before wrapping"
        )
    return True


def reset_parameters(module: nn.Module) -> None:
    """The default ``init_fn``: the module's own ``reset_parameters()``, where it has one."""
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()


def materialize(
    model: nn.Module,
    plans: list[UnitPlan],
    *,
    shard_params: bool,
    group: ProcessGroup,
    replica_group: ProcessGroup | None,
    buffer_max_size: int,
    init_fn: InitFn | None,
    needs: dict | None = None,
    sub_shards: int = 1,
) -> dict[ShardKey, torch.Tensor] | None:
    """Collective. Give the meta ``model`` its initial values; with ``shard_params`` (level
    ``'p_g_os'``) return this rank's shard of every bucket (keyed by its parameters' ids) and
    leave each bucketed parameter as a storage-less placeholder of its shape, else materialise
    every parameter and return None. On any rank's failure: ``MetaInitError`` on every rank, model restored.
    ``sub_shards``: the layouts' (``CoreOptions.optimizer_replicas``), so the shards fit them."""
    groups = [g for g in (replica_group, group) if g is not None]
    device = communication_device(group)
    saved = _Snapshot(model)
    rng = torch.get_rng_state()
    for g in groups:  # every rank draws rank 0's numbers, as if rank 0's model were broadcast
        torch.set_rng_state(broadcast_(torch.get_rng_state().to(device), g).cpu())
    walk = _Walk(
        model, plans if shard_params else [], group, buffer_max_size, device, needs, sub_shards
    )
    error = ""
    try:
        walk.run(init_fn or reset_parameters)
    except Exception as exc:  # reported on every rank below, never a hang in a collective
        error = f"{type(exc).__name__}: {exc}"
    report = _agree_on_failures(error, [group, replica_group])
    if not report:  # every rank is here: the collectives below pair up
        report = _same_on_every_rank(walk, device, [g for g in groups if g.size() > 1])
    if report:
        saved.restore()
        torch.set_rng_state(rng)
        raise MetaInitError(
            f"initialising the meta model failed: {report}. Nothing was wrapped; the model is "
            "still on meta"
        )
    return walk.finish() if shard_params else None


def _same_on_every_rank(walk: _Walk, device, groups: list[ProcessGroup]) -> str:
    """Every rank must start from one model, whatever ``init_fn`` draws from (a generator
    seeded by the rank, numpy's). Each tensor's digest, compared by one all-reduce (MAX of
    ``[d, -d]``) per group: a whole tensor (a frozen parameter, the root unit's) that differs
    takes rank 0's values, as one process of rank 0 would have them (buffers: the core
    broadcasts rank 0's); a unit's parameter, of which each rank kept only its shard of its
    own draw, cannot, and is refused by name."""
    if not groups or not walk.check:  # 'os'/'os_g': the core broadcasts rank 0's model
        return ""
    names, digests = zip(*walk.digests) if walk.digests else ((), ())
    both = torch.tensor([*digests, *(-d for d in digests)], dtype=torch.int64, device=device)
    for g in groups:
        all_reduce_(both, g, op=dist.ReduceOp.MAX)
    n, both = len(digests), both.tolist()  # one read back
    differ = [names[i] for i in range(n) if both[i] != -both[n + i]]
    sharded = [name for name in differ if name in walk.sharded_names]
    if sharded:
        return (
            f"init_fn gave {len(sharded)} parameter(s) different values on different ranks "
            f"({sharded[:5]}): it draws from a generator seeded by the rank (a "
            "torch.Generator, numpy, random). At level 'p_g_os' each rank keeps only its "
            "shard of them, so rank 0's values cannot be taken: seed that generator the same "
            "on every rank (zerokit gives torch's global generator rank 0's state), or wrap "
            "at 'os' / 'os_g', which broadcast rank 0's model"
        )
    whole = dict(walk.whole())
    with torch.no_grad():
        for name in differ:
            for g in groups:  # the replicas' rank 0, then the shard group's: global rank 0's
                broadcast_(whole[name].data, g)
    return ""


def _agree_on_failures(error: str, groups: list[ProcessGroup | None]) -> str:
    """Every rank's failures, known to every rank: first within the shard group, then that
    group's summary across its replicas (so every rank of the grid hears of every failure)."""
    report = f"rank {dist.get_rank()}: {error}" if error and dist.is_initialized() else error
    for g in groups:
        if g is not None:
            reports = gather("zerokit: initialising the meta model", report.encode(), g)
            report = "; ".join(dict.fromkeys(r.decode() for r in reports if r))
    return report


class _Snapshot:
    """Each module's parameter and buffer entries as given, to put back on failure."""

    def __init__(self, model: nn.Module):
        self.entries = [
            (m, kind, name, t, None if t is None or t.is_meta else t.detach().clone())
            for m in model.modules()
            for kind in ("_parameters", "_buffers")
            for name, t in getattr(m, kind).items()
        ]

    def restore(self) -> None:
        done: set[int] = set()
        for module, kind, name, tensor, values in self.entries:
            getattr(module, kind)[name] = tensor
            if tensor is None or id(tensor) in done:
                continue
            done.add(id(tensor))
            if values is not None:
                with torch.no_grad():
                    tensor.copy_(values)  # a real buffer init_fn may have changed
            elif not tensor.is_meta:
                _swap_storage(tensor, "meta")


def _swap_storage(
    t: torch.Tensor,
    device: torch.device | str,
    *,
    placeholder: bool = False,
    into: torch.Tensor | None = None,
) -> None:
    """Give ``t`` (a parameter or buffer, kept as the same Python object) new storage on
    ``device``: zeros (what a tensor ``init_fn`` leaves alone holds: the same on every rank,
    never another unit's leftovers), ``into`` (a view of the walk's arena, zeroed), on meta,
    or with ``placeholder`` one element seen at every index (the shape without the memory:
    the core reads only shapes, dtypes and devices of bucketed params)."""
    if into is not None:
        data = into.zero_()
    elif placeholder:
        data = torch.zeros((), dtype=t.dtype, device=device).expand(t.shape)
    elif torch.device(device).type == "meta":
        data = torch.empty(t.shape, dtype=t.dtype, device=device)
    else:
        data = torch.zeros(t.shape, dtype=t.dtype, device=device)
    if isinstance(t, nn.Parameter):
        new = type(t)(data, t.requires_grad)
    else:
        new = data.requires_grad_(t.requires_grad)
    new.__dict__.update(t.__dict__)  # swap_tensors swaps __dict__ too: keep t's attributes
    torch.utils.swap_tensors(t, new)


_ALIGN = 64  # bytes: every view into the arena starts aligned for any dtype


def _nbytes(params) -> int:
    return sum(-(-p.numel() * p.element_size() // _ALIGN) * _ALIGN for p in params)


class _Arena:
    """One buffer that holds every unit's full parameters while the walk initialises it.

    Note: units are entered and left last in, first out (a unit's module encloses the units
    inside it), so a unit's parameters are views into the top of a stack and leaving the unit
    pops them. The buffer is sized once to the deepest nesting (most often the largest unit)
    and allocated once: no allocation per unit or per parameter, whose freed blocks glibc's
    default malloc would keep resident (its mmap threshold rises to the largest block freed,
    and a heap gives back only its top), so the bound holds whatever the allocator."""

    def __init__(self, nbytes: int, device):
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.top = 0

    def take(self, params: list[nn.Parameter]) -> int:
        """Storage for ``params`` (those still on meta); returns the mark to pop back to."""
        mark = self.top
        for p in params:
            if p.is_meta:
                n = p.numel() * p.element_size()
                view = self.buffer[self.top : self.top + n].view(p.dtype).view(p.shape)
                _swap_storage(p, self.buffer.device, into=view)
                self.top += _nbytes([p])
        return mark

    def pop(self, mark: int) -> None:
        self.top = mark


def _arena_bytes(module: nn.Module, units: dict) -> int:
    """The most the arena holds at once: a unit's parameters plus its deepest nested unit's."""
    unit = units.get(id(module))
    own = _nbytes([p for _, p in unit[0].params]) if unit is not None else 0
    return own + max((_arena_bytes(c, units) for c in module.children()), default=0)


def _digest(t: torch.Tensor) -> int:
    """A CRC-32 of the tensor's bytes: equal values, equal digests; different ones collide
    with odds of 2**-32 (CRC-32: about 4x faster than blake2b here, near the cost of the
    ``normal_`` that drew them)."""
    return zlib.crc32(t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy())


def _shard_size(layout, rank: int) -> int:
    start, end = layout.shard_range(rank)  # uneven under the owner layout
    return end - start


class _Walk:
    """``nn.Module.apply``'s walk, materialising and sharding unit by unit on the way."""

    def __init__(self, model, plans, group, buffer_max_size, device, needs=None, sub_shards=1):
        self.model, self.device, self.rank = model, device, group.rank()
        # the layouts the core will build: the same owners and blocks (core/build.py)
        layouts = dict(
            plan_groups(plans, group.size(), buffer_max_size, needs=needs, replicas=sub_shards)
        )
        self.units = {id(p.module): (p, layouts[p]) for p in plans if p.module is not model}
        root = [(p, layouts[p]) for p in plans if p.module is model]
        self.root = root[0] if root else None
        in_units = {id(q) for plan, _ in self.units.values() for _, q in plan.params}
        # materialised first and kept to the end: everything but the non-root units' params
        self.first = [p for p in _unique_params(model) if id(p) not in in_units]
        self.sharded: dict[int, nn.Parameter] = {}  # placeholders to make at the end
        self.sharded_names: set[str] = set()  # of which each rank kept only its shard
        self.digests: list[tuple[str, int]] = []  # (name, digest): compared across ranks
        self.check = bool(plans)  # 'os'/'os_g': the core broadcasts rank 0's whole model
        self.names = {id(p): n for n, p in model.named_parameters()}
        # Note: every shard gets its storage here, before any parameter does. Allocated after
        # each unit's full parameters, the long-lived shards would pin the freed parameters'
        # heap pages (glibc's default malloc gives back only the top of its heap).
        self.shards: dict[ShardKey, torch.Tensor] = {
            _shard_key(plan, layout): torch.zeros(
                _shard_size(layout, self._rank(plan)), dtype=layout.dtype, device=device
            )
            for plan, layouts in [*self.units.values(), *([self.root] if self.root else [])]
            for layout in layouts
        }
        self.arena = _Arena(_arena_bytes(model, self.units), device)

    def run(self, init_fn: InitFn) -> None:
        for buf in _unique_buffers(self.model):
            if buf.is_meta:  # under torch.device("meta"): init_fn must set them
                _swap_storage(buf, self.device)
        self._materialize(self.first)
        self._visit(self.model, init_fn, "")
        if self.root is not None:
            self._check_in_place(self.root[0])
        left = [
            n for n, p in self.model.named_parameters() if p.is_meta and id(p) not in self.sharded
        ]
        left += [n for n, b in self.model.named_buffers() if b.is_meta]
        if left:
            raise ValueError(
                f"init_fn left {len(left)} tensor(s) on meta ({left[:10]}); it must fill "
                "parameters in place (nn.init.*_, tensor.copy_), not replace them"
            )
        if self.check:
            self.digests += [(n, _digest(p)) for n, p in self.whole()]

    def whole(self) -> list[tuple[str, torch.Tensor]]:
        """The parameters every rank holds whole until the end of the walk (frozen ones and
        the root unit's), rank-local ones left out (each rank's own by design). Buffers are
        the core's: it broadcasts rank 0's."""
        return [(self.names[id(p)], p) for p in self.first if not is_distributed(p)]

    def _visit(self, module: nn.Module, init_fn: InitFn, name: str) -> None:
        unit = self.units.get(id(module))
        if unit is not None:
            mark = self.arena.take([p for _, p in unit[0].params])
        for child_name, child in module.named_children():
            self._visit(child, init_fn, f"{name}.{child_name}" if name else child_name)
        own = getattr(module, "zerokit_init", None)  # a module initialised through another
        if callable(own):  # (split experts: zerokit.moe.expert_init), its meta use its own
            own(init_fn)
        else:
            with _NoMetaUse(name or "<root>"):
                init_fn(module)
        if unit is not None:
            self._check_in_place(unit[0])
            if unit[0].group is None:  # a unit on a group of its own: see _rank
                params = [(n, p) for n, p in unit[0].params if not is_distributed(p)]
                self.digests += [(n, _digest(p)) for n, p in params]
            self._shard(*unit)
            self.arena.pop(mark)

    def _materialize(self, params: list[nn.Parameter]) -> None:
        for p in params:
            if p.is_meta:
                _swap_storage(p, self.device)

    def _check_in_place(self, plan: UnitPlan) -> None:
        for name, p in plan.params:
            if self.model.get_parameter(name) is not p or p.is_meta:
                raise ValueError(
                    f"init_fn replaced parameter {name!r} (or left it on meta); it must fill "
                    "parameters in place (nn.init.*_, tensor.copy_), so that the optimizer "
                    "and tied names keep holding them"
                )

    def _rank(self, plan: UnitPlan) -> int:
        """This rank's place among the ranks ``plan`` is sharded over.

        Note: a unit on a group of its own (split experts: each ep rank holds other experts
        under the same names) is laid out over that group; its digests are not compared over
        the shard group, where ranks hold different tensors by design."""
        return plan.group.rank() if plan.group is not None else self.rank

    def _shard(self, plan: UnitPlan, layouts) -> None:
        """Keep this rank's shard of each of ``plan``'s buckets; the full values go back to
        meta (so a later use is caught by ``_NoMetaUse``)."""
        params = [p for _, p in plan.params]
        rank = self._rank(plan)
        for layout in layouts:
            start, _ = layout.shard_range(rank)
            shard = self.shards[_shard_key(plan, layout)]
            for piece in layout.pieces(rank):
                slot = layout.slots[piece.slot]
                at = slot.offset + piece.start - start
                flat = params[slot.param_index].detach().reshape(-1)
                shard[at : at + piece.numel].copy_(flat[piece.start : piece.end])
            for s in layout.slots:
                p = params[s.param_index]
                self.sharded[id(p)] = p
                self.sharded_names.add(self.names[id(p)])
                _swap_storage(p, "meta")

    def finish(self) -> dict[ShardKey, torch.Tensor]:
        """After every rank agreed: the root unit's shards kept, placeholders made."""
        if self.root is not None:
            self._shard(*self.root)
        for p in self.sharded.values():
            _swap_storage(p, self.device, placeholder=True)
        self.arena = None
        return self.shards


class _NoMetaUse(TorchDispatchMode):
    """Refuse any operation on a meta tensor while ``init_fn`` runs on one module: a
    parameter of another unit (not materialised yet, or already sharded)."""

    def __init__(self, where: str):
        super().__init__()
        self.where = where

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(isinstance(t, torch.Tensor) and t.is_meta for t in tree_leaves((args, kwargs))):
            raise ValueError(
                f"init_fn({self.where}) used a tensor on meta ({func}): at level 'p_g_os' a "
                "module's init_fn may use only the parameters of its own unit (units are "
                "initialised one at a time, children before parents, then sharded). "
                "Initialise each module's parameters in init_fn(module) itself"
            )
        return func(*args, **kwargs)


def _shard_key(plan: UnitPlan, layout) -> ShardKey:
    return tuple(id(plan.params[s.param_index][1]) for s in layout.slots)


def _unique_params(model: nn.Module) -> list[nn.Parameter]:
    return list(model.parameters())  # each tied parameter once


def _unique_buffers(model: nn.Module) -> list[torch.Tensor]:
    return list(model.buffers())
