"""``load`` of a torch.distributed.checkpoint (DCP) directory, as FSDP2 and torchtitan write it
(``dcp.save({"model": msd, "optimizer": osd, ...})``, or the model's keys at the top level):
each rank asks DCP's resharding which saved boxes overlap its holdings and reads only those,
straight into staging. No DCP collective runs: the ranks meet in ``protocol.load_with``."""

from __future__ import annotations

import dataclasses
import math
import os

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from .dcp_format import MODEL, OPTIMIZER, boxes, load_value, path_of, plain, read_metadata
from .holdings import Chunk, Holdings, TensorMeta, full_runs
from .index import CheckpointError


class _Reads(LoadPlanner):
    """The reads one rank asks for: each destination is a view into its staging buffers."""

    def __init__(self, metadata):
        self.metadata = metadata
        self.items: list[ReadItem] = []
        self.targets: list[torch.Tensor] = []
        self.values: dict[str, object] = {}

    def tensor_range(self, key: str, meta: TensorMeta, start: int, into: torch.Tensor) -> None:
        """Elements ``[start, start + into.numel())`` of this rank's (tp-local) ``key``."""
        md = self.metadata.state_dict_metadata[key]
        chunks, first = [], len(self.targets)
        for lo, hi, at in full_runs(meta, start, into.numel()):
            for offsets, sizes in boxes(meta.shape, lo, hi):
                n = math.prod(sizes)
                self.targets.append(into[at : at + n].view(sizes))
                chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
                at += n
        got = 0
        for item in create_read_items_for_chunk_list(key, md, chunks):
            token = MetadataIndex(str(first + item.dest_index.index))
            self.items.append(dataclasses.replace(item, dest_index=token))
            got += math.prod(item.lengths)
        if got != into.numel():
            raise CheckpointError(
                f"{key}: the checkpoint's chunks cover {got} of the "
                f"{into.numel()} elements asked for (an incomplete save?)"
            )

    def whole(self, key: str) -> torch.Tensor:
        md = self.metadata.state_dict_metadata[key]
        out = torch.empty(md.size, dtype=md.properties.dtype)
        meta = TensorMeta(tuple(md.size), md.properties.dtype, None, 0)
        self.tensor_range(key, meta, 0, out.view(-1))
        return out

    def value(self, key: str) -> str:
        """Ask for a non-tensor value: ``self.values[key]`` once read."""
        empty, where = torch.Size((0,)), MetadataIndex(key)
        self.items.append(ReadItem(LoadItemType.BYTE_IO, where, empty, where, empty, empty))
        return key

    def got(self, ref, device=None):
        """What was read for ``ref``: a value asked by ``value`` (its key), or a tensor (a
        copy on ``device``, when given)."""
        if isinstance(ref, str):
            return self.values[ref]
        return ref if device is None else ref.clone().to(device)

    def read(self, directory: str) -> None:
        from torch.distributed.checkpoint import FileSystemReader

        reader = FileSystemReader(directory)
        reader.set_up_storage_reader(self.metadata, False)
        reader.read_data(LoadPlan(self.items), self).wait()

    # LoadPlanner: only what FileSystemReader.read_data calls (the planning half is ours)
    def resolve_tensor(self, req: ReadItem) -> torch.Tensor:
        target = self.targets[int(req.dest_index.fqn)]
        for dim, (offset, length) in enumerate(zip(req.dest_offsets, req.lengths)):
            target = target.narrow(dim, offset, length)
        return target

    def commit_tensor(self, req: ReadItem, tensor: torch.Tensor) -> None:
        pass

    def load_bytes(self, req: ReadItem, value) -> None:
        self.values[req.dest_index.fqn] = load_value(value, req.dest_index.fqn)


