"""``load``: into any world size and level (and tp degree), reading only the slices this rank
holds. The ranks first agree that they read the same checkpoint (the sha256 of its index) into
the same model; everything is validated and read before anything is copied, and all ranks
agree again first, so a refused checkpoint changes nothing anywhere."""

from __future__ import annotations

import os
from collections.abc import MutableMapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import extra as extra_state
from .agreement import mark_call, world_group
from .dcp_format import is_dcp
from .fields import scalar_value
from .holdings import (
    Chunk,
    Holdings,
    TensorMeta,
    flat_part_start,
    holds_all_of,
    optimizers_of,
    row_part_runs,
)
from .index import INDEX_NAME, CheckpointError, dtype_from_name, split_from_json
from .protocol import Staged, load_with, staged_hyperparameters
from .reading import CheckpointReader, resolve

__all__ = ["load", "resolve"]


def load(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    strict: bool = True,
    *,
    extra: MutableMapping[str, Any] | None = None,
    timeout: float | None = None,
) -> None:
    """Load a checkpoint written by ``save`` at any world size and level into ``model`` (and
    ``optimizer``: one, or the list of optimizers saved, in the same order), wrapped at any
    level or bare. Collective: every rank calls it.

    ``path`` may also be a torch.distributed.checkpoint (DCP) directory, as FSDP2 and
    torchtitan save one (``dcp.save({"model": msd, "optimizer": osd, ...})`` with
    ``get_state_dict``, or the model's keys at the top level): each rank reads only the saved
    chunks that overlap what it holds; its other entries (``lr_scheduler``, ``step``, ...)
    are extra state, restored by name through ``extra``.

    ``strict=False`` loads the tensors both sides have and leaves the rest as they are.
    ``extra``: the extra state to restore, by the names it was saved under: an object with
    ``load_state_dict()`` gets its state; any other entry of the dict is replaced by the saved
    value. Raises ``CheckpointError`` on every rank, changing nothing, if anything is wrong;
    ``CollectiveTimeout`` naming the ranks that did not call ``load`` within ``timeout``
    seconds (default ``$ZEROKIT_COLLECTIVE_TIMEOUT`` or 60).
    """
    group = world_group()
    mark_call("zerokit.checkpoint.load()", model, group)
    if is_dcp(resolve(path)) and not os.path.exists(os.path.join(resolve(path), INDEX_NAME)):
        from .dcp_load import DcpSource  # torch.distributed.checkpoint: loaded when used

        source = DcpSource(resolve(path), set(extra or {}))
    else:
        source = ZerokitSource(path)
    load_with(source, model, optimizer, strict, extra, group, timeout)


class ZerokitSource:
    """The protocol's source for zerokit's own format (``protocol.load_with``)."""

    read_what = "the checkpoint read (sha256 of its index)"
    malformed = "malformed checkpoint"
    malformed_errors = (OSError, KeyError, TypeError, ValueError)
    alike = False

    def __init__(self, path):
        self.path, self.where, self.reader, self.digest = path, os.fspath(path), None, ""

    def open(self, h: Holdings, strict: bool) -> None:
        self.reader = CheckpointReader(self.path)
        self.directory, self.digest = self.reader.directory, self.reader.digest

    def stage(self, h: Holdings, optimizer, strict: bool, extra, world) -> Staged:
        return _stage(self.reader, h, optimizer, strict, extra, world)

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()


def _check_ties(saved: dict, aliases: dict, h: Holdings) -> None:
    """The checkpoint ties together exactly the names the model ties together."""

    def stored(name: str) -> str | None:
        return name if name in saved else aliases.get(name)

    model_first = dict(h.aliases) | {n: n for n in h.param_names}
    for alias, first in h.aliases.items():
        if alias in aliases or alias in saved:
            if stored(alias) != stored(first):
                raise CheckpointError(
                    f"the model ties {alias} to {first}, the checkpoint ties it to "
                    f"{stored(alias)} (a tied weight would load another tensor's values)"
                )
    for alias, target in aliases.items():
        if alias in model_first and target in model_first:
            if model_first[alias] != model_first[target]:
                raise CheckpointError(
                    f"the checkpoint ties {alias} to {target}, the model does not (a tied "
                    "weight would load another tensor's values)"
                )


