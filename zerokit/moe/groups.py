"""The process groups of expert parallelism: each MoE layer's experts split over ``ep``
neighbouring ranks (the **ep group**), and the ranks holding the same experts (the
**expert-data-parallel group**, world / ep ranks), the shard group of the experts' units.

Rank arithmetic, within the data-parallel ranks ``ranks`` (the whole world without tp/pp):
``ranks[edp_rank * ep + ep_rank]``. Every rank builds every group (``new_group`` is
collective), once; the object is passed in, never held globally.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup


@dataclass(frozen=True)
class ExpertGroups:
    """This rank's two expert-parallel groups."""

    ep: int  # experts of a layer are split over this many ranks
    ep_group: ProcessGroup  # the ranks that together hold every expert once
    expert_dp_group: ProcessGroup  # the ranks holding this rank's experts: their shard group
    dense_group: ProcessGroup  # every data-parallel rank: the dense parameters' shard group

    @property
    def ep_rank(self) -> int:
        return self.ep_group.rank()


def init_expert_groups(ep: int, group: ProcessGroup | None = None) -> ExpertGroups:
    """Split ``group`` (default: the world; the data-parallel ranks) into ep groups of ``ep``
    neighbouring ranks and expert-data-parallel groups across them. Collective."""
    group = group if group is not None else dist.group.WORLD
    ranks = dist.get_process_group_ranks(group)
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1 or len(ranks) % ep:
        raise ValueError(
            f"ep must be a positive integer dividing the {len(ranks)} data-parallel ranks "
            f"(each group of ep ranks holds every expert once), got {ep!r}"
        )
    me = dist.get_rank()
    ep_group = edp_group = None
    for start in range(0, len(ranks), ep):  # every rank makes every group, in one order
        members = ranks[start : start + ep]
        made = dist.new_group(members)
        ep_group = made if me in members else ep_group
    for first in range(ep):
        members = ranks[first::ep]
        made = dist.new_group(members)
        edp_group = made if me in members else edp_group
    return ExpertGroups(ep, ep_group, edp_group, group)
