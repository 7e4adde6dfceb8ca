"""Whole-model state dicts across ep: the experts' slices gathered into the model's own
[E, ...] parameters, and a whole state dict cut back to this rank's experts, so a model saved
at one ep (level, world) loads at another, and into ``from_pretrained``.

Collective: every rank calls them (the model's own ``state_dict`` gathers at 'p_g_os').
They carry no optimizer state: ``zerokit.checkpoint`` (``save``, ``load``, DCP) does, through
``expert_splits``, which tells it what part of each whole [E, ...] tensor a rank holds.
``per_expert_sources`` reads Hugging Face's files of these models, which keep one tensor per
expert, as the 3-D parameters (for ``load_pretrained``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
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


# Hugging Face's files of these models keep the layout from before transformers 5, one 2-D
# tensor per expert (save_pretrained writes it still), which from_pretrained merges into the
# 3-D parameters: gate_up_proj[e] = cat(gate_e, up_e) [2I, H], down_proj[e] = down_e [H, I].
# Each pattern: a per-expert name -> (its layer's experts module, 3-D parameter, place in an
# expert's run of that parameter's rows).
_PER_EXPERT = (
    (re.compile(r"(.+)\.block_sparse_moe\.experts\.(\d+)\.w([123])\.weight"), "mlp.experts",
     {"1": ("gate_up_proj", 0), "3": ("gate_up_proj", 1), "2": ("down_proj", 0)}),
    (re.compile(r"(.+)\.experts\.(\d+)\.(gate|up|down)_proj\.weight"), "experts",
     {"gate": ("gate_up_proj", 0), "up": ("gate_up_proj", 1), "down": ("down_proj", 0)}),
)  # fmt: skip
_RENAMED = re.compile(r"(.+)\.block_sparse_moe\.gate\.weight")  # Mixtral's router


def per_expert_sources(
    shapes: Mapping[str, list[int]],
) -> dict[str, tuple[list[str], list[int]]]:
    """The files' tensors (name -> shape) seen as the 3-D experts: each merged name -> (the
    files' tensors whose flat values, one after another, are its flat values; its shape).
    A layer's per-expert tensors are merged only when every expert 0..E-1 has every part,
    all of one shape; Mixtral's ``block_sparse_moe.gate`` is its ``mlp.gate``."""
    found: dict[str, dict[tuple[int, int], str]] = {}
    for name in shapes:
        for pattern, module, parts in _PER_EXPERT:
            m = pattern.fullmatch(name)
            if m:
                param, place = parts[m.group(3)]
                target = f"{m.group(1)}.{module}.{param}"
                found.setdefault(target, {})[(int(m.group(2)), place)] = name
                break
    out = {}
    for target, pieces in found.items():
        experts = 1 + max(e for e, _ in pieces)
        places = 1 + max(p for _, p in pieces)
        order = [pieces.get((e, p)) for e in range(experts) for p in range(places)]
        if None in order or len({tuple(shapes[n]) for n in order}) != 1:
            continue  # not the layout this reads: left as the files name it
        rows, *rest = shapes[order[0]]
        out[target] = (order, [experts, places * rows, *rest])
    for name in shapes:
        m = _RENAMED.fullmatch(name)
        if m:
            out[f"{m.group(1)}.mlp.gate.weight"] = ([name], list(shapes[name]))
    return out
