"""``load``: into any world size, level and tp degree, each rank reading only what it holds;
``ZerokitSource`` answers ``protocol.load_with`` from zerokit's index and rank files."""

from __future__ import annotations

import os
from collections.abc import MutableMapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import extra as extra_state
from .agreement import mark_call, rank, world_group
from .dcp_format import is_dcp
from .fields import scalar_value
from .holdings import (
    Chunk,
    Holdings,
    TensorMeta,
    flat_part_start,
    holds_all_of,
    row_part_runs,
)
from .index import INDEX_NAME, CheckpointError, dtype_from_name, split_from_json
from .protocol import load_with
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
    torchtitan save one; its entries other than the model and optimizer (``lr_scheduler``,
    ``step``, ...) are extra state, restored by name through ``extra``.

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
    """The protocol's source for zerokit's own format (``protocol.load_with``): the index
    answers what the checkpoint holds; each range is read from its rank file when asked."""

    kind = "checkpoint"
    read_what = "the checkpoint read (sha256 of its index)"
    malformed_errors = (OSError, KeyError, TypeError, ValueError)
    alike = False
    shape_differs = "{name}: checkpoint shape {saved}, model {model}"

    def __init__(self, path):
        self.path, self.where, self.reader, self.digest = path, os.fspath(path), None, ""

    def open(self, h: Holdings) -> None:
        self.reader = CheckpointReader(self.path)
        self.directory, self.digest = self.reader.directory, self.reader.digest
        self.index, self.tensors = self.reader.index, self.reader.index["tensors"]
        self.extra_names = sorted(self.index.get("extra", {}))
        _check_ties(self.tensors, self.index["aliases"], h)

    def key_of(self, name: str, h: Holdings) -> str | None:
        stored = name if name in self.tensors else self.index["aliases"].get(name)
        return stored if stored in self.tensors else None  # a tied name: its alias's

    def unexpected(self, keys: set[str], h: Holdings) -> list[str]:
        return sorted(n for n in self.tensors if not n.startswith("optim.") and n not in keys)

    def described(self, key: str) -> tuple[list, torch.dtype]:
        return self.tensors[key]["shape"], dtype_from_name(self.tensors[key]["dtype"], key)

    def ask(self, key: str, meta: TensorMeta, chunk: Chunk) -> torch.Tensor:
        """This chunk's range of ``key`` (of the model's shape; dtype as saved)."""
        numel, saved = chunk.tensor.numel(), split_from_json(self.tensors[key]["tp"])
        if saved == meta.split:  # same tp split: read just this range
            return self.reader.read_part(key, meta.tp_rank if meta.split else 0, chunk.start, numel)
        runs = row_part_runs(meta, saved, chunk.start, numel)
        if runs is not None:  # split along rows (experts at another ep): read just these rows
            out = torch.empty(numel, dtype=self.described(key)[1])
            for part, start, n, at in runs:
                out[at : at + n] = self.reader.read_part(key, part, start, n)
            return out
        full = self.reader.read_full(key)  # another tp degree: assemble, take this rank's slice
        local = full if meta.split is None else meta.split.local(full, meta.tp_rank)
        return local.reshape(-1)[chunk.start : chunk.start + numel]

    def ask_groups(self, h: Holdings):
        saved = self.index.get("optimizer")
        if saved is None:
            return None
        entries = saved if isinstance(saved, list) else [saved]
        _check_classes([e["class"] for e in entries], h)
        self.state = {part: {} for part in ("state_tensors", "scalar_state", "quantized_state")}
        for entry in entries:  # each parameter is in one optimizer: its state is keyed by name
            for part, values in self.state.items():
                values.update(entry.get(part, {}))
        groups = [(k, g) for k, e in enumerate(entries) for g in e["param_groups"]]
        if [k for k, _ in groups] != h.group_optimizer:
            raise CheckpointError(
                "the optimizer's param groups hold other parameters than the saved ones"
            )
        return lambda: [(g["params"], g["hyperparameters"]) for _, g in groups]

    def ask_state(self, chunk: Chunk, key_tensor, opt, meta: TensorMeta) -> dict:
        state = {}
        for key, tensor_name in self.state["state_tensors"].get(chunk.name, {}).items():
            state[key] = self._state_tensor(tensor_name, meta, chunk, key_tensor)
        for key, described in self.state["quantized_state"].get(chunk.name, {}).items():
            state[key] = _read_quantized(self.reader, described, meta, chunk, key_tensor, opt)
        for key, scalar in self.state["scalar_state"].get(chunk.name, {}).items():
            state[key] = scalar_value(scalar, f"{chunk.name} {key}")
        return state

    def _state_tensor(self, name: str, meta: TensorMeta, chunk: Chunk, key_tensor):
        """A state tensor of one piece: per element (shaped like the parameter), this piece's
        range; held whole (a shape of its own, Adafactor's ``row_var``), all of it, which only
        a rank that now holds all of the parameter (its owner) can take."""
        shape = self.tensors[name]["shape"]
        if tuple(shape) == meta.shape:
            return self.ask(name, meta, chunk).to(key_tensor.device).view(key_tensor.shape)
        if not holds_all_of(chunk, key_tensor, meta) or meta.split is not None:
            raise CheckpointError(
                f"{name} (shape {shape}) was held whole by {chunk.name}'s owner, and this rank "
                "holds only part of the parameter: load it with an optimizer zerokit steps on "
                "whole parameters (Muon, Adafactor, ShardingConfig(whole_parameter_optimizer=True))"
            )
        return self.reader.read_full(name).to(key_tensor.device)

    def ask_extra(self, key: str):
        entry = self.index["extra"][key]
        value = entry["values"][0]
        if entry["per_rank"]:
            saved_world = self.index["layout"]["world_size"]
            world = dist.get_world_size() if dist.is_initialized() else 1
            if saved_world != world or len(entry["values"]) != world:
                raise CheckpointError(
                    f"extra {key!r} differed between the {saved_world} saving ranks (each stored "
                    f"its own); it can be restored at world size {saved_world} only, not {world}"
                )
            value = entry["values"][rank()]
        return lambda: extra_state.read_saved(value, self.reader.read_tensor, key)

    def read(self) -> None:
        pass  # each range was read when asked

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()


