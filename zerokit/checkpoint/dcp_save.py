"""``save(..., format="dcp")``'s writer: a torch.distributed.checkpoint directory that FSDP2
loads with ``dcp.load({"model": msd, "optimizer": osd}, ...)`` and ``set_state_dict`` at any
world size.

The keys are those ``get_state_dict`` gives: ``model.<name>`` (tied names each, sharing the
stored boxes), ``optimizer.state.<param>.<state>`` (a scalar ``step`` as a 0-dim tensor),
``optimizer.param_groups.<i>.<hyperparameter>`` and ``params`` (parameter names), and each
extra key at the top level. Each rank writes the boxes of what it alone holds (``boxes``: its
flat ranges cut into DCP's chunks) to ``__<rank>_0.distcp``, each ``torch.save``d as DCP's
``FileSystemWriter`` does; rank 0 seals with the pickled ``.metadata``.
"""

from __future__ import annotations

import os
import pickle

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from . import extra as extra_state
from .dcp_format import METADATA, MODEL, OPTIMIZER, boxes
from .fields import scalar_value
from .holdings import OPTIM_PREFIX, Holdings, full_runs
from .index import CheckpointError, dtype_from_name, dtype_name


def _path(name: str) -> list:
    """The nested path of a zerokit tensor name in ``{"model": ..., "optimizer": ...}``."""
    if name.startswith(OPTIM_PREFIX + "."):
        key, param = name[len(OPTIM_PREFIX) + 1 :].split(".", 1)
        return [OPTIMIZER, "state", param, key]
    return [MODEL, name]


def _key(path: list) -> str:
    return ".".join(map(str, path))


def hyperparameter_value(value):
    """As the optimizer held it: torch's optimizers hold numeric pairs (``betas``) as tuples."""
    if isinstance(value, list) and value and not any(isinstance(v, str) for v in value):
        return tuple(value)
    return value


class DcpFile:
    """One rank's ``.distcp`` file, written item by item; ``items`` describes each."""

    def __init__(self, path: str):
        self.name = os.path.basename(path)
        self.f = open(path, "xb")
        self.items: list[dict] = []

    def tensor(self, path: list, tensor: torch.Tensor, offsets, shape) -> None:
        box = {"sizes": list(tensor.shape), "shape": list(shape), "dtype": dtype_name(tensor.dtype)}
        self._save(path, tensor.detach().to("cpu").clone(), list(offsets), box)  # the box alone

    def value(self, path: list, value) -> None:
        self._save(path, value, None, {})

    def _save(self, path: list, data, offsets: list | None, box: dict) -> None:
        at = self.f.tell()
        torch.save(data, self.f)
        length = self.f.tell() - at
        self.items.append({"path": path, "offsets": offsets, **box, "at": at, "length": length})

    def whole(self, path: list, value) -> None:
        """A tensor as one box, or a value."""
        if isinstance(value, torch.Tensor):
            self.tensor(path, value, (0,) * value.dim(), value.shape)
        else:
            self.value(path, value)

    def param_groups(self, groups: list[dict]) -> None:
        """Each group's hyperparameters and ``params`` (its parameters' names), as
        ``get_state_dict`` gives them."""
        for i, group in enumerate(groups):
            for key, value in group["hyperparameters"].items():
                self.value([OPTIMIZER, "param_groups", i, key], hyperparameter_value(value))
            self.value([OPTIMIZER, "param_groups", i, "params"], list(group["params"]))

    def close(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()


def _write_tensors(out: DcpFile, h: Holdings) -> None:
    """This rank's primary chunks as boxes, and the scalar state of the parameters whose
    first element it writes."""
    for chunk in h.chunks:
        if not chunk.primary or not chunk.tensor.numel():
            continue
        meta = h.metas[chunk.name]
        for lo, hi, at in full_runs(meta, chunk.start, chunk.tensor.numel()):
            for offsets, sizes in boxes(meta.shape, lo, hi):
                n = torch.Size(sizes).numel()
                box = chunk.tensor[at : at + n].view(sizes)
                out.tensor(_path(chunk.name), box, offsets, meta.shape)
                at += n
        first = chunk.start == 0 and (meta.split is None or meta.tp_rank == 0)
        for key, scalar in h.scalars.get(chunk.name, {}).items() if first else ():
            out.whole([OPTIMIZER, "state", chunk.name, key], scalar_value(scalar, key))


class DcpWriter:
    """the protocol's writer for ``format="dcp"``."""

    name = "dcp"

    def file_of(self, rank: int) -> str:
        return f"__{rank}_0.distcp"

    def write(self, tmp: str, rank: int, h: Holdings, extras: dict, per_rank: dict) -> dict:
        if h.pipeline is not None:
            raise CheckpointError(
                "format='dcp' cannot save a PipelineModule yet: save in "
                "zerokit's format (it loads at any pp degree)"
            )
        differing = sorted(k for k, v in per_rank.items() if v)
        if differing:
            raise CheckpointError(
                f"format='dcp' stores one value per extra key; {differing} "
                "differ between ranks (save them in zerokit's format)"
            )
        out = DcpFile(os.path.join(tmp, self.file_of(rank)))
        try:
            _write_tensors(out, h)
            if rank == 0:
                out.param_groups(h.groups)
                for key, (doc, tensors) in extras.items():
                    out.value([key], extra_state.decode(doc, tensors, f"extra {key!r}"))
        finally:
            out.close()
        return {"file": out.name, "items": out.items}

    def seal(self, tmp: str, h: Holdings, shards: list, per_rank, world) -> tuple[str, bytes]:
        return METADATA, pickle.dumps(dcp_metadata(h, shards))


def dcp_metadata(h: Holdings, shards: list) -> Metadata:
    """Every rank's items as DCP's ``Metadata``; each tensor covered exactly once."""
    described, storage, paths = {}, {}, {}
    for shard in shards:
        for item in shard["items"]:
            key = _key(item["path"])
            paths[key] = tuple(item["path"])
            where = _StorageInfo(shard["file"], item["at"], item["length"])
            storage[MetadataIndex(key, item["offsets"])] = where
            if item["offsets"] is None:
                described[key] = BytesStorageMetadata()
                continue
            if key not in described:
                properties = TensorProperties(dtype=dtype_from_name(item["dtype"], key))
                described[key] = TensorStorageMetadata(properties, torch.Size(item["shape"]), [])
            box = ChunkStorageMetadata(torch.Size(item["offsets"]), torch.Size(item["sizes"]))
            described[key].chunks.append(box)
    for key, md in described.items():
        if isinstance(md, TensorStorageMetadata):
            covered = sum(c.sizes.numel() for c in md.chunks)
            if covered != md.size.numel():
                raise CheckpointError(
                    f"{key}: the ranks wrote {covered} of its {md.size.numel()} elements"
                )
    for alias, stored in h.aliases.items():  # get_state_dict gives tied names each
        key, alias_key = _key([MODEL, stored]), _key([MODEL, alias])
        described[alias_key], paths[alias_key] = described[key], (MODEL, alias)
        for index, where in list(storage.items()):
            if index.fqn == key:
                storage[MetadataIndex(alias_key, index.offset)] = where
    return Metadata(
        described,
        planner_data=paths,
        storage_data=storage,
        storage_meta=StorageMeta(),
        version="1.0.0",
    )
