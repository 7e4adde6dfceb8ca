"""Whole-model state dicts across ep: the experts' slices gathered into the model's own
[E, ...] parameters, and a whole state dict cut back to this rank's experts, so a model saved
at one ep (level, world) loads at another, and into ``from_pretrained``.

Collective: every rank calls them (the model's own ``state_dict`` gathers at 'p_g_os').
They carry no optimizer state: ``zerokit.checkpoint`` (``save``, ``load``, DCP) does, through
``expert_splits``, which tells it what part of each whole [E, ...] tensor a rank holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from ..tensor_parallel.topology import TPSplit
from .experts import ExpertParallelExperts

_EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def _split(model: nn.Module) -> dict[str, ExpertParallelExperts]:
    return {n: m for n, m in model.named_modules() if isinstance(m, ExpertParallelExperts)}


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict one process holding the whole model has (every expert, in order), on
    every rank. Collective."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for name, module in _split(model).items():
        group = module.groups.ep_group
        for param in _EXPERT_PARAMS:
            key = f"{name}.{param}"
            mine = state[key].contiguous()
            parts = [torch.empty_like(mine) for _ in range(group.size())]
            if group.size() > 1:
                dist.all_gather(parts, mine, group=group)
            else:
                parts = [mine]
            state[key] = torch.cat(parts)  # ep ranks hold consecutive experts
    return state


def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a whole-model state dict (``full_state_dict``'s, or a Hugging Face checkpoint's)
    into a model whose experts are split: each rank takes its own experts. Collective."""
    state = dict(state)
    for name, module in _split(model).items():
        mine = slice(module.first_expert, module.first_expert + module.num_local_experts)
        for param in _EXPERT_PARAMS:
            key = f"{name}.{param}"
            if key not in state:
                raise KeyError(f"the state dict has no {key!r}: is it this model's?")
            if state[key].shape[0] != module.num_experts:
                raise ValueError(
                    f"{key} holds {state[key].shape[0]} experts, the model {module.num_experts}: "
                    "load a whole-model state dict (zerokit.moe.full_state_dict's)"
                )
            state[key] = state[key][mine]
    model.load_state_dict(state)


@dataclass(frozen=True)
class ExpertSplit:
    """What a rank holds of one expert parameter of the unsplit model ([E, ...]): part
    ``part`` of ``split`` (dim 0, one part of E / ep experts per ep rank), the same part as
    every rank of ``holders`` (its expert-data-parallel group, which shards it)."""

    split: TPSplit
    part: int
    holders: ProcessGroup


def expert_splits(model: nn.Module) -> dict[int, ExpertSplit]:
    """id(parameter) -> its ``ExpertSplit``, for every split experts module of ``model``:
    how a checkpoint names a rank's experts as slices of the unsplit model's tensors."""
    out = {}
    for module in model.modules():
        if not isinstance(module, ExpertParallelExperts):
            continue
        split = TPSplit.of(0, module.num_experts, module.groups.ep, what="experts")
        # ep ranks hold consecutive experts: the part is where this rank's first one falls
        part = module.first_expert // module.num_local_experts
        for param in _EXPERT_PARAMS:
            held = ExpertSplit(split, part, module.groups.expert_dp_group)
            out[id(getattr(module, param))] = held
    return out