def _check_classes(saved: list[str], h: Holdings) -> None:
    """The checkpoint's optimizers against those given: as many, of the same classes, in the
    same order (a checkpoint of one optimizer is a list of one)."""
    held = h.optimizer_class if isinstance(h.optimizer_class, list) else [h.optimizer_class]
    if saved == held:
        return
    if len(saved) == 1 and len(held) == 1:
        raise CheckpointError(f"the checkpoint holds {saved[0]} state, the optimizer is {held[0]}")
    raise CheckpointError(
        f"the checkpoint holds the state of {len(saved)} optimizer(s) {saved}, given "
        f"{len(held)}: {held}; pass the optimizers it was saved with, in the same order"
    )


def _check_ties(saved: dict, aliases: dict, h: Holdings) -> None:
    """The checkpoint ties together exactly the names the model ties together."""

    def stored(name: str) -> str | None:
        return name if name in saved else aliases.get(name)

    for alias, first in h.aliases.items():
        if (alias in aliases or alias in saved) and stored(alias) != stored(first):
            raise CheckpointError(
                f"the model ties {alias} to {first}, the checkpoint ties it to "
                f"{stored(alias)} (a tied weight would load another tensor's values)"
            )
    model_first = dict(h.aliases) | {n: n for n in h.param_names}
    for alias, target in aliases.items():
        both = alias in model_first and target in model_first
        if both and model_first[alias] != model_first[target]:
            raise CheckpointError(
                f"the checkpoint ties {alias} to {target}, the model does not (a tied "
                "weight would load another tensor's values)"
            )


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
    per_code, first = key_tensor.numel() // made.codes.numel(), at + chunk.start
    for name, start, target, dtype in (  # codes are saved as bytes
        (described["codes"], first // per_code, made.codes, torch.uint8),
        (described["scale"], first // block, made.scale, made.scale.dtype),
    ):
        entry = reader.index["tensors"][name]
        if start + target.numel() > entry["shape"][0] or entry["dtype"] != str(dtype)[6:]:
            raise CheckpointError(f"{name}: {entry} does not hold {what} as made here")
        part = reader.read_part(name, 0, start, target.numel())
        target.copy_(part.view(target.dtype).view(target.shape))
    return made
