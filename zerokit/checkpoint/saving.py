"""``save``: the ranks agree on what they save and where, each writes its own shard file, and
rank 0 writes the index and moves the finished checkpoint into place.

Note: the steps, each ending in an all-gather that raises the same error on every rank.
(1) every rank checks what it was given and encodes its extra state; (2) the ranks agree on
the path, the model's tensors, the optimizer and the extra keys, and a rank that did not call
``save`` is named within the collective timeout; nothing has been written yet. (3) Rank 0 takes
the save lock, refuses a path that holds anything but a zerokit checkpoint, clears debris of
dead saves and makes its own temp directory, which every rank must then see. (4) Every rank
writes and fsyncs its file. (5) Rank 0 builds the index (every tensor tiled exactly once, every
file there with its size), writes it with its checksum (temp file, fsync, rename), renames
``<path>`` to ``<path>.zerokit-old`` and the temp directory to ``<path>``, deletes the old one
and releases the lock. A save killed at any point leaves the previous checkpoint loadable
(``load`` falls back to ``.zerokit-old`` between the two renames); the next save removes the
debris (see ``places``).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..core import agree_all, alive, gather, state_of, whole_shards
from ..moe.state_dict import refuse_split_experts
from ..runtime import presence
from ..runtime.timeouts import AgreementError, CollectiveTimeout
from . import extra as extra_state
from .holdings import Holdings, collect
from .index import (
    FORMAT,
    FORMAT_VERSION,
    INDEX_NAME,
    CheckpointError,
    check_hyperparameter,
    check_tensor_entry,
    dtype_name,
    piece_key,
    seal,
    split_to_json,
)
from .places import SaveLock, clear_debris, make_temp, remove, why_not_replaceable
from .reading import OLD_SUFFIX
from .streaming import write_safetensors


def world_group():
    return dist.group.WORLD if dist.is_initialized() else None


def mark_call(call: str, model: nn.Module, group) -> None:
    """Tell the other ranks this one is in ``call`` (the world and the model's own group), so
    a rank that waits for it elsewhere names the call."""
    state = state_of(model)
    if state is not None:
        state.presence.mark(call)
    if group is not None and (state is None or group is not state.process_group):
        presence.Presence(group).mark(call)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def gather_json(what: str, value: Any, group, timeout: float | None) -> list[Any]:
    try:
        return [json.loads(r) for r in gather(what, json.dumps(value).encode(), group, timeout)]
    except CollectiveTimeout:
        raise
    except AgreementError as e:
        raise CheckpointError(str(e)) from None


def model_fingerprint(h: Holdings) -> bytes:
    """The model's tensors as every rank sees them: names, full shapes, dtypes, tp splits."""
    tensors = {
        n: [list(m.shape), dtype_name(m.dtype), split_to_json(m.split)]
        for n, m in h.metas.items()
        if not n.startswith("optim.")
    }
    text = json.dumps([tensors, h.aliases], sort_keys=True).encode()
    return hashlib.sha256(text).hexdigest().encode()


def _grouped(values: list, members: list[int]) -> str:
    held: dict[str, list[int]] = {}
    for value, rank in zip(values, members):
        held.setdefault(json.dumps(value, sort_keys=True), []).append(rank)
    return "; ".join(f"ranks {r}: {v:.200}" for v, r in held.items())


def world_view(h: Holdings, what: str, group, timeout: float | None) -> dict | None:
    """For a pipelined model, what the whole world holds (None otherwise: every rank holds the
    same model). One gather over every rank of every stage; the same ``CheckpointError`` on
    every rank if the ranks of one stage hold different tensors or the ranks see different
    pipelines. Returns ``fingerprint`` (of every stage's tensors, to agree on), ``names`` (the
    model tensors of all stages) and ``groups`` (each optimizer param group's parameters on
    all stages)."""
    if h.pipeline is None:
        return None
    mine = {
        "pipeline": h.pipeline | {"stage": None},
        "stage": h.pipeline["stage"],
        "fingerprint": model_fingerprint(h).decode(),
        "names": h.param_names,
        "groups": [g["params"] for g in h.groups],
    }
    replies = gather_json(f"{what}: the pipeline's stages", mine, group, timeout)
    members = list(range(len(replies)))
    pipelines = [r["pipeline"] for r in replies]
    if any(p != pipelines[0] for p in pipelines):
        raise CheckpointError(
            f"{what}: the ranks see different pipelines ({_grouped(pipelines, members)})"
        )
    stages: dict[int, set[str]] = {}
    for r in replies:
        stages.setdefault(r["stage"], set()).add(r["fingerprint"])
    for stage, prints in sorted(stages.items()):
        if len(prints) > 1:
            ranks = [m for m, r in zip(members, replies) if r["stage"] == stage]
            shown = _grouped([replies[m]["fingerprint"][:12] for m in ranks], ranks)
            raise CheckpointError(
                f"{what}: the ranks of pipeline stage {stage} hold different tensors ({shown})"
            )
    if sorted(stages) != list(range(pipelines[0]["stages"])):
        raise CheckpointError(f"{what}: stages {sorted(stages)} take part, not all of them")
    names = {n for r in replies for n in r["names"]}
    ngroups = {len(r["groups"]) for r in replies}
    if len(ngroups) > 1:
        raise CheckpointError(f"{what}: the stages' optimizers hold different numbers of groups")
    groups: list[list[str]] = [[] for _ in range(ngroups.pop())]
    seen: list[set[str]] = [set() for _ in groups]
    for r in replies:  # stage order (pp is the outermost axis): each name once
        for merged, known, params in zip(groups, seen, r["groups"]):
            merged.extend(p for p in params if p not in known)
            known.update(params)
    text = json.dumps([pipelines[0], sorted(s.pop() for s in stages.values())]).encode()
    fingerprint = hashlib.sha256(text).hexdigest().encode()
    return {"fingerprint": fingerprint, "names": names, "groups": groups}


def optimizer_fingerprint(h: Holdings) -> bytes:
    """The optimizer's class, groups and hyperparameters (a pipeline stage's own parameters:
    those of all stages are checked by ``world_view``)."""
    if h.pipeline is None:
        desc = [h.optimizer_class, h.group_optimizer, h.groups]
    else:
        desc = [h.optimizer_class, h.group_optimizer, [g["hyperparameters"] for g in h.groups]]
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest().encode()


def agree_on(what: str, fields: dict[str, bytes], group, timeout: float | None) -> None:
    try:
        agree_all(what, fields, group, timeout)
    except CollectiveTimeout:
        raise
    except AgreementError as e:
        raise CheckpointError(str(e)) from None


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_shard(tmp: str, h: Holdings, extras: dict, mine: set[str]) -> dict:
    """This rank's file (written straight from the shards, hashed on the way): its primary
    chunks and the extra state it stores; and what the index needs to know of it."""
    rank = _rank()
    chunks = [c for c in h.chunks if c.primary and c.tensor.numel() > 0]
    fname = f"rank{rank:05d}.safetensors"
    pieces = [
        {
            "name": c.name,
            "key": piece_key(c.name, c.start),
            "start": c.start,
            "numel": c.tensor.numel(),
        }
        for c in chunks
    ]
    entries = [
        (p["key"], c.tensor.dtype, [p["numel"]], lambda c=c: c.tensor)
        for p, c in zip(pieces, chunks)
    ]
    extra_docs = {}
    for position, key in enumerate(sorted(extras)):
        if key not in mine:
            continue
        doc, tensors = extras[key]
        refs = []
        for n, t in enumerate(tensors):
            tkey = extra_state.tensor_key(position, rank, n)
            entries.append((tkey, t.dtype, list(t.shape), lambda t=t: t))
            refs.append(extra_state.tensor_ref(fname, tkey, t))
        extra_docs[key] = {"json": doc, "tensors": refs}
    info = {"pieces": pieces, "file": None, "extra": extra_docs}
    if entries:
        metadata = {"format": FORMAT, "rank": str(rank)}
        size, sha256 = write_safetensors(os.path.join(tmp, fname), entries, metadata)
        info["file"] = {"name": fname, "size": size, "sha256": sha256}
    return info


def _describe(h: Holdings) -> dict:
    return {
        name: {"shape": list(m.shape), "dtype": dtype_name(m.dtype), "tp": split_to_json(m.split)}
        for name, m in h.metas.items()
    }


def _build_index(
    h: Holdings, shards: list[dict], per_rank: dict[str, bool], world: dict | None
) -> dict:
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
    scalars, state_names, quantized = {}, {}, {}
    for shard in shards:
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


def _local_checks(h: Holdings, extra: Mapping[str, Any] | None) -> dict:
    """What this rank was given, checked, and its extra state encoded."""
    for i, group in enumerate(h.groups):
        for key, value in group["hyperparameters"].items():
            try:
                check_hyperparameter(f"param group {i}: {key}", value)
            except CheckpointError as e:
                raise CheckpointError(f"{e}; it would not load") from None
    for param, state in h.scalars.items():
        for key, scalar in state.items():
            check_hyperparameter(f"optimizer state {key!r} of {param}", scalar["value"])
    if extra is not None and not isinstance(extra, Mapping):
        raise CheckpointError(f"extra must be a dict of name -> state, got {type(extra).__name__}")
    extras = {}
    for key, value in (extra or {}).items():
        if not isinstance(key, str):
            raise CheckpointError(f"extra: keys must be strings, got {key!r}")
        extras[key] = extra_state.encode(value, f"extra[{key!r}]")
    return extras


class ZerokitWriter:
    """zerokit's own format: a safetensors file per rank, rank 0's sealed ``index.json``."""

    name = "zerokit"

    def write(self, tmp: str, h: Holdings, extras: dict, per_rank: dict[str, bool]) -> dict:
        mine = {k for k in extras if per_rank[k] or _rank() == 0}
        shard = _write_shard(tmp, h, extras, mine)
        shard["scalars"], shard["tensors"] = h.scalars, _describe(h)
        shard["state_names"], shard["quantized"] = h.state_names, h.quantized
        shard["tp_rank"] = next((m.tp_rank for m in h.metas.values() if m.split), 0)
        return shard

    def finish(self, path: str, tmp: str, h: Holdings, shards: list, per_rank, world) -> None:
        _commit(path, tmp, _build_index(h, shards, per_rank, world))


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
    from .background import wait_in_flight  # background imports this module

    refuse_split_experts(model, "zerokit.checkpoint.save()")  # before anything is written
    wait_in_flight()  # this process's async_save first: one save at a time
    path = os.path.abspath(os.fspath(path))
    group = world_group()
    writer = writer_for(format)
    mark_call("zerokit.checkpoint.save()", model, group)
    with alive(group), whole_shards(model, optimizer):  # state sharded over replicas
        save_prepared(path, prepare(model, optimizer, extra), writer, group, timeout)


@dataclass
class Prepared:
    """What a rank saves, collected and checked; ``error`` what went wrong here (told to every
    rank by ``save_prepared`` before anything is written)."""

    h: Holdings | None
    extras: dict
    error: str | None


def prepare(model, optimizer, extra) -> Prepared:
    h, extras, error = None, {}, None
    try:
        h = collect(model, optimizer)
        extras = _local_checks(h, extra)
    except CheckpointError as e:
        error = str(e)
    except Exception as e:  # every rank must hear of it, or the others would wait for it
        error = f"{type(e).__name__}: {e}"
    return Prepared(h, extras, error)


def _agree(path: str, p: Prepared, writer, group, timeout) -> tuple[dict, dict | None]:
    """Every rank's error (if any) told to all, then the path, model, optimizer, extra keys
    and layout agreed. Returns which extra keys differ per rank, and the pipeline's view."""
    h, extras = p.h, p.extras
    digests = {k: extra_state.digest(*v) for k, v in extras.items()}
    replies = raise_any(gather_json("checkpoint.save", [p.error, digests], group, timeout))
    world = world_view(h, "checkpoint.save", group, timeout)
    agree_on(
        "checkpoint.save: what and where",
        {
            "the path": path.encode(),
            "the format": writer.name.encode(),
            "the model's tensors": model_fingerprint(h) if world is None else world["fingerprint"],
            "the optimizer": optimizer_fingerprint(h),
            "the extra state's keys": json.dumps(sorted(extras)).encode(),
            "the layout": json.dumps(h.layout, sort_keys=True).encode(),
        },
        group,
        timeout,
    )
    return {k: len({d[k] for _, d in replies}) > 1 for k in extras}, world


def _make_temp(path: str) -> tuple[SaveLock | None, str | None, str | None]:
    """Rank 0: the lock, the path checked, debris cleared, a temp directory made."""
    lock = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)  # as `mkdir -p` would
        lock = SaveLock(path).acquire()
        refused = why_not_replaceable(path)
        if refused:
            raise CheckpointError(
                f"{refused}; zerokit never replaces it: choose another path, or remove it yourself"
            )
        clear_debris(path)
        return lock, make_temp(path), None
    except (CheckpointError, OSError) as e:
        return (
            lock,
            None,
            str(e) if isinstance(e, CheckpointError) else f"cannot prepare {path}: {e}",
        )