def _stage(
    reader: CheckpointReader, h: Holdings, optimizer, strict: bool, extra, world: dict | None
) -> Staged:
    """``world``: for a pipeline stage, what all stages hold (``saving.world_view``): strict
    compares the checkpoint with the whole model, not with this stage."""
    index = reader.index
    saved = index["tensors"]
    aliases = index["aliases"]
    _check_ties(saved, aliases, h)

    def stored_as(n: str) -> str:  # a tied name is stored under its alias's
        return n if n in saved else aliases.get(n, n)

    names = {n: stored_as(n) for n in h.param_names}
    everywhere = names if world is None else {n: stored_as(n) for n in sorted(world["names"])}
    missing = sorted(n for n, stored in everywhere.items() if stored not in saved)
    stored = {aliases.get(n, n) for n in everywhere.values()}
    unexpected = sorted(n for n in saved if not n.startswith("optim.") and n not in stored)
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"checkpoint and model differ: missing from the checkpoint {missing}, not in the "
            f"model {unexpected} (strict=False loads the tensors both have)"
        )
    staged = Staged()
    for chunk in h.chunks:
        name = names.get(chunk.name)
        if name is None or name not in saved:
            continue  # optimizer state (below), or skipped under strict=False
        staged.copies.append((chunk.tensor, _read(reader, name, h.metas[chunk.name], chunk)))
    if optimizer is not None:
        _stage_optimizer(index, reader, h, optimizer, staged, world)
    staged.extra = _stage_extra(reader, extra)
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
    runs = row_part_runs(meta, split_from_json(entry["tp"]), chunk.start, numel)
    if runs is not None:  # split along rows (experts at another ep): read just these rows
        out = torch.empty(numel, dtype=saved)
        for part, start, n, at in runs:
            out[at : at + n] = reader.read_part(name, part, start, n)
        return out
    full = reader.read_full(name)  # another tp degree: assemble, then take this rank's slice
    local = full if meta.split is None else meta.split.local(full, meta.tp_rank)
    return local.reshape(-1)[chunk.start : chunk.start + numel]


def _saved_optimizers(index: dict, h: Holdings) -> list[dict]:
    """The checkpoint's optimizers, checked against those given: as many, of the same
    classes, in the same order (a checkpoint of one optimizer is a list of one)."""
    saved = index.get("optimizer")
    if saved is None:
        raise CheckpointError("the checkpoint holds no optimizer state; pass optimizer=None")
    entries = saved if isinstance(saved, list) else [saved]
    held = h.optimizer_class if isinstance(h.optimizer_class, list) else [h.optimizer_class]
    if [e["class"] for e in entries] != held:
        if len(entries) == 1 and len(held) == 1:
            raise CheckpointError(
                f"the checkpoint holds {entries[0]['class']} state, the optimizer is {held[0]}"
            )
        raise CheckpointError(
            f"the checkpoint holds the state of {len(entries)} optimizer(s) "
            f"{[e['class'] for e in entries]}, given {len(held)}: {held}; pass the optimizers "
            "it was saved with, in the same order"
        )
    return entries


def _stage_optimizer(
    index: dict, reader: CheckpointReader, h: Holdings, optimizer, staged: Staged, world
) -> None:
    entries = _saved_optimizers(index, h)
    optimizers = optimizers_of(optimizer)
    groups = [(k, g) for k, e in enumerate(entries) for g in e["param_groups"]]
    held = [g["params"] for g in h.groups] if world is None else world["groups"]
    if [(k, set(g["params"])) for k, g in groups] != [
        (k, set(params)) for k, params in zip(h.group_optimizer, held)
    ]:
        raise CheckpointError(
            "the optimizer's param groups hold other parameters than the saved ones"
        )
    hyperparameters = staged_hyperparameters([g["hyperparameters"] for _, g in groups], optimizers)
    merged: dict[str, dict] = {"state_tensors": {}, "scalar_state": {}, "quantized_state": {}}
    for entry in entries:  # each parameter is in one optimizer: its state is keyed by name
        for part, values in merged.items():
            values.update(entry.get(part, {}))
    for chunk, key_tensor, k in h.optimizer_chunks:
        state = {}
        for key, tensor_name in merged["state_tensors"].get(chunk.name, {}).items():
            state[key] = _read_state(reader, tensor_name, h.metas[chunk.name], chunk, key_tensor)
        for key, described in merged["quantized_state"].get(chunk.name, {}).items():
            state[key] = _read_quantized(
                reader, described, h.metas[chunk.name], chunk, key_tensor, optimizers[k]
            )
        for key, scalar in merged["scalar_state"].get(chunk.name, {}).items():
            state[key] = scalar_value(scalar, f"{chunk.name} {key}")
        staged.optimizer_state.append((key_tensor, state, k))
    staged.hyperparameters = hyperparameters


