"""``save``: every rank writes its own shard file; rank 0 writes the index and moves the
finished checkpoint into place.

Note: a checkpoint is built in ``<path>.zerokit-tmp`` and only a complete one (every rank's
file written and flushed, the index written to a temp file, fsynced and renamed) replaces
``<path>``: the old one is first renamed to ``<path>.zerokit-old`` and deleted after the new
one is in place. A save killed at any point leaves the previous checkpoint loadable (``load``
falls back to ``<path>.zerokit-old`` if it was killed between the two renames); the next save
removes the debris. A failure on any rank becomes the same error on every rank.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist
from torch import nn

from ..core.collectives import all_gather_bytes
from .holdings import Holdings, collect
from .index import (
    FORMAT,
    FORMAT_VERSION,
    INDEX_NAME,
    CheckpointError,
    check_tensor_entry,
    dtype_name,
    split_to_json,
)
from .streaming import write_safetensors

TMP_SUFFIX = ".zerokit-tmp"
OLD_SUFFIX = ".zerokit-old"


def world_group():
    return dist.group.WORLD if dist.is_initialized() else None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def agree(error: str | None, group) -> None:
    """Raise the same error on every rank if any rank had one (collective)."""
    errors = [json.loads(b) for b in all_gather_bytes(json.dumps(error).encode(), group)]
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        raise CheckpointError("; ".join(f"rank {r}: {e}" for r, e in failed))


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_shard(tmp: str, h: Holdings) -> dict:
    """This rank's file (written straight from the shards, hashed on the way) and what the
    index needs to know of it."""
    rank = _rank()
    chunks = [c for c in h.chunks if c.primary and c.tensor.numel() > 0]
    fname = f"rank{rank:05d}.safetensors"
    pieces = [
        {"name": c.name, "key": f"{c.name}@{c.start}", "start": c.start, "numel": c.tensor.numel()}
        for c in chunks
    ]
    info = {"pieces": pieces, "file": None}
    if chunks:
        entries = [
            (p["key"], c.tensor.dtype, [p["numel"]], lambda c=c: c.tensor)
            for p, c in zip(pieces, chunks)
        ]
        metadata = {"format": FORMAT, "rank": str(rank)}
        size, sha256 = write_safetensors(os.path.join(tmp, fname), entries, metadata)
        info["file"] = {"name": fname, "size": size, "sha256": sha256}
    return info


def _describe(h: Holdings) -> dict:
    return {
        name: {"shape": list(m.shape), "dtype": dtype_name(m.dtype), "tp": split_to_json(m.split)}
        for name, m in h.metas.items()
    }


def _build_index(h: Holdings, shards: list[dict]) -> dict:
    tensors = {}
    for shard in shards:  # a rank knows the optimizer state of the pieces it holds only
        for name, described in shard["tensors"].items():
            if tensors.setdefault(name, described | {"parts": {}})["shape"] != described["shape"]:
                raise CheckpointError(f"{name}: ranks disagree on its shape")
    files = {}
    for shard in shards:
        if shard["file"] is not None:
            files[shard["file"]["name"]] = {k: shard["file"][k] for k in ("size", "sha256")}
        for piece in shard["pieces"]:
            entry = tensors.get(piece["name"])
            if entry is None:
                raise CheckpointError(f"{piece['name']}: held by one rank and not another")
            part = str(shard["tp_rank"]) if entry["tp"] else "0"
            entry["parts"].setdefault(part, []).append(
                {k: piece[k] for k in ("key", "start", "numel")} | {"file": shard["file"]["name"]}
            )
    scalars, state_names = {}, {}
    for shard in shards:
        scalars.update(shard["scalars"])
        for param, keys in shard["state_names"].items():
            state_names.setdefault(param, {}).update(keys)
    index = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "layout": h.layout,
        "files": files,
        "tensors": tensors,
        "aliases": h.aliases,
        "optimizer": None
        if h.optimizer_class is None
        else {
            "class": h.optimizer_class,
            "param_groups": h.groups,
            "scalar_state": scalars,
            "state_tensors": state_names,
        },
    }
    for name, entry in tensors.items():
        check_tensor_entry(name, entry, files)  # every element once: no gaps, no overlaps
    return index


def save(
    path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Save ``model`` (and ``optimizer``) to the directory ``path``, atomically.

    Collective: every rank calls it; each writes only what it holds (its shards). Works at
    every level, on a bare model, and with tensor-parallel layers. All ranks must see the
    same file system.
    """
    path = os.fspath(path).rstrip("/")
    group = world_group()
    tmp, old = path + TMP_SUFFIX, path + OLD_SUFFIX
    h = collect(model, optimizer)
    error = None
    if _rank() == 0:
        try:
            if not os.path.exists(path) and os.path.isdir(old):
                os.replace(old, path)  # a save died between its renames: that was the last good one
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(old, ignore_errors=True)
            os.makedirs(tmp)
        except OSError as e:
            error = f"cannot prepare {tmp}: {e}"
    agree(error, group)
    try:
        shard, error = _write_shard(tmp, h), None
        shard["scalars"], shard["tensors"] = h.scalars, _describe(h)
        shard["state_names"] = h.state_names
        shard["tp_rank"] = next((m.tp_rank for m in h.metas.values() if m.split), 0)
    except Exception as e:  # disk full, permissions: every rank must hear of it
        shard, error = None, f"writing its shard failed: {type(e).__name__}: {e}"
    try:
        agree(error, group)
    except CheckpointError:
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    shards = [json.loads(b) for b in all_gather_bytes(json.dumps(shard).encode(), group)]
    error = None
    if _rank() == 0:
        try:
            index = _build_index(h, shards)
            _commit(path, tmp, old, index)
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            error = f"finishing the checkpoint failed: {type(e).__name__}: {e}"
    agree(error, group)


def _commit(path: str, tmp: str, old: str, index: dict) -> None:
    index_tmp = os.path.join(tmp, INDEX_NAME + ".tmp")
    with open(index_tmp, "w", encoding="utf-8") as f:
        json.dump(index, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(index_tmp, os.path.join(tmp, INDEX_NAME))
    _fsync_dir(tmp)
    if os.path.exists(path):
        os.replace(path, old)
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))
    shutil.rmtree(old, ignore_errors=True)