def save_prepared(path: str, p: Prepared, writer, group, timeout) -> None:
    """The collective part of a save, from what ``prepare`` collected (see the module's
    note): agree, make the temp directory, write, and let rank 0 finish with ``writer``."""
    per_rank, world = _agree(path, p, writer, group, timeout)
    lock, tmp, committed = None, None, False
    try:
        error = None
        if _rank() == 0:
            lock, tmp, error = _make_temp(path)
        made = gather_json("checkpoint.save: directory", [error, tmp], group, timeout)
        if made[0][0] is not None:
            raise CheckpointError(made[0][0])
        tmp = made[0][1]
        shard, error = None, None
        try:
            if not os.path.isdir(tmp):
                raise CheckpointError(
                    f"cannot see {tmp}, which rank 0 made: all ranks must share one file system"
                )
            shard = writer.write(tmp, p.h, p.extras, per_rank)
        except CheckpointError as e:
            error = str(e)
        except Exception as e:  # disk full, permissions: every rank must hear of it
            error = f"writing its shard failed: {type(e).__name__}: {e}"
        written = gather_json("checkpoint.save: written", [error, shard], group, timeout)
        shards = [s for _, s in raise_any(written)]
        error = None
        if _rank() == 0:
            try:
                writer.finish(path, tmp, p.h, shards, per_rank, world)
                committed = True
            except Exception as e:
                error = f"finishing the checkpoint failed: {type(e).__name__}: {e}"
            lock.release()
        raise_any(gather_json("checkpoint.save: committed", [error, None], group, timeout))
    finally:
        if _rank() == 0:
            if tmp is not None and not committed:
                remove(tmp)
            if lock is not None:
                lock.release()


