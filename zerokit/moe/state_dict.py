"""Whole-model state dicts across ep: the experts' slices gathered into the model's own
[E, ...] parameters, and a whole state dict cut back to this rank's experts, so a model saved
at one ep (level, world) loads at another, and into ``from_pretrained``.

Collective: every rank calls them (the model's own ``state_dict`` gathers at 'p_g_os').
Optimizer state is not carried across ep (yet): a resumed run starts its optimizer afresh.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

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


def refuse_split_experts(model: nn.Module, call: str) -> None:
    """A sharded checkpoint of split experts is not written yet: say what to use instead
    (every rank raises it alike: the model's structure is the same on every rank)."""
    if any(isinstance(m, ExpertParallelExperts) for m in model.modules()):
        raise NotImplementedError(
            f"{call} does not save experts split across ep ranks yet (each rank holds E / ep "
            "of a layer's experts under the same names); save "
            "zerokit.moe.full_state_dict(model) (the whole model, every rank) and load it with "
            "zerokit.moe.load_full_state_dict at any ep"
        )
