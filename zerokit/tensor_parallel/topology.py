"""The pp x dp x sharding x tp layout: which ranks hold which pipeline stage (pipeline
parallel), which ranks split a layer (tensor parallel), which ranks shard the ZeRO state between
them (sharding), and which ranks hold the same state and split the batch (data parallel
replicas), plus the rule that splits a dimension.

Paddle's hybrid order, pp outermost and tp innermost:
``rank = pp_rank * (dp * sharding * tp) + (dp_rank * sharding_degree + sharding_rank) *
tp_degree + tp_rank``, so a tp group is a run of neighbouring ranks and a sharding group the
next run out (on one node, where the frequent collectives belong), replicas are farther apart,
and the stages of a pipeline farthest (only point-to-point traffic crosses them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


@dataclass(frozen=True)
class HybridLayout:
    """The process groups of a dp x sharding x tp run, built once by ``init_hybrid_parallel``."""

    dp_degree: int
    tp_degree: int
    dp_rank: int
    tp_rank: int
    dp_group: ProcessGroup
    """With ``sharding_degree == 1``: every rank holding the same tensor-parallel shards, which
    is the group to shard ZeRO across (``group_sharded_parallel(..., group=layout.dp_group)``).
    With ``sharding_degree > 1``: the replicas of one sharding rank (pass it as ``dp_group``)."""
    tp_group: ProcessGroup
    """Ranks that together hold one copy of every tensor-parallel layer."""
    sharding_degree: int = 1
    sharding_rank: int = 0
    sharding_group: ProcessGroup | None = None
    """The ranks ZeRO shards across (``group=``); the same as ``dp_group`` when
    ``sharding_degree == 1``."""
    pp_degree: int = 1
    pp_rank: int = 0
    """This rank's pipeline stage."""
    pp_group: ProcessGroup | None = None
    """The stages of this rank's pipeline, in stage order (None when ``pp_degree == 1``)."""

    @property
    def zero_group(self) -> ProcessGroup:
        """The group to pass as ``group=`` to ``group_sharded_parallel``."""
        return self.sharding_group if self.sharding_group is not None else self.dp_group

    @property
    def replica_group(self) -> ProcessGroup | None:
        """The group to pass as ``dp_group=`` (None without hybrid sharding)."""
        return self.dp_group if self.sharding_degree > 1 else None


_current: HybridLayout | None = None  # what tensor-parallel layers use when given no layout


