"""The layout of a run: which ranks hold which pipeline stage (pp), which ranks split a layer
(tp), which ranks shard the ZeRO state between them, and which hold the same state (replicas).
Built once by ``init_hybrid_parallel`` (or from a torch ``DeviceMesh``) and passed to whatever
needs it: tensor-parallel layers, ``ParallelCrossEntropy``, ``PipelineModule``. Nothing here
is module-level state: two layouts can live in one process.

Paddle's hybrid order, pp outermost and tp innermost (tp varies fastest, as Megatron's):
``rank = pp_rank * (dp * sharding * tp) + (dp_rank * sharding_degree + sharding_rank) *
tp_degree + tp_rank``, so a tp group is a run of neighbouring ranks and a sharding group the
next run out (on one node, where the frequent collectives belong), replicas are farther apart,
and the stages of a pipeline farthest (only point-to-point traffic crosses them). ``Grid`` does
this arithmetic, once, for every constructor and reader.

ZeRO needs two roles from a layout, and these are their only names: the **shard group**
``shard_group`` (the ranks a tensor's state is split over: ``group_sharded_parallel(
shard_group=...)``, Paddle's ``group=``) and the **replica group** ``replica_group`` (the ranks
holding copies of the same shards, None without hybrid sharding: ``replica_group=``, Paddle's
``dp_group=``). ``dp_group`` and ``sharding_group`` below are the mesh's dimensions, not roles:
which of them plays which role depends on ``sharding_degree``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch.distributed as dist
from torch.distributed import ProcessGroup

from .rng import RNGStatesTracker
from .runtime.world import ensure_process_group


@dataclass(frozen=True)
class Layout:
    """The process groups of a pp x dp x sharding x tp run and this rank's place in them."""

    dp_degree: int
    tp_degree: int
    dp_rank: int
    tp_rank: int
    dp_group: ProcessGroup
    """The ranks of the dp dimension: with ``sharding_degree == 1`` every rank holding the same
    tensor-parallel slices (ZeRO shards across them); with ``sharding_degree > 1`` the replicas
    of one sharding rank."""
    tp_group: ProcessGroup
    """Ranks that together hold one copy of every tensor-parallel layer."""
    sharding_degree: int = 1
    sharding_rank: int = 0
    sharding_group: ProcessGroup | None = None
    """Hybrid sharding: the ranks ZeRO shards across inside one replica (None when 1)."""
    pp_degree: int = 1
    pp_rank: int = 0
    """This rank's pipeline stage."""
    pp_group: ProcessGroup | None = None
    """The stages of this rank's pipeline, in stage order (None when ``pp_degree == 1``)."""
    ep_degree: int = 1
    """Expert parallelism, within the shard group: each MoE layer's experts split over this
    many neighbouring ranks (``zerokit.moe``); 1: experts sharded like dense parameters."""
    ep_group: ProcessGroup | None = None
    """The ranks that together hold every expert once (None when ``ep_degree == 1``)."""
    expert_dp_group: ProcessGroup | None = None
    """The ranks holding this rank's experts: the experts' shard group (shard / ep ranks)."""
    rng: RNGStatesTracker = field(default_factory=RNGStatesTracker, compare=False)
    """Named random streams of this layout (``LOCAL_SEED`` differs across tp ranks,
    ``GLOBAL_SEED`` does not); seeded by ``tensor_parallel.model_parallel_random_seed``."""

    @property
    def shard_group(self) -> ProcessGroup:
        """The ranks ZeRO shards a tensor's state over: ``group_sharded_parallel(group=...)``."""
        return self.sharding_group if self.sharding_group is not None else self.dp_group

    @property
    def replica_group(self) -> ProcessGroup | None:
        """The ranks holding the same shards (``replica_group=``, Paddle's ``dp_group=``);
        None without hybrid sharding."""
        return self.dp_group if self.sharding_degree > 1 else None

    @property
    def grid(self) -> Grid:
        """This layout's rank arithmetic."""
        return Grid(pp=self.pp_degree, dp=self.dp_degree, shard=self.sharding_degree,
                    tp=self.tp_degree)  # fmt: skip

    @property
    def data_parallel(self) -> tuple[int, int]:
        """(how many ranks see different batches, this rank's index among them): the dp and
        sharding dimensions together; tp ranks of one replica see the same batch."""
        return self.dp_degree * self.sharding_degree, (
            self.dp_rank * self.sharding_degree + self.sharding_rank
        )