@dataclasses.dataclass
class DcpDirectory:
    """A DCP directory's keys, sorted into the model's, the optimizer's and the rest."""

    metadata: object
    digest: str  # the sha256 of its .metadata
    model: dict = dataclasses.field(default_factory=dict)  # plain name -> key
    state: dict = dataclasses.field(default_factory=dict)  # param -> {state key -> key}
    groups: dict = dataclasses.field(default_factory=dict)  # group -> {hyperparameter -> key}
    other: dict = dataclasses.field(default_factory=dict)  # top-level name -> keys

    @classmethod
    def open(cls, directory: str, extra_keys) -> DcpDirectory:
        src = cls(*read_metadata(directory))
        metadata, items = src.metadata, src.metadata.state_dict_metadata
        paths = {k: path_of(k, metadata) for k in items}
        rooted = any(p[0] == MODEL for p in paths.values())
        for key, path in paths.items():
            if path[0] == OPTIMIZER and len(path) == 4 and path[1] == "state":
                src.state.setdefault(plain(str(path[2])), {})[str(path[3])] = key
            elif path[0] == OPTIMIZER and len(path) == 4 and path[1] == "param_groups":
                src.groups.setdefault(int(path[2]), {})[str(path[3])] = key
            elif rooted and path[0] == MODEL and len(path) > 1:
                src.model[plain(".".join(map(str, path[1:])))] = key
            elif (
                not rooted
                and len(path) == 1
                and path[0] not in extra_keys
                and isinstance(items[key], TensorStorageMetadata)
            ):
                src.model[plain(key)] = key  # torchtitan: the model's keys at the top level
            else:
                src.other.setdefault(str(path[0]), []).append(key)
        return src


def _as_saved(value):
    """A hyperparameter as zerokit's index holds it (a number, a list)."""
    value = value.item() if isinstance(value, torch.Tensor) else value
    return list(value) if isinstance(value, tuple) else value


def ask_extra(src: DcpDirectory, reads: _Reads, name: str):
    """Ask for the entry ``name`` (every key under it, the caller knows it is there); returns
    the function that rebuilds its value once read."""
    keys, items = src.other[name], src.metadata.state_dict_metadata
    asked = [
        (
            path_of(k, src.metadata)[1:],
            reads.value(k) if isinstance(items[k], BytesStorageMetadata) else reads.whole(k),
        )
        for k in keys
    ]

    def finish():
        built = None
        for path, ref in asked:
            built = _put(built, path, reads.got(ref))
        return built

    return finish


def _put(into, path: tuple, value):
    """``into`` with ``value`` at the nested ``path`` (dicts by name, lists by index)."""
    if not path:
        return value
    head = path[0]
    if into is None:
        into = [] if isinstance(head, int) else {}
    if isinstance(into, list):
        into.extend([None] * (head + 1 - len(into)))
        into[head] = _put(into[head], path[1:], value)
    else:
        into[head] = _put(into.get(head), path[1:], value)
    return into