def init_hybrid_parallel(
    dp_degree: int, tp_degree: int, sharding_degree: int = 1, pp_degree: int = 1
) -> HybridLayout:
    """Build the pp, dp, sharding and tp process groups (collective: every rank calls it, after
    ``torch.distributed.init_process_group``) and make the layout the tensor-parallel layers'
    default. Returns it.

    ``sharding_degree == 1`` (the two-argument call): ZeRO shards across ``layout.dp_group``.
    ``sharding_degree > 1``: hybrid sharding, ``group_sharded_parallel(..., group=
    layout.sharding_group, dp_group=layout.dp_group)``: state sharded inside each sharding group
    (one node) and replicated across the ``dp_degree`` replicas. At 4 ranks, dp 2 x sharding 2:
    sharding groups {0,1},{2,3}; dp groups {0,2},{1,3}.

    ``pp_degree > 1``: pipeline parallelism, outermost: every dp, sharding and tp group lies
    inside one stage, and ``layout.pp_group`` holds the stages of one pipeline. At 4 ranks,
    pp 2 x dp 2: stage 0 is ranks {0,1}, stage 1 {2,3}; dp groups {0,1},{2,3}; pp groups
    {0,2},{1,3}.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "init_hybrid_parallel needs a process group: call "
            "torch.distributed.init_process_group (or launch with torchrun) first"
        )
    world = dist.get_world_size()
    degrees = {
        "dp_degree": dp_degree,
        "tp_degree": tp_degree,
        "sharding_degree": sharding_degree,
        "pp_degree": pp_degree,
    }
    bad = {k: v for k, v in degrees.items() if not isinstance(v, int) or v < 1}
    if bad:
        raise ValueError(f"degrees must be integers >= 1, got {bad}")
    if world % tp_degree:
        raise ValueError(f"tp_degree {tp_degree} does not divide the world size {world}")
    if world % (tp_degree * pp_degree):
        raise ValueError(
            f"tp_degree * pp_degree = {tp_degree * pp_degree} does not divide the world size "
            f"{world}"
        )
    if pp_degree * dp_degree * sharding_degree * tp_degree != world:
        raise ValueError(
            f"pp_degree * dp_degree * sharding_degree * tp_degree = {pp_degree} * {dp_degree} * "
            f"{sharding_degree} * {tp_degree} = "
            f"{pp_degree * dp_degree * sharding_degree * tp_degree}, but the world size is "
            f"{world}; use dp_degree={world // (tp_degree * sharding_degree * pp_degree)}"
        )
    stage_size = dp_degree * sharding_degree * tp_degree
    pp_rank, in_stage = divmod(dist.get_rank(), stage_size)
    outer, tp_rank = divmod(in_stage, tp_degree)
    dp_rank, sharding_rank = divmod(outer, sharding_degree)

    def rank_of(d: int, s: int, t: int, p: int = pp_rank) -> int:
        return p * stage_size + (d * sharding_degree + s) * tp_degree + t

    D, S, T = range(dp_degree), range(sharding_degree), range(tp_degree)
    # new_group is collective over the whole world: every rank creates every group of every
    # stage, in the same order, and keeps those of its own stage.
    for p in range(pp_degree):
        groups = _stage_groups(rank_of, p, D, S, T, sharding_degree > 1)
        if p == pp_rank:
            tp_groups, sharding_groups, dp_groups = groups
    pp_groups = (
        {
            (d, s, t): dist.new_group([rank_of(d, s, t, p) for p in range(pp_degree)])
            for d in D
            for s in S
            for t in T
        }
        if pp_degree > 1
        else None
    )
    global _current
    _current = HybridLayout(
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
        pp_groups[dp_rank, sharding_rank, tp_rank] if pp_groups else None,
    )
    return _current


def _stage_groups(rank_of, p: int, D: range, S: range, T: range, sharded: bool):
    """Stage ``p``'s tp, sharding and dp groups (collective: every rank builds every stage's)."""
    tp = {(d, s): dist.new_group([rank_of(d, s, t, p) for t in T]) for d in D for s in S}
    sharding = (
        {(d, t): dist.new_group([rank_of(d, s, t, p) for s in S]) for d in D for t in T}
        if sharded
        else None
    )
    dp = {(s, t): dist.new_group([rank_of(d, s, t, p) for d in D]) for s in S for t in T}
    return tp, sharding, dp


def current_layout() -> HybridLayout:
    if _current is None:
        raise RuntimeError(
            "tensor-parallel layers need the dp x tp layout: call "
            "zerokit.init_hybrid_parallel(dp_degree, tp_degree) first (or pass layout=)"
        )
    return _current


@dataclass(frozen=True)
class TPSplit:
    """How one tensor is split along ``dim`` across the tp ranks.

    The dimension is ``stride`` equal blocks (e.g. a fused q, k, v projection: stride 3), and
    each block is split the same way: equal parts, the last rank taking the remainder. Rank r
    holds part r of every block, side by side.

    >>> split = TPSplit.of(dim=0, size=10, tp_degree=3)
    >>> split.block_sizes, split.local_size(2)
    ((3, 3, 4), 4)
    >>> full = torch.arange(12).view(6, 2)
    >>> qkv = TPSplit.of(dim=0, size=6, tp_degree=2, stride=3)
    >>> [qkv.local(full, r)[:, 0].tolist() for r in range(2)]
    [[0, 4, 8], [2, 6, 10]]
    >>> torch.equal(qkv.assemble([qkv.local(full, r) for r in range(2)]), full)
    True
    """

    dim: int
    block_sizes: tuple[int, ...]  # one block's part per tp rank
    stride: int = 1

    @staticmethod
    def of(dim: int, size: int, tp_degree: int, stride: int = 1, what: str = "") -> TPSplit:
        what = what or f"dimension of size {size}"
        if size % stride:
            raise ValueError(f"{what}: {size} is not a multiple of its {stride} fused blocks")
        block = size // stride
        per_rank = block // tp_degree
        if per_rank == 0:
            raise ValueError(f"{what}: {block} features cannot be split across {tp_degree} ranks")
        sizes = (per_rank,) * (tp_degree - 1) + (block - per_rank * (tp_degree - 1),)
        return TPSplit(dim, sizes, stride)

    @property
    def full_size(self) -> int:
        return sum(self.block_sizes) * self.stride

    def local_size(self, tp_rank: int) -> int:
        return self.block_sizes[tp_rank] * self.stride

    def start(self, tp_rank: int) -> int:
        """Where rank ``tp_rank``'s part begins inside each block."""
        return sum(self.block_sizes[:tp_rank])

    def local(self, full: torch.Tensor, tp_rank: int) -> torch.Tensor:
        """Rank ``tp_rank``'s part of the full tensor (a copy when stride > 1)."""
        blocks = full.chunk(self.stride, dim=self.dim)
        start, size = self.start(tp_rank), self.block_sizes[tp_rank]
        parts = [b.narrow(self.dim, start, size) for b in blocks]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)

    def assemble(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's part, in tp-rank order."""
        per_rank_blocks = [p.chunk(self.stride, dim=self.dim) for p in parts]
        blocks = [
            torch.cat([blocks[b] for blocks in per_rank_blocks], dim=self.dim)
            for b in range(self.stride)
        ]
        return torch.cat(blocks, dim=self.dim)