@dataclass(frozen=True)
class Grid:
    """The rank arithmetic of a pp x dp x sharding x tp run, in one place (pure: no process
    group). Every constructor of a ``Layout`` and every reader of a rank's place uses it.

    >>> g = Grid(pp=2, dp=2, shard=1, tp=2)
    >>> g.rank(1, 0, 0, 1), g.coords(5)
    (5, (1, 0, 0, 1))
    """

    pp: int = 1
    dp: int = 1
    shard: int = 1
    tp: int = 1

    @property
    def size(self) -> int:
        return self.pp * self.dp * self.shard * self.tp

    def rank(self, p: int, d: int, s: int, t: int) -> int:
        """The global rank at stage ``p``, replica ``d``, shard ``s``, tp rank ``t``."""
        return ((p * self.dp + d) * self.shard + s) * self.tp + t

    def coords(self, rank: int) -> tuple[int, int, int, int]:
        """``rank``'s (pp, dp, shard, tp) indices: ``rank(*coords(rank)) == rank``."""
        rest, t = divmod(rank, self.tp)
        rest, s = divmod(rest, self.shard)
        p, d = divmod(rest, self.dp)
        return p, d, s, t

    def check(self, world: int) -> None:
        """Refuse degrees that are not integers >= 1 or whose product is not ``world``."""
        degrees = {"pp_degree": self.pp, "dp_degree": self.dp, "sharding_degree": self.shard,
                   "tp_degree": self.tp}  # fmt: skip
        bad = {k: v for k, v in degrees.items() if not isinstance(v, int) or v < 1}
        if bad:
            raise ValueError(f"degrees must be integers >= 1, got {bad}")
        if world % self.tp:
            raise ValueError(f"tp_degree {self.tp} does not divide the world size {world}")
        if world % (self.tp * self.pp):
            raise ValueError(
                f"tp_degree * pp_degree = {self.tp * self.pp} does not divide the world size "
                f"{world}"
            )
        if self.size != world:
            raise ValueError(
                f"pp_degree * dp_degree * sharding_degree * tp_degree = {self.pp} * {self.dp} * "
                f"{self.shard} * {self.tp} = {self.size}, but the world size is {world}; use "
                f"dp_degree={world // (self.tp * self.shard * self.pp)}"
            )


def init_hybrid_parallel(
    dp_degree: int, tp_degree: int, sharding_degree: int = 1, pp_degree: int = 1
) -> Layout:
    """Build the pp, dp, sharding and tp process groups (collective: every rank calls it, after
    ``torch.distributed.init_process_group``) and return them as a ``Layout``, to pass to
    whatever needs it (``layout=``).

    ``sharding_degree == 1`` (the two-argument call): ZeRO shards across ``layout.dp_group``
    (``layout.shard_group``; no replica group). ``sharding_degree > 1``: hybrid sharding,
    ``group_sharded_parallel(..., shard_group=layout.shard_group,
    replica_group=layout.replica_group)``: state sharded inside each sharding group (one node)
    and replicated across the ``dp_degree`` replicas. At 4 ranks, dp 2 x sharding 2: shard
    groups {0,1},{2,3}; replica groups {0,2},{1,3}.

    ``pp_degree > 1``: pipeline parallelism, outermost: every dp, sharding and tp group lies
    inside one stage, and ``layout.pp_group`` holds the stages of one pipeline. At 4 ranks,
    pp 2 x dp 2: stage 0 is ranks {0,1}, stage 1 {2,3}; dp groups {0,1},{2,3}; pp groups
    {0,2},{1,3}.
    """
    ensure_process_group("init_hybrid_parallel")
    grid = Grid(pp=pp_degree, dp=dp_degree, shard=sharding_degree, tp=tp_degree)
    grid.check(dist.get_world_size())
    pp_rank, dp_rank, sharding_rank, tp_rank = grid.coords(dist.get_rank())
    # new_group is collective over the whole world: every rank creates every group of every
    # stage, in the same order, and keeps those of its own stage.
    for p in range(pp_degree):
        groups = _stage_groups(grid, p)
        if p == pp_rank:
            tp_groups, sharding_groups, dp_groups = groups
    pp_group = _pp_groups(grid)[dp_rank, sharding_rank, tp_rank] if pp_degree > 1 else None
    return Layout(
        dp_degree,
        tp_degree,
        dp_rank,
        tp_rank,
        dp_groups[sharding_rank, tp_rank],
        tp_groups[dp_rank, sharding_rank],
        sharding_degree,
        sharding_rank,
        sharding_groups[dp_rank, tp_rank] if sharding_groups else None,
        pp_degree,
        pp_rank,
        pp_group,
    )


