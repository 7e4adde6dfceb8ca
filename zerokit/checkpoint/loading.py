"""``load``: into any world size and level (and tp degree), reading only the slices this rank
holds; everything is validated and read before anything is copied, and all ranks agree first,
so a refused checkpoint changes nothing anywhere."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from torch import nn

from ..core.state import state_of
from .holdings import Chunk, Holdings, TensorMeta, collect
from .index import (
    INDEX_NAME,
    CheckpointError,
    CheckpointReader,
    dtype_from_name,
    read_index,
    split_from_json,
)
from .saving import OLD_SUFFIX, agree, world_group


@dataclass
class _Staged:
    """Everything a load will write, read and checked in advance."""

    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    optimizer_state: list[tuple[torch.Tensor, dict]] = field(default_factory=list)
    hyperparameters: list[dict] = field(default_factory=list)


def resolve(path: str | os.PathLike) -> str:
    """The checkpoint directory; the previous one if a save died between its two renames."""
    path = os.fspath(path).rstrip("/")
    if not os.path.exists(os.path.join(path, INDEX_NAME)):
        old = path + OLD_SUFFIX
        if not os.path.exists(path) and os.path.exists(os.path.join(old, INDEX_NAME)):
            return old
    return path


def load(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    strict: bool = True,
) -> None:
    """Load a checkpoint written by ``save`` at any world size and level into ``model`` (and
    ``optimizer``), wrapped at any level or bare. Collective: every rank calls it.

    ``strict=False`` loads the tensors both sides have and leaves the rest as they are.
    Raises ``CheckpointError`` on every rank, changing nothing, if anything is wrong.
    """
    group = world_group()
    h = collect(model, optimizer)
    staged, error = None, None
    try:
        directory = resolve(path)
        index = read_index(directory)
        staged = _stage(index, CheckpointReader(directory, index), h, optimizer, strict)
    except CheckpointError as e:
        error = str(e)
    except (OSError, KeyError, TypeError, ValueError) as e:
        error = f"{os.fspath(path)}: malformed checkpoint: {type(e).__name__}: {e}"
    agree(error, group)
    _apply(staged, model, optimizer)


def _stage(index: dict, reader: CheckpointReader, h: Holdings, optimizer, strict: bool) -> _Staged:
    saved = index["tensors"]
    aliases = index.get("aliases", {})
    names = {n: (n if n in saved else aliases.get(n, n)) for n in h.param_names}
    missing = sorted(n for n, stored in names.items() if stored not in saved)
    stored = {aliases.get(n, n) for n in names.values()}
    unexpected = sorted(n for n in saved if not n.startswith("optim.") and n not in stored)
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"checkpoint and model differ: missing from the checkpoint {missing}, not in the "
            f"model {unexpected} (strict=False loads the tensors both have)"
        )
    staged = _Staged()
    for chunk in h.chunks:
        name = names.get(chunk.name)
        if name is None or name not in saved:
            continue  # optimizer state (below), or skipped under strict=False
        staged.copies.append((chunk.tensor, _read(reader, name, h.metas[chunk.name], chunk)))
    if optimizer is not None:
        _stage_optimizer(index, reader, h, staged)
    return staged


def _read(reader: CheckpointReader, name: str, meta: TensorMeta, chunk: Chunk) -> torch.Tensor:
    entry = reader.index["tensors"][name]
    if tuple(entry["shape"]) != meta.shape:
        raise CheckpointError(
            f"{name}: checkpoint shape {entry['shape']}, model {list(meta.shape)}"
        )
    saved = dtype_from_name(entry["dtype"], name)
    if saved != meta.dtype and torch.promote_types(saved, meta.dtype) != meta.dtype:
        raise CheckpointError(
            f"{name}: the checkpoint holds {saved}, the model {meta.dtype}: loading would lose "
            "precision (cast the model to the checkpoint's dtype first)"
        )
    numel = chunk.tensor.numel()
    if split_from_json(entry["tp"]) == meta.split:  # same tp split: read just this range
        return reader.read_part(name, meta.tp_rank if meta.split else 0, chunk.start, numel)
    full = reader.read_full(name)  # another tp degree: assemble, then take this rank's slice
    local = full if meta.split is None else meta.split.local(full, meta.tp_rank)
    return local.reshape(-1)[chunk.start : chunk.start + numel]


def _stage_optimizer(index: dict, reader: CheckpointReader, h: Holdings, staged: _Staged) -> None:
    saved = index.get("optimizer")
    if saved is None:
        raise CheckpointError("the checkpoint holds no optimizer state; pass optimizer=None")
    if saved["class"] != h.optimizer_class:
        raise CheckpointError(
            f"the checkpoint holds {saved['class']} state, the optimizer is {h.optimizer_class}"
        )
    groups = saved["param_groups"]
    if [set(g["params"]) for g in groups] != [set(g["params"]) for g in h.groups]:
        raise CheckpointError(
            "the optimizer's param groups hold other parameters than the saved ones"
        )
    for chunk, key_tensor in h.optimizer_chunks:
        state = {}
        for key, tensor_name in saved["state_tensors"].get(chunk.name, {}).items():
            meta = h.metas[chunk.name]
            state_meta = TensorMeta(
                meta.shape,
                dtype_from_name(index["tensors"][tensor_name]["dtype"], tensor_name),
                meta.split,
                meta.tp_rank,
            )
            data = _read(reader, tensor_name, state_meta, chunk)
            state[key] = data.to(key_tensor.device).view(key_tensor.shape)
        for key, scalar in saved["scalar_state"].get(chunk.name, {}).items():
            value = scalar["value"]
            if scalar["tensor_dtype"] is not None:
                dtype = dtype_from_name(scalar["tensor_dtype"], f"{chunk.name} {key}")
                value = torch.tensor(value, dtype=dtype)
            state[key] = value
        staged.optimizer_state.append((key_tensor, state))
    staged.hyperparameters = [g["hyperparameters"] for g in groups]


def _apply(staged: _Staged, model: nn.Module, optimizer) -> None:
    with torch.no_grad():
        for target, data in staged.copies:
            target.copy_(data)
    if optimizer is not None:
        optimizer.state.clear()
        for key_tensor, state in staged.optimizer_state:
            if state:
                optimizer.state[key_tensor] = state
        for group, hyper in zip(optimizer.param_groups, staged.hyperparameters):
            for key, value in hyper.items():
                current = group.get(key)
                if isinstance(current, torch.Tensor):
                    current.fill_(value)
                else:
                    group[key] = tuple(value) if isinstance(current, tuple) else value
    state = state_of(model)
    if state is not None:  # the shards changed: refresh the full parameters
        state.refresh_params()