def _read_state(
    reader: CheckpointReader, name: str, meta: TensorMeta, chunk: Chunk, key_tensor
) -> torch.Tensor:
    """A state tensor of one piece: per element (shaped like the parameter), this piece's
    range; held whole (a shape of its own, Adafactor's ``row_var``), all of it, which only a
    rank that now holds all of the parameter (its owner) can take."""
    entry = reader.index["tensors"][name]
    dtype = dtype_from_name(entry["dtype"], name)
    if tuple(entry["shape"]) == meta.shape:
        data = _read(reader, name, TensorMeta(meta.shape, dtype, meta.split, meta.tp_rank), chunk)
        return data.to(key_tensor.device).view(key_tensor.shape)
    if not holds_all_of(chunk, key_tensor, meta) or meta.split is not None:
        raise CheckpointError(
            f"{name} (shape {entry['shape']}) was held whole by {chunk.name}'s owner, and this "
            "rank holds only part of the parameter: load it with an optimizer zerokit steps on "
            "whole parameters (Muon, Adafactor, ShardingConfig(whole_parameter_optimizer=True))"
        )
    return reader.read_full(name).to(key_tensor.device)


def _read_quantized(
    reader: CheckpointReader, described: dict, meta: TensorMeta, chunk: Chunk, key_tensor, opt
) -> torch.Tensor:
    """A block-quantized state of one piece, exactly as saved: the optimizer makes the state
    as it would at its first step (``_new_buffer``: the same class, blocks and qmap), and its
    codes and scales are this piece's slices of the saved ones (a piece starts on a block)."""
    block, what = described["block_size"], f"{chunk.name}'s quantized state"
    signed = True if described["signed"] is None else described["signed"]
    made = opt._new_buffer(key_tensor, signed) if hasattr(opt, "_new_buffer") else None
    same = made is not None and type(made).__name__ == described["class"]
    at = flat_part_start(meta)  # split experts: this rank's part is a run of the whole's
    if at is None or (at + chunk.start) % block:
        raise CheckpointError(
            f"{what}: this rank's part (a tensor-parallel split other than whole rows, or "
            f"off the blocks of {block}) cannot hold the saved blocks; load at a layout whose "
            "parts end on a block, or save and resume with AdamW"
        )
    if not same or made.block_size != block:
        raise CheckpointError(
            f"{what} was saved as {described['class']} in blocks of {block}; the optimizer "
            f"makes {type(made).__name__} here (block_size {getattr(made, 'block_size', '-')}): "
            "load it with the same optimizer class and block_size"
        )
    per_code = key_tensor.numel() // made.codes.numel()
    tensors = reader.index["tensors"]
    parts = {}
    for part, start, target in (
        ("codes", (at + chunk.start) // per_code, made.codes),
        ("scale", (at + chunk.start) // block, made.scale),
    ):
        name = described[part]
        size = tensors[name]["shape"][0]
        dtype = torch.uint8 if part == "codes" else target.dtype
        if start + target.numel() > size or tensors[name]["dtype"] != str(dtype)[6:]:
            raise CheckpointError(f"{name}: {tensors[name]} does not hold {what} as made here")
        parts[part] = reader.read_part(name, 0, start, target.numel())
    made.codes.copy_(parts["codes"].view(made.codes.dtype).view(made.codes.shape))
    made.scale.copy_(parts["scale"].view(made.scale.shape))
    return made


def _stage_extra(reader: CheckpointReader, extra) -> dict[str, Any]:
    if not extra:
        return {}
    saved = reader.index.get("extra", {})
    missing = sorted(k for k in extra if k not in saved)
    if missing:
        raise CheckpointError(
            f"the checkpoint holds no extra state {missing} (it holds {sorted(saved)})"
        )
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    out = {}
    for key in extra:
        entry = saved[key]
        if entry["per_rank"]:
            saved_world = reader.index["layout"]["world_size"]
            if saved_world != world or len(entry["values"]) != world:
                raise CheckpointError(
                    f"extra {key!r} differed between the {saved_world} saving ranks (each stored "
                    f"its own); it can be restored at world size {saved_world} only, not {world}"
                )
            value = entry["values"][rank]
        else:
            value = entry["values"][0]
        out[key] = extra_state.read_saved(value, reader.read_tensor, key)
    return out
