"""Flat bucket layout, computed as data before any memory is touched.

A bucket is one contiguous flat buffer holding several parameters back to back, padded so
that it splits into ``world_size`` equal shards. Every rank owns one contiguous shard. A
parameter can straddle a shard boundary; the part of a parameter inside a rank's shard is a
*piece*, and pieces are what the sharded optimizer updates.

An optimizer that needs more than one element at a time changes where the boundaries fall
(``ParamSpec.whole`` and ``ParamSpec.block``, filled from ``core/optimizer_needs.py``): a
bucket holding such parameters gets the *owner layout* (``place_owners``), with shards of
uneven size. Each whole parameter (Muon, Adafactor) lies inside one rank's shard; owners are
chosen over the whole model at once (``assign_owners``: costliest first, each to the rank with
the least cost so far, Graham's LPT as Megatron's layer-wise optimizer balances), not bucket by
bucket in model order, which can leave one rank 1.5x the mean; the other parameters fill
around them so the shards are as even as they can be; and every boundary inside a parameter
with a ``block`` (low-bit states) falls on a multiple of it, counted from the parameter's
first element. Nothing is padded: the bytes reduced and gathered are the parameters' own.

Replica-sharded optimizer state (``ShardingConfig.shard_optimizer_over_replicas``, hybrid
sharding over S shard ranks x R replicas): each shard is cut once more into R *sub-shards*,
one per replica, and a rank's optimizer steps the pieces of its own sub-shard only
(``pieces(rank, replica)``). The layout is planned over all S x R sub-shards: equal ones
(padded to a multiple of S x R), or the owner layout with ``bounds`` of S x R + 1 entries
(whole parameters owned by one (shard rank, replica) over the whole world; blocks aligned at
every sub-shard boundary). Shard rank s holds sub-shards s x R .. s x R + R - 1, contiguous.

Everything here is pure: shapes, dtypes and a world size in, frozen dataclasses out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class ParamSpec:
    """What the layout needs to know about one parameter."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    whole: bool = False  # its optimizer reads the whole parameter: one rank owns all of it
    block: int = 1  # a boundary inside it falls on a multiple of this (quantization blocks)
    cost: float = 0.0  # the optimizer's work on it when whole (balances the owners)
    optimizer: int = 0  # which of the model's optimizers steps it: buckets never mix two
    owner: int | None = None  # whole: the rank that steps it (``assign_owners``); None: not yet

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def placed(self) -> bool:
        """Does its optimizer care where shard boundaries fall?"""
        return self.whole or self.block > 1


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives in its bucket's flat buffer: ``[offset, offset + numel)``."""

    param_index: int  # index into the full list of ParamSpecs given to plan_buckets
    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int
    whole: bool = False  # owned whole by one rank: its piece is shaped like the parameter

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class Piece:
    """The part ``[start, end)`` of a slot's parameter (flattened) that lies in one shard."""

    slot: int  # index into BucketLayout.slots
    start: int  # offsets within the flattened parameter
    end: int

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class BucketLayout:
    """One flat bucket: its slots, padding and the shard every rank owns."""

    dtype: torch.dtype
    device: torch.device
    slots: tuple[Slot, ...]  # in order of offset
    world_size: int
    # the owner layout: sub-shard k's part is [bounds[k], bounds[k + 1]) (rank r's shard, at
    # one replica: [bounds[r], bounds[r + 1])); None: equal shards
    bounds: tuple[int, ...] | None = None
    replicas: int = 1  # sub-shards per shard: the optimizer state is sharded over replicas too

    @property
    def parts(self) -> int:
        """Sub-shards: every (shard rank, replica) pair's, in order ``rank * replicas + replica``."""
        return self.world_size * self.replicas

    @property
    def numel(self) -> int:
        """Elements holding parameters (no padding)."""
        return self.slots[-1].end

    @property
    def even(self) -> bool:
        """Do all ranks hold shards of one size (the collectives' fast path)?"""
        return self.bounds is None

    @property
    def padded_numel(self) -> int:
        if self.bounds is not None:
            return self.bounds[-1]
        return -(-self.numel // self.parts) * self.parts

    @property
    def shard_numel(self) -> int:
        """The largest shard (every shard, when they are even)."""
        return max(end - start for start, end in self.shard_ranges())

    def shard_ranges(self) -> list[tuple[int, int]]:
        """Every rank's ``[start, end)``, in rank order."""
        return [self.shard_range(r) for r in range(self.world_size)]

    def shard_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of ``rank``'s shard in the flat buffer."""
        if self.bounds is not None:
            return self.bounds[rank * self.replicas], self.bounds[(rank + 1) * self.replicas]
        size = self.padded_numel // self.world_size
        return rank * size, (rank + 1) * size

    def sub_range(self, rank: int, replica: int) -> tuple[int, int]:
        """``[start, end)`` of ``rank``'s sub-shard at ``replica`` in the flat buffer."""
        k = rank * self.replicas + replica
        if self.bounds is not None:
            return self.bounds[k], self.bounds[k + 1]
        size = self.padded_numel // self.parts
        return k * size, (k + 1) * size

    def sub_ranges(self, rank: int) -> list[tuple[int, int]] | None:
        """Every replica's ``[start, end)`` inside ``rank``'s shard (counted from the shard's
        first element): the chunks of the collectives across replicas. None: equal chunks."""
        if self.bounds is None:
            return None
        lo = self.shard_range(rank)[0]
        return [tuple(x - lo for x in self.sub_range(rank, q)) for q in range(self.replicas)]

    def pieces(self, rank: int, replica: int | None = None) -> tuple[Piece, ...]:
        """The non-empty parts of parameters that lie inside ``rank``'s shard (``replica``
        given: inside its sub-shard there), in order."""
        lo, hi = self.shard_range(rank) if replica is None else self.sub_range(rank, replica)
        out = []
        for i, slot in enumerate(self.slots):
            start, end = max(lo, slot.offset), min(hi, slot.end)
            if start < end:
                out.append(Piece(i, start - slot.offset, end - slot.offset))
        return tuple(out)


def plan_buckets(
    params: Sequence[ParamSpec],
    world_size: int,
    max_bucket_numel: int,
    loads: list[float] | None = None,
    replicas: int = 1,
) -> tuple[BucketLayout, ...]:
    """Group parameters into flat buckets, in registration order.

    Parameters of one (dtype, device) go into the same bucket until adding the next would pass
    ``max_bucket_numel`` elements; a parameter larger than that gets a bucket of its own.
    Buckets of different (dtype, device) never mix, nor do the parameters of two optimizers
    (each spreads its own updated buckets after its step). A bucket holding a parameter whose
    optimizer cares where boundaries fall (``ParamSpec.placed``) gets the owner layout
    (``place_owners``). Whole parameters without an ``owner`` are given one here, over all of
    ``params`` at once (``assign_owners``, starting from ``loads``, each rank's optimizer cost
    so far, which is added to); ``plan_groups`` assigns them over the whole model first.
    ``replicas`` > 1: each shard is cut into that many sub-shards (the module note); owners
    are then sub-shards, ``rank * replicas + replica``.

    >>> f32, cpu = torch.float32, torch.device("cpu")
    >>> specs = [ParamSpec("w", (3, 2), f32, cpu), ParamSpec("b", (3,), f32, cpu)]
    >>> (b,) = plan_buckets(specs, world_size=2, max_bucket_numel=100)
    >>> b.numel, b.padded_numel, b.shard_range(1), b.pieces(1)
    (9, 10, (5, 10), (Piece(slot=0, start=5, end=6), Piece(slot=1, start=0, end=3)))
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if max_bucket_numel < 1:
        raise ValueError(f"buffer_max_size must be >= 1 element, got {max_bucket_numel}")
    open_slots: dict[tuple[torch.dtype, torch.device, int], list[Slot]] = {}
    closed: list[tuple[int, BucketLayout]] = []  # (first param index, layout): keeps order

    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    params = with_owners(params, world_size * replicas, loads)

    def close(key: tuple[torch.dtype, torch.device, int]) -> None:
        slots = open_slots.pop(key)
        layout = BucketLayout(key[0], key[1], tuple(slots), world_size, replicas=replicas)
        if any(params[s.param_index].placed for s in slots):
            layout = place_owners([params[s.param_index] for s in slots], layout)
        closed.append((slots[0].param_index, layout))

    for index, spec in enumerate(params):
        if spec.numel == 0:
            continue  # nothing to store, reduce or update
        key = (spec.dtype, spec.device, spec.optimizer)
        slots = open_slots.get(key)
        if slots and slots[-1].end + spec.numel > max_bucket_numel:
            close(key)
            slots = None
        offset = slots[-1].end if slots else 0
        open_slots.setdefault(key, []).append(
            Slot(index, spec.name, spec.shape, offset, spec.numel)
        )
    for key in list(open_slots):
        close(key)
    return tuple(layout for _, layout in sorted(closed, key=lambda item: item[0]))


def assign_owners(
    specs: Sequence[ParamSpec], world_size: int, loads: list[float] | None = None
) -> list[int | None]:
    """Each whole parameter's owner (None for the others), chosen over all of ``specs`` at
    once: costliest first, each to the rank with the least cost so far (ties: fewer elements
    owned, then the lower rank). Graham's LPT: the slowest rank does at most 4/3 - 1/(3 x
    ranks) of what the best assignment's slowest does. ``loads``, each rank's cost before
    these, is added to. Pure: every rank computes the same owners.

    >>> f32, cpu = torch.float32, torch.device("cpu")
    >>> costs = (1, 1, 2)
    >>> specs = [ParamSpec(f"w{i}", (c,), f32, cpu, whole=True, cost=c) for i, c in enumerate(costs)]
    >>> assign_owners(specs, 2)  # in model order, one at a time: 1 + 2 against 1
    [1, 1, 0]
    """
    loads = loads if loads is not None else [0.0] * world_size
    held = [0] * world_size  # elements owned: the tie-break, so memory evens out too
    owners: list[int | None] = [None] * len(specs)
    whole = [i for i, spec in enumerate(specs) if spec.whole]
    for i in sorted(whole, key=lambda i: (-specs[i].cost, -specs[i].numel, i)):
        rank = min(range(world_size), key=lambda r: (loads[r], held[r], r))
        owners[i] = rank
        loads[rank] += specs[i].cost
        held[rank] += specs[i].numel
    return owners


def with_owners(
    specs: Sequence[ParamSpec], world_size: int, loads: list[float] | None = None
) -> list[ParamSpec]:
    """``specs`` with an owner for every whole parameter that has none (``assign_owners`` over
    those, after ``loads``); owners already given are kept."""
    free = [i for i, spec in enumerate(specs) if spec.whole and spec.owner is None]
    owners = assign_owners([specs[i] for i in free], world_size, loads)
    out = list(specs)
    for i, owner in zip(free, owners):
        out[i] = replace(specs[i], owner=owner)
    return out


def place_owners(specs: Sequence[ParamSpec], layout: BucketLayout) -> BucketLayout:
    """``layout`` re-laid for optimizers that need whole parameters or aligned blocks.

    Each rank's part of the flat buffer is: the rest of a parameter cut at its lower
    boundary, the whole parameters it owns (``ParamSpec.owner``), then the other parameters in
    registration order up to its share. The shares even out the elements (water-filling above
    the whole parameters). A boundary falls at a share's end, moved to a multiple of the
    parameter's ``block``; never inside a whole parameter. With ``layout.replicas`` > 1 the
    "ranks" here are the sub-shards (``BucketLayout.parts``).
    """
    world = layout.parts
    owned: list[list[int]] = [[] for _ in range(world)]
    held = [0] * world  # elements of whole parameters each rank owns in this bucket
    for i, spec in enumerate(specs):
        if spec.whole:
            if spec.owner is None or not 0 <= spec.owner < world:
                raise ValueError(f"{spec.name}: a whole parameter needs an owner in [0, {world})")
            owned[spec.owner].append(i)
            held[spec.owner] += spec.numel
    rest = [i for i, spec in enumerate(specs) if not spec.whole]
    shares = _water_fill(held, sum(specs[i].numel for i in rest))
    block = {layout.slots[i].param_index: spec.block for i, spec in enumerate(specs)}
    slots, bounds, end = [], [0], 0
    fill = iter(rest)
    for rank in range(world):
        for i in sorted(owned[rank]):
            slots.append(replace(layout.slots[i], offset=end, whole=True))
            end += specs[i].numel
        floor = end if owned[rank] else bounds[-1]  # never inside this rank's whole ones
        target = bounds[-1] + held[rank] + shares[rank]
        last = rank == world - 1
        while end < target or last:
            i = next(fill, None)
            if i is None:
                break
            slots.append(replace(layout.slots[i], offset=end, whole=False))
            end += specs[i].numel
        cut = end if last else min(max(target, floor), end)
        bounds.append(_aligned(cut, slots[-1] if slots else None, block))
    return replace(layout, slots=tuple(slots), bounds=tuple(bounds))


def _aligned(cut: int, last: Slot | None, block: dict[int, int]) -> int:
    """``cut`` moved down to a multiple of the block of the parameter it falls inside (only
    the last one laid can hold it), counted from that parameter's first element."""
    if last is None or last.whole or not last.offset < cut < last.end:
        return cut
    step = block[last.param_index]
    return last.offset + (cut - last.offset) // step * step


def _water_fill(held: list[int], total: int) -> list[int]:
    """Each rank's share of ``total`` elements so that ``held[r] + share[r]`` are as even as
    they can be: the ranks holding least are filled to one level first."""
    world = len(held)
    shares = [0] * world
    order = sorted(range(world), key=lambda r: held[r])
    left = total
    for k in range(world):
        # raise the k+1 lowest ranks to the next rank's level, or share what is left
        nxt = held[order[k + 1]] if k + 1 < world else None
        below = order[: k + 1]
        room = None if nxt is None else sum(nxt - (held[q] + shares[q]) for q in below)
        if room is None or room >= left:
            each, extra = divmod(left, len(below))
            for j, q in enumerate(sorted(below)):
                shares[q] += each + (1 if j < extra else 0)
            return shares
        for q in below:
            shares[q] = nxt - held[q]
        left -= room
    return shares
