"""The process groups of expert parallelism: each MoE layer's experts split over ``ep``
neighbouring ranks (the **ep group**), and the ranks holding the same experts (the
**expert-data-parallel group**, world / ep ranks), the shard group of the experts' units.

The rank arithmetic is the layout's (``zerokit.layout.expert_groups``, which
``init_mesh(ep=)`` uses too): within the data-parallel ranks ``ranks``,
``ranks[edp_rank * ep + ep_rank]``. Every rank builds every group (``new_group`` is
collective), once; the object is passed in, never held globally.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..layout import Layout, expert_groups


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
    ep_group, edp_group = expert_groups(dist.get_process_group_ranks(group), ep)
    return ExpertGroups(ep, ep_group, edp_group, group)


def expert_groups_of_layout(layout: Layout) -> ExpertGroups:
    """The expert groups ``zerokit.init_mesh(ep=)`` built into ``layout`` (no communication)."""
    if layout.ep_degree == 1:
        raise ValueError("the layout has ep = 1: build it with zerokit.init_mesh(dp=, ep=)")
    return ExpertGroups(layout.ep_degree, layout.ep_group, layout.expert_dp_group,
                        layout.shard_group)  # fmt: skip
