"""Flat bucket layout, computed as data before any memory is touched.

A bucket is one contiguous flat buffer holding several parameters back to back, padded so
that it splits into ``world_size`` equal shards. Every rank owns one contiguous shard. A
parameter can straddle a shard boundary; the part of a parameter inside a rank's shard is a
*piece*, and pieces are what the sharded optimizer updates.

Everything here is pure: shapes, dtypes and a world size in, frozen dataclasses out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParamSpec:
    """What the layout needs to know about one parameter."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives in its bucket's flat buffer: ``[offset, offset + numel)``."""

    param_index: int  # index into the full list of ParamSpecs given to plan_buckets
    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int

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
    slots: tuple[Slot, ...]
    world_size: int

    @property
    def numel(self) -> int:
        """Elements holding parameters (no padding)."""
        return self.slots[-1].end

    @property
    def padded_numel(self) -> int:
        return -(-self.numel // self.world_size) * self.world_size

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of ``rank``'s shard in the flat buffer."""
        start = rank * self.shard_numel
        return start, start + self.shard_numel

    def pieces(self, rank: int) -> tuple[Piece, ...]:
        """The non-empty parts of parameters that lie inside ``rank``'s shard, in order."""
        lo, hi = self.shard_range(rank)
        out = []
        for i, slot in enumerate(self.slots):
            start, end = max(lo, slot.offset), min(hi, slot.end)
            if start < end:
                out.append(Piece(i, start - slot.offset, end - slot.offset))
        return tuple(out)


def plan_buckets(
    params: Sequence[ParamSpec], world_size: int, max_bucket_numel: int
) -> tuple[BucketLayout, ...]:
    """Group parameters into flat buckets, in registration order.

    Parameters of one (dtype, device) go into the same bucket until adding the next would pass
    ``max_bucket_numel`` elements; a parameter larger than that gets a bucket of its own.
    Buckets of different (dtype, device) never mix.

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
    open_slots: dict[tuple[torch.dtype, torch.device], list[Slot]] = {}
    closed: list[tuple[int, BucketLayout]] = []  # (first param index, layout): keeps order

    def close(key: tuple[torch.dtype, torch.device]) -> None:
        slots = open_slots.pop(key)
        closed.append(
            (slots[0].param_index, BucketLayout(key[0], key[1], tuple(slots), world_size))
        )

    for index, spec in enumerate(params):
        if spec.numel == 0:
            continue  # nothing to store, reduce or update
        key = (spec.dtype, spec.device)
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