def raise_any(replies: list) -> list:
    """Raise the same ``CheckpointError`` on every rank if any rank's ``[error, ...]`` reply
    holds an error; else return the replies."""
    failed = [(r, e) for r, (e, _) in enumerate(replies) if e is not None]
    if len(replies) == 1 and failed:
        raise CheckpointError(failed[0][1])
    if failed:
        raise CheckpointError("; ".join(f"rank {r}: {e}" for r, e in failed))
    return replies


def _commit(path: str, tmp: str, index: dict) -> None:
    for name, listed in index["files"].items():  # written where rank 0 sees them
        full = os.path.join(tmp, name)
        if not os.path.isfile(full) or os.path.getsize(full) != listed["size"]:
            raise CheckpointError(
                f"{full} is not there as written: all ranks must share one file system"
            )
    index_tmp = os.path.join(tmp, INDEX_NAME + ".tmp")
    with open(index_tmp, "wb") as f:
        f.write(seal(index))
        f.flush()
        os.fsync(f.fileno())
    os.replace(index_tmp, os.path.join(tmp, INDEX_NAME))
    swap_in(path, tmp)


def swap_in(path: str, tmp: str) -> None:
    """The finished temp directory (its files fsynced) becomes ``path``: ``path`` moved to
    ``.zerokit-old``, ``tmp`` renamed to ``path``, the old one removed."""
    _fsync_dir(tmp)
    refused = why_not_replaceable(path)  # again: something may have appeared meanwhile
    if refused:
        raise CheckpointError(f"{refused}; zerokit never replaces it")
    old = path + OLD_SUFFIX
    if os.path.lexists(path):
        os.replace(path, old)
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path))
    remove(old)
