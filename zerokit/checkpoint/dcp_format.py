"""What zerokit needs of torch.distributed.checkpoint's (DCP's) directory format, read and
written without DCP's collectives: its ``.metadata``, its keys, and zerokit's flat ranges as
DCP's boxes.

Note: a DCP directory is ``.metadata`` (a pickled ``Metadata``: for every key of the flattened
state dict, its full size, dtype and the boxes ("chunks": offsets and sizes) it was saved in,
and where each box's bytes are) beside ``__<rank>_<n>.distcp`` files holding each box as a
``torch.save``d tensor, or ``torch.save``d bytes for a non-tensor value. The metadata is read
here with an unpickler that knows only DCP's metadata classes, torch sizes and dtypes, so a
checkpoint from elsewhere cannot run code through it; tensors and values are read with
``torch.load(weights_only=True)``. A rank's holdings are flat ranges of (tp-local) tensors;
a flat range of a tensor is at most ``2 * ndim - 1`` boxes, each contiguous in the flat order
(``boxes``), so either side can be described in the other's terms.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import pickle

import torch

from .index import CheckpointError

METADATA = ".metadata"
MODEL, OPTIMIZER = "model", "optimizer"
_WRAPPERS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": set(
        "Metadata TensorStorageMetadata BytesStorageMetadata ChunkStorageMetadata "
        "TensorProperties MetadataIndex StorageMeta _MEM_FORMAT_ENCODING".split()
    ),
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's metadata classes, ``torch.Size`` and dtypes; anything else is refused."""

    def find_class(self, module: str, name: str):
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch":
            value = getattr(torch, name, None)
            if name == "Size" or isinstance(
                value, (torch.dtype, torch.layout, torch.memory_format)
            ):
                return value
        raise CheckpointError(
            f"{METADATA} refers to {module}.{name}, which DCP's metadata never holds "
            "(refused: unpickling it could run code)"
        )


def is_dcp(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a DCP directory (it holds ``.metadata``)."""
    return os.path.isfile(os.path.join(os.fspath(path), METADATA))


def read_metadata(directory: str):
    """The ``Metadata`` of a DCP directory and the sha256 of its bytes."""
    from torch.distributed.checkpoint.metadata import Metadata

    where = os.path.join(directory, METADATA)
    with open(where, "rb") as f:
        raw = f.read()
    try:
        metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(
            f"{where}: unreadable DCP metadata: {type(e).__name__}: {e}"
        ) from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointError(f"{where}: not DCP metadata")
    return metadata, hashlib.sha256(raw).hexdigest()


def plain(name: str) -> str:
    """A state-dict name without the wrappers' components (torch.compile's ``_orig_mod``,
    activation checkpointing's ``_checkpoint_wrapped_module``, FSDP1's
    ``_fsdp_wrapped_module``)."""
    return ".".join(p for p in name.split(".") if p not in _WRAPPERS)


def path_of(key: str, metadata) -> tuple:
    """The nested path a flattened key came from (``planner_data``), else the key split at
    its first dot."""
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    path = paths.get(key)
    if isinstance(path, (tuple, list)) and path and all(isinstance(p, (str, int)) for p in path):
        return tuple(path)
    return tuple(key.split(".", 1))


def boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[tuple, tuple]]:
    """Elements ``[lo, hi)`` of a tensor of ``shape``, flattened, as boxes ``(offsets,
    sizes)`` in flat order; each box is contiguous in the flat order."""
    if lo >= hi:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    first, last = -(-lo // inner), hi // inner  # the full rows are [first, last)

    def row(r: int, a: int, b: int) -> list:
        return [((r, *o), (1, *s)) for o, s in boxes(shape[1:], a - r * inner, b - r * inner)]

    if first > last:  # inside one row
        return row(lo // inner, lo, hi)
    out = row(first - 1, lo, first * inner) if lo < first * inner else []
    if last > first:
        out.append(((first,) + (0,) * (len(shape) - 1), (last - first, *shape[1:])))
    if hi > last * inner:
        out += row(last, last * inner, hi)
    return out


def load_value(data: io.BytesIO, what: str):
    """A non-tensor value DCP stored (``torch.save``d), without running code."""
    try:
        return torch.load(data, weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"{what}: cannot be read without unpickling arbitrary objects ({type(e).__name__}: "
            f"{str(e)[:200]})"
        ) from None
