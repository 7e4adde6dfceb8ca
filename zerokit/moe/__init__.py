"""Mixture-of-experts: expert parallelism on Hugging Face MoE models, composed with every
ZeRO level. ``apply_expert_parallel`` splits each MoE layer's experts over the ep ranks
(``init_expert_groups``); ``group_sharded_parallel`` then shards the experts over the
expert-data-parallel ranks and the dense parameters over all of them, each with its own
units, buckets and gradient reduction."""

from .aux_loss import global_load_balancing_loss
from .experts import ExpertParallelExperts
from .groups import ExpertGroups, init_expert_groups
from .plan import EXPERTS_PLAN, apply_expert_parallel, expert_groups_of, find_experts
from .state_dict import full_state_dict, load_full_state_dict

__all__ = [
    "EXPERTS_PLAN",
    "ExpertGroups",
    "ExpertParallelExperts",
    "apply_expert_parallel",
    "expert_groups_of",
    "find_experts",
    "full_state_dict",
    "global_load_balancing_loss",
    "init_expert_groups",
    "load_full_state_dict",
]