class DcpSource:
    """The protocol's source for a DCP directory (``protocol.load_with``): the metadata
    answers what it holds; the ranges asked for are read together at ``read``."""

    kind = "DCP checkpoint"
    read_what = "the checkpoint read (sha256 of its .metadata)"
    malformed_errors = (OSError, KeyError, TypeError, ValueError, RuntimeError)
    alike = True  # one message when every rank failed alike
    shape_differs = "{name} ({saved} in the checkpoint, {model} in the model)"

    def __init__(self, directory: str, extra_keys):
        self.where = self.directory = directory
        self.extra_keys, self.digest = extra_keys, ""

    def open(self, h: Holdings) -> None:
        if h.pipeline is not None:
            raise CheckpointError(
                "a PipelineModule cannot load a DCP checkpoint yet: load "
                "it into the plain model, or convert it to zerokit's format"
            )
        self.src = DcpDirectory.open(self.where, self.extra_keys)
        self.digest, self.extra_names = self.src.digest, sorted(self.src.other)
        self.items, self.reads = self.src.metadata.state_dict_metadata, _Reads(self.src.metadata)
        self.states: list[tuple[dict, torch.Tensor]] = []  # asked, each value read at ``read``

    def key_of(self, name: str, h: Holdings) -> str | None:
        """The checkpoint's key for ``name`` or for any name tied to it."""
        names = [name] + [a for a, s in h.aliases.items() if s == name]
        return next((self.src.model[n] for n in names if n in self.src.model), None)

    def unexpected(self, keys: set[str], h: Holdings) -> list[str]:
        known = set(h.param_names) | set(h.aliases)
        return sorted(n for n in self.src.model if n not in known)

    def described(self, key: str) -> tuple[list | str, torch.dtype | None]:
        md = self.items[key]
        if not isinstance(md, TensorStorageMetadata):
            return "not a tensor", None
        return list(md.size), md.properties.dtype

    def ask(self, key: str, meta: TensorMeta, chunk: Chunk) -> torch.Tensor:
        return self._range(key, meta, chunk, chunk.tensor.dtype)

    def _range(self, key: str, meta: TensorMeta, chunk: Chunk, dtype) -> torch.Tensor:
        data = torch.empty(chunk.tensor.numel(), dtype=dtype)
        self.reads.tensor_range(key, meta, chunk.start, data)
        return data

    def ask_groups(self, h: Holdings):
        if not self.src.groups:
            return None
        asked = [
            {hk: self.reads.value(k) for hk, k in g.items()}
            for _, g in sorted(self.src.groups.items())
        ]

        def saved() -> list[tuple[list, dict]]:
            out = []
            for refs in asked:
                values = {hk: _as_saved(self.reads.values[ref]) for hk, ref in refs.items()}
                params = [plain(p) for p in values.pop("params", [])]
                out.append(([h.aliases.get(p, p) for p in params], values))
            return out

        return saved

    def ask_state(self, chunk: Chunk, key_tensor, opt, meta: TensorMeta) -> dict:
        state = {}
        for skey, key in self.src.state.get(chunk.name, {}).items():
            md = self.items[key]
            if isinstance(md, BytesStorageMetadata):
                state[skey] = self.reads.value(key)  # a str: the key its value is read under
            elif tuple(md.size) == meta.shape:
                data = self._range(key, meta, chunk, md.properties.dtype)
                state[skey] = data.view(key_tensor.shape)
            elif len(md.size) == 0 or chunk.tensor.numel() == math.prod(meta.shape):
                # a scalar, or state in its own shape (Adafactor's row_var) of a parameter this
                # rank holds whole (the owner layout): read whole
                state[skey] = self.reads.whole(key)
            else:
                raise CheckpointError(
                    f"{key}: shape {list(md.size)}, neither {chunk.name}'s "
                    f"{list(meta.shape)} nor a scalar, and this rank holds part of it"
                )
        self.states.append((state, key_tensor))
        return state

    def ask_extra(self, key: str):
        return ask_extra(self.src, self.reads, key)

    def read(self) -> None:
        self.reads.read(self.directory)
        for state, key_tensor in self.states:  # each asked value, now read, where it is kept
            for key, ref in state.items():
                state[key] = self.reads.got(ref, key_tensor.device)

    def close(self) -> None:
        pass


def reads_of(metadata) -> _Reads:
    """A plan of reads from a DCP directory of ``metadata`` (for ``convert``)."""
    return _Reads(metadata)


def describe_dcp(directory: str) -> tuple[str, bool]:
    """``zerokit ckpt inspect`` of a DCP directory: its entries, and whether every tensor is
    covered by its chunks and every chunk's bytes are in a file there."""
    from ..memory import format_bytes

    src = DcpDirectory.open(directory, set())
    items = src.metadata.state_dict_metadata

    def nbytes(key: str) -> int:
        md = items[key]
        return md.size.numel() * md.properties.dtype.itemsize if hasattr(md, "size") else 0

    problems = []
    for key, md in items.items():
        covered = sum(c.sizes.numel() for c in getattr(md, "chunks", []))
        if isinstance(md, TensorStorageMetadata) and covered != md.size.numel():
            problems.append(f"{key}: its chunks cover {covered} of {md.size.numel()} elements")
    ends: dict[str, int] = {}  # file -> where its last chunk ends
    for where in (src.metadata.storage_data or {}).values():
        end = where.offset + where.length
        ends[where.relative_path] = max(ends.get(where.relative_path, 0), end)
    for name, end in sorted(ends.items()):
        full = os.path.join(directory, name)
        if not os.path.isfile(full) or os.path.getsize(full) < end:
            problems.append(f"{full}: missing or shorter than the {end} bytes the metadata places")
    state = sorted({k for keys in src.state.values() for k in keys})
    lines = [
        f"DCP checkpoint {directory} (torch.distributed.checkpoint; load and convert read it)",
        f"model: {len(src.model)} tensors, "
        f"{format_bytes(sum(nbytes(k) for k in src.model.values()))}",
        f"optimizer: {len(src.groups)} param group(s), state {', '.join(state) or 'none'}",
        f"other entries (extra state): {', '.join(sorted(src.other)) or 'none'}",
        f"files: {len(ends)}, {format_bytes(sum(ends.values()))}",
    ]
    ok = not problems
    lines.append("complete (every tensor covered, every chunk's bytes present)" if ok
                 else "NOT usable:\n  " + "\n  ".join(problems))  # fmt: skip
    return "\n".join(lines), ok
