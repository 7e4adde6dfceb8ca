"""Full (plain-model) state dicts for tensor-parallel models, bare or wrapped by any ZeRO level.

Keys and shapes are those of the same model built without tensor parallelism, so a plain
checkpoint loads into a tp model and a tp model's weights load into a plain one.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from ..runtime.teardown import hand, hand_all
from .layers import TensorParallelLayer
from .topology import TPSplit


def split_state_keys(model: nn.Module) -> dict[str, tuple[TensorParallelLayer, TPSplit]]:
    """State-dict key -> (layer, split) for every tensor-parallel parameter, aliases included."""
    keys = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, TensorParallelLayer):
            for name, split in module.tp_splits.items():
                keys[f"{prefix}.{name}" if prefix else name] = (module, split)
    return keys


def _gather_split(local: torch.Tensor, layer: TensorParallelLayer, split: TPSplit) -> torch.Tensor:
    group = layer.tp_group
    if group.size() == 1:
        return local
    sizes = [split.local_size(r) for r in range(group.size())]
    shape = list(local.shape)
    shape[split.dim] = max(sizes)  # all_gather needs equal sizes: pad, then trim
    padded = local.new_zeros(shape)
    padded.narrow(split.dim, 0, local.shape[split.dim]).copy_(local)
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(hand_all(parts), hand(padded), group=group)
    return split.assemble([p.narrow(split.dim, 0, n) for p, n in zip(parts, sizes)])


def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full tensors with the plain model's keys and shapes, on every rank.

    Collective over the tp group (and, for level 'p_g_os', the ZeRO group): every rank calls it.
    """
    splits = split_state_keys(model)
    state = model.state_dict()
    for key, (layer, split) in splits.items():
        state[key] = _gather_split(state[key].detach(), layer, split)
    return state


def load_full_state_dict(
    model: nn.Module, full_state_dict: Mapping[str, torch.Tensor], strict: bool = True
) -> None:
    """Load a plain model's state dict: each tensor-parallel layer takes its own slice.

    Every key and shape is checked before anything is copied, so a failed load changes
    nothing. ``strict=False`` skips keys missing on either side. Every rank calls it.
    """
    splits = split_state_keys(model)
    expected = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    missing = sorted(expected.keys() - full_state_dict.keys())
    unexpected = sorted(full_state_dict.keys() - expected.keys())
    if strict and (missing or unexpected):
        raise KeyError(
            f"state dict does not match the model: missing {missing}, unexpected {unexpected} "
            "(pass strict=False to load the keys both have)"
        )
    local = {}
    for key in expected.keys() & full_state_dict.keys():
        value = full_state_dict[key]
        if key in splits:
            layer, split = splits[key]
            full_shape = list(expected[key][0])
            full_shape[split.dim] = split.full_size
            if tuple(value.shape) != tuple(full_shape):
                raise ValueError(
                    f"{key}: the full tensor is {tuple(value.shape)}, the plain model's is "
                    f"{tuple(full_shape)}"
                )
            value = split.local(value, layer.layout.tp_rank)
        if tuple(value.shape) != expected[key][0]:
            raise ValueError(f"{key}: shape {tuple(value.shape)}, expected {expected[key][0]}")
        local[key] = value
    model.load_state_dict(local, strict=False)