def _stage_groups(grid: Grid, p: int):
    """Stage ``p``'s tp, sharding and dp groups (collective: every rank builds every stage's)."""
    D, S, T = range(grid.dp), range(grid.shard), range(grid.tp)
    tp = {(d, s): dist.new_group([grid.rank(p, d, s, t) for t in T]) for d in D for s in S}
    sharding = (
        {(d, t): dist.new_group([grid.rank(p, d, s, t) for s in S]) for d in D for t in T}
        if grid.shard > 1
        else None
    )
    dp = {(s, t): dist.new_group([grid.rank(p, d, s, t) for d in D]) for s in S for t in T}
    return tp, sharding, dp


def _pp_groups(grid: Grid):
    """Each pipeline's stages, by (dp, sharding, tp) position (collective over the world)."""
    return {
        (d, s, t): dist.new_group([grid.rank(p, d, s, t) for p in range(grid.pp)])
        for d in range(grid.dp)
        for s in range(grid.shard)
        for t in range(grid.tp)
    }


def as_layout(layout, what: str = "this layer") -> Layout:
    """``layout`` itself, or the layout of a ``DeviceMesh`` with dims named among "pp", "dp",
    "shard" and "tp"; refuses None, saying what to pass."""
    if isinstance(layout, Layout):
        return layout
    if layout is None:
        raise TypeError(
            f"{what} needs the run's layout: pass layout=zerokit.init_hybrid_parallel(dp, tp) "
            "(or a torch DeviceMesh with dims named 'dp', 'tp', ...); there is no global default"
        )
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(layout, DeviceMesh):
        return from_device_mesh(layout)
    raise TypeError(f"{what}: layout must be a zerokit Layout or a DeviceMesh, got {layout!r}")


def mesh_dim_names(mesh) -> tuple[str, ...]:
    """A ``DeviceMesh``'s dim names, refused unless named among "pp", "dp", "shard", "tp"
    (no communication)."""
    names = tuple(mesh.mesh_dim_names or ())
    if "ep" in names:
        raise ValueError(
            "a DeviceMesh with an 'ep' dim is not read as a layout: build the layout with "
            "zerokit.init_mesh(dp=, ep=) (or Strategy(dp=, ep=)), whose ep groups lie inside dp"
        )
    unknown = set(names) - {"pp", "dp", "shard", "tp"}
    if not names or unknown:
        raise ValueError(
            f"a DeviceMesh used as a layout needs dims named among 'pp', 'dp', 'shard', 'tp'; "
            f"got {names}"
        )
    return names


def from_device_mesh(mesh) -> Layout:
    """The layout of a torch ``DeviceMesh`` whose dims are named among "pp", "dp", "shard" and
    "tp" (any order; a missing dim has degree 1). Its groups are the mesh's own."""
    names = mesh_dim_names(mesh)

    def dim(name: str):
        if name not in names:
            return 1, 0, None
        return mesh.size(names.index(name)), mesh.get_local_rank(name), mesh.get_group(name)

    (pp, pp_rank, pp_group), (tp, tp_rank, tp_group) = dim("pp"), dim("tp")
    (dp, dp_rank, dp_group), (shard, shard_rank, shard_group) = dim("dp"), dim("shard")
    if dp_group is None or tp_group is None:  # a dimension of one: this rank alone
        alone = _singleton_group()
        dp_group, tp_group = dp_group or alone, tp_group or alone
    return Layout(
        dp, tp, dp_rank, tp_rank, dp_group, tp_group,
        shard, shard_rank, shard_group if shard > 1 else None,
        pp, pp_rank, pp_group if pp > 1 else None,
    )  # fmt: skip


