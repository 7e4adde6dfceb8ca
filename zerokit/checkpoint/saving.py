"""zerokit's own format, written (``ZerokitWriter``, the protocol's writer), and ``save``.

write: each rank writes ``rank<r>.safetensors`` straight from its shards, hashed on the way.
seal: rank 0's ``index.json``, every tensor tiled exactly once and every file there with its
size, written with its checksum. A save killed at any point leaves the previous checkpoint
loadable (``load`` falls back to ``.zerokit-old`` between ``swap_in``'s two renames).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from . import extra as extra_state
from .holdings import Holdings
from .index import (
    FORMAT,
    FORMAT_VERSION,
    INDEX_NAME,
    CheckpointError,
    check_tensor_entry,
    dtype_name,
    piece_key,
    seal,
    split_to_json,
)
from .protocol import Together, begin_save
from .streaming import write_safetensors


def shard_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def _describe(h: Holdings) -> dict:
    return {
        name: {"shape": list(m.shape), "dtype": dtype_name(m.dtype), "tp": split_to_json(m.split)}
        for name, m in h.metas.items()
    }


def _build_index(h: Holdings, shards: list[dict], per_rank: dict, world: dict | None) -> dict:
    tensors, files, scalars, state_names, quantized = {}, {}, {}, {}, {}
    for shard in shards:  # a rank knows the optimizer state of the pieces it holds only
        for name, described in shard["tensors"].items():
            if tensors.setdefault(name, described | {"parts": {}})["shape"] != described["shape"]:
                raise CheckpointError(f"{name}: ranks disagree on its shape")
        for name, part, piece in shard["pieces"]:
            tensors[name]["parts"].setdefault(part, []).append(piece)
        files.update(shard["files"])
        scalars.update(shard["scalars"])
        for param, keys in shard["state_names"].items():
            state_names.setdefault(param, {}).update(keys)
        for param, keys in shard["quantized"].items():
            quantized.setdefault(param, {}).update(keys)
    extra = {
        key: {
            "per_rank": per_rank[key],
            "values": [s["extra"][key] for s in shards if key in s["extra"]],
        }
        for key in sorted(per_rank)
    }
    index = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "layout": h.layout,
        "files": files,
        "tensors": tensors,
        "aliases": h.aliases,
        "optimizer": _optimizer_index(h, world, scalars, state_names, quantized),
        "extra": extra,
    }
    if h.model_config:  # written only when there is one: older readers know no such key
        index["model_config"] = h.model_config
    for name, entry in tensors.items():
        check_tensor_entry(name, entry, files)  # every element once: no gaps, no overlaps
    return index


def _optimizer_index(h: Holdings, world, scalars: dict, state_names: dict, quantized: dict):
    """The index's ``optimizer``: one entry per optimizer, each with its own groups and the
    state of its parameters; a list when a list was given (one optimizer: the entry itself)."""
    if h.optimizer_class is None:
        return None
    groups = h.groups
    if world is not None:
        groups = [g | {"params": p} for g, p in zip(h.groups, world["groups"])]
    listed = isinstance(h.optimizer_class, list)
    entries = []
    for k, cls in enumerate(h.optimizer_class if listed else [h.optimizer_class]):
        mine = [g for g, owner in zip(groups, h.group_optimizer) if owner == k]
        params = {p for g in mine for p in g["params"]}
        entry = {
            "class": cls,
            "param_groups": mine,
            "scalar_state": {p: v for p, v in scalars.items() if p in params},
            "state_tensors": {p: v for p, v in state_names.items() if p in params},
        }
        held = {p: v for p, v in quantized.items() if p in params}
        if held:
            entry["quantized_state"] = held
        entries.append(entry)
    return entries if listed else entries[0]


class ZerokitWriter:
    """zerokit's own format: a safetensors file per rank, rank 0's sealed ``index.json``."""

    name = "zerokit"

    def file_of(self, rank: int) -> str:
        return shard_file(rank)

    def write(self, tmp: str, rank: int, h: Holdings, extras: dict, per_rank: dict) -> dict:
        """This rank's file: its primary chunks and the extra state it stores (per-rank keys
        on every rank, the others on rank 0); and what the index needs of it."""
        fname = shard_file(rank)
        pieces, entries = [], []  # pieces: (tensor, its tp part, the index's piece)
        for c in h.chunks:
            if not c.primary or not c.tensor.numel():
                continue
            meta, key, numel = h.metas[c.name], piece_key(c.name, c.start), c.tensor.numel()
            where = {"key": key, "start": c.start, "numel": numel, "file": fname}
            pieces.append((c.name, str(meta.tp_rank) if meta.split else "0", where))
            entries.append((key, c.tensor.dtype, [numel], lambda c=c: c.tensor))
        stored = {}
        for position, key in enumerate(sorted(extras)):
            if not (per_rank[key] or rank == 0):
                continue
            doc, tensors = extras[key]
            refs = []
            for n, t in enumerate(tensors):
                tkey = extra_state.tensor_key(position, rank, n)
                entries.append((tkey, t.dtype, list(t.shape), lambda t=t: t))
                refs.append(extra_state.tensor_ref(fname, tkey, t))
            stored[key] = {"json": doc, "tensors": refs}
        files = {}
        if entries:
            metadata = {"format": FORMAT, "rank": str(rank)}
            size, sha256 = write_safetensors(os.path.join(tmp, fname), entries, metadata)
            files[fname] = {"size": size, "sha256": sha256}
        return {
            "pieces": pieces,
            "files": files,
            "extra": stored,
            "tensors": _describe(h),
            "scalars": h.scalars,
            "state_names": h.state_names,
            "quantized": h.quantized,
        }

    def seal(self, tmp: str, h: Holdings, shards: list, per_rank, world) -> tuple[str, bytes]:
        index = _build_index(h, shards, per_rank, world)
        for name, listed in index["files"].items():  # written where rank 0 sees them
            full = os.path.join(tmp, name)
            if not os.path.isfile(full) or os.path.getsize(full) != listed["size"]:
                raise CheckpointError(
                    f"{full} is not there as written: all ranks must share one file system"
                )
        return INDEX_NAME, seal(index)


def writer_for(format: str):
    """The writer of ``format``: ``"zerokit"`` or ``"dcp"``."""
    if format == "zerokit":
        return ZerokitWriter()
    if format == "dcp":
        from .dcp_save import DcpWriter  # torch.distributed.checkpoint: loaded when used

        return DcpWriter()
    raise ValueError(
        f"format={format!r}: zerokit writes 'zerokit' (its own) or 'dcp' "
        "(torch.distributed.checkpoint's, for FSDP2 and torchtitan)"
    )


def save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    *,
    extra: Mapping[str, Any] | None = None,
    timeout: float | None = None,
    format: str = "zerokit",
) -> None:
    """Save ``model`` (and ``optimizer``, one or a list of them, and ``extra`` state) to the
    directory ``path``, atomically.

    Collective: every rank calls it, with the same path; each writes only what it holds (its
    shards). Works at every level, on a bare model, and with tensor-parallel layers. All ranks
    must see the same file system. ``path`` must not exist, or be an empty directory or a
    zerokit checkpoint (which is replaced); anything else there is refused. ``extra``: name ->
    an object with ``state_dict()``/``load_state_dict()`` (an LR scheduler,
    ``zerokit.checkpoint.RNGState()``) or a plain value (numbers, strings, lists, dicts,
    tensors), stored without pickle. ``timeout``: seconds to wait for a rank that does not
    call ``save`` (default ``$ZEROKIT_COLLECTIVE_TIMEOUT`` or 60) before raising
    ``CollectiveTimeout`` naming it. ``format="dcp"`` writes a torch.distributed.checkpoint
    directory instead (FSDP2 loads it with ``dcp.load`` and ``set_state_dict`` at any world
    size), as atomically; it may replace a DCP directory as well.
    """
    with begin_save("save", path, model, optimizer, extra, writer_for(format), timeout) as job:
        job.finish(Together(job))