def expert_groups(ranks: list[int], ep: int) -> tuple[ProcessGroup, ProcessGroup]:
    """This rank's (ep group, expert-data-parallel group) within ``ranks`` (the data-parallel
    ranks): ep groups of ``ep`` neighbouring ranks, ``ranks[edp_rank * ep + ep_rank]``, and the
    ranks holding the same experts across them. Collective over the world: every rank makes
    every group, in one order."""
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1 or len(ranks) % ep:
        raise ValueError(
            f"ep must be a positive integer dividing the {len(ranks)} data-parallel ranks "
            f"(each group of ep ranks holds every expert once), got {ep!r}"
        )
    me = dist.get_rank()
    ep_group = edp_group = None
    for start in range(0, len(ranks), ep):
        members = ranks[start : start + ep]
        made = dist.new_group(members)
        ep_group = made if me in members else ep_group
    for first in range(ep):
        members = ranks[first::ep]
        made = dist.new_group(members)
        edp_group = made if me in members else edp_group
    return ep_group, edp_group


def _singleton_group() -> ProcessGroup:
    """A group of this rank alone. ``new_group`` is collective over the world, so every rank
    creates every rank's group, in the same order, and keeps its own."""
    me = dist.get_rank()
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    return groups[me]


def init_mesh(dp: int = 1, tp: int = 1, pp: int = 1, shard: int = 1, ep: int = 1) -> Layout:
    """The named mesh pp x dp x tp, as the run's ``Layout`` (collective: every rank calls it,
    after ``torch.distributed.init_process_group``). tp varies fastest: global rank =
    ``(pp_index * dp + dp_index) * tp + tp_index`` (Megatron's order). ``shard > 1``: hybrid
    sharding, a "shard" dim between dp and tp (ZeRO shards over ``shard``, replicates over
    ``dp``; ``rank = (pp_index * dp + dp_index) * shard * tp + shard_index * tp + tp_index``).
    ``ep > 1``: expert parallelism inside dp (``Strategy(ep=)``'s): neighbouring dp ranks split
    each MoE layer's experts (``layout.ep_group``), the experts sharded over dp / ep ranks
    (``layout.expert_dp_group``); it divides dp, with tp = pp = shard = 1. A torch
    ``DeviceMesh`` with dims named "pp", "dp", "shard", "tp" is accepted wherever this is.
    Degrees whose product is not the world size are refused before any communication."""
    world = dist.get_world_size() if dist.is_initialized() else None
    if world is not None and Grid(pp=pp, dp=dp, shard=shard, tp=tp).size != world:
        product = f"{dp} * {tp} * {pp}" + (f" * {shard}" if shard != 1 else "")
        raise ValueError(
            f"init_mesh: dp * tp * pp{' * shard' if shard != 1 else ''} = {product} = "
            f"{dp * tp * pp * shard}, but the world size is {world}"
        )
    check_ep(ep, dp, tp=tp, pp=pp, shard=shard)
    layout = init_hybrid_parallel(dp, tp, sharding_degree=shard, pp_degree=pp)
    if ep == 1:
        return layout
    ep_group, edp_group = expert_groups(dist.get_process_group_ranks(layout.shard_group), ep)
    return replace(layout, ep_degree=ep, ep_group=ep_group, expert_dp_group=edp_group)


def check_ep(ep: int, dp: int, *, tp: int = 1, pp: int = 1, shard: int = 1) -> None:
    """Refuse an ep degree the mesh cannot hold, naming the degrees (no communication)."""
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise ValueError(f"ep must be an integer >= 1, got {ep!r}")
    if ep == 1:
        return
    others = {"tp": tp, "pp": pp, "shard": shard}
    beside = {k: v for k, v in others.items() if v != 1}
    if beside:
        raise ValueError(
            f"ep = {ep} with {', '.join(f'{k} = {v}' for k, v in beside.items())} is not "
            "supported yet: expert parallelism composes with dp (every ZeRO level); use "
            "tp = pp = shard = 1"
        )
    if dp % ep:
        raise ValueError(
            f"ep = {ep} must divide dp = {dp}: each group of ep dp ranks holds every expert once"
        )
