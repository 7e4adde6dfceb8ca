"""The checkpoint format: one JSON index beside per-rank safetensors files.

Note: the index alone says where every value is. For each tensor (a parameter, a persistent
buffer, or ``optim.<state>.<parameter>``): its full shape, dtype, tensor-parallel split and,
per tp part, pieces ``(file, key, start, numel)`` that tile the flattened tp-local tensor.
Each file is listed with its size and sha256. Nothing is parsed from file names, and nothing
is ever unpickled: safetensors holds raw bytes and a JSON header only.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re

import torch
from safetensors import SafetensorError, safe_open

from ..tensor_parallel.topology import TPSplit
from .streaming import SAFETENSORS_DTYPES

FORMAT = "zerokit-checkpoint"
FORMAT_VERSION = 1
INDEX_NAME = "index.json"
_SAFE_FILE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*\.safetensors$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as it is; the message names the file or tensor."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str, what: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"{what}: unknown dtype {name!r}")
    return dtype


def split_from_json(tp: dict | None) -> TPSplit | None:
    return None if tp is None else TPSplit(tp["dim"], tuple(tp["block_sizes"]), tp["stride"])


def split_to_json(split: TPSplit | None) -> dict | None:
    if split is None:
        return None
    return {"dim": split.dim, "block_sizes": list(split.block_sizes), "stride": split.stride}


def part_numel(entry: dict, tp_rank: int) -> int:
    shape = list(entry["shape"])
    split = split_from_json(entry["tp"])
    if split is not None:
        shape[split.dim] = split.local_size(tp_rank)
    return math.prod(shape)


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def read_index(directory: str) -> dict:
    """Parse and check the index of ``directory``: structure, names, and that every tensor's
    pieces tile it exactly. Files are checked when they are read (``CheckpointReader``)."""
    path = os.path.join(directory, INDEX_NAME)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no checkpoint index here (missing or incomplete save)")
    try:
        with open(path, encoding="utf-8") as f:
            index = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable index: {e}") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a zerokit checkpoint index")
    if index.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format version {index.get('format_version')!r}; this zerokit reads "
            f"version {FORMAT_VERSION} (upgrade zerokit to read newer checkpoints)"
        )
    for name in index["files"]:
        if not _SAFE_FILE.match(name) or os.path.basename(name) != name:
            raise CheckpointError(
                f"{path}: file name {name!r} would escape the checkpoint directory"
            )
    for name, entry in index["tensors"].items():
        check_tensor_entry(name, entry, index["files"])
    return index


def check_tensor_entry(name: str, entry: dict, files: dict) -> None:
    """A tensor's index entry: safe name, known dtype, and pieces that tile each tp part."""
    if not name or "/" in name or "\\" in name or ".." in name.split("."):
        raise CheckpointError(f"tensor name {name!r} would escape the checkpoint directory")
    dtype_from_name(entry["dtype"], name)
    split = split_from_json(entry["tp"])
    parts = range(len(split.block_sizes)) if split else range(1)
    if split is not None and split.full_size != entry["shape"][split.dim]:
        raise CheckpointError(f"{name}: tensor-parallel split does not add up to its shape")
    if set(entry["parts"]) - {str(t) for t in parts}:
        raise CheckpointError(f"{name}: has parts {sorted(entry['parts'])}, expected {list(parts)}")
    for t in parts:
        pieces = sorted(entry["parts"].get(str(t), []), key=lambda piece: piece["start"])
        end = 0
        for piece in pieces:
            if piece["file"] not in files:
                raise CheckpointError(f"{name}: piece in unlisted file {piece['file']!r}")
            if piece["start"] < end:
                raise CheckpointError(f"{name}: pieces overlap at element {piece['start']}")
            if piece["start"] > end:
                raise CheckpointError(f"{name}: elements {end}..{piece['start']} are in no piece")
            end = piece["start"] + piece["numel"]
        if end != part_numel(entry, t):
            raise CheckpointError(
                f"{name}: pieces cover {end} of {part_numel(entry, t)} elements (part {t})"
            )


class CheckpointReader:
    """Reads slices of checkpoint tensors, checking each file (size, sha256, header) once."""

    def __init__(self, directory: str, index: dict):
        self.directory, self.index = directory, index
        self._open: dict[str, object] = {}

    def verify_file(self, name: str):
        """Open a listed file once, after checking its size, sha256 and header."""
        if name in self._open:
            return self._open[name]
        path = os.path.join(self.directory, name)
        listed = self.index["files"][name]
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: missing")
        if os.path.getsize(path) != listed["size"]:
            raise CheckpointError(
                f"{path}: {os.path.getsize(path)} bytes, the index says {listed['size']} (truncated?)"
            )
        if sha256_of(path) != listed["sha256"]:
            raise CheckpointError(
                f"{path}: sha256 does not match the index (corrupted or replaced)"
            )
        try:
            handle = safe_open(path, framework="pt")
            keys = set(handle.keys())
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{path}: not a valid safetensors file: {e}") from None
        for tensor, entry in self.index["tensors"].items():
            for pieces in entry["parts"].values():
                for piece in pieces:
                    if piece["file"] == name:
                        self._check_header(handle, keys, path, tensor, entry, piece)
        self._open[name] = handle
        return handle

    @staticmethod
    def _check_header(handle, keys, path, tensor, entry, piece) -> None:
        if piece["key"] not in keys:
            raise CheckpointError(f"{path}: has no {piece['key']!r} (piece of {tensor})")
        sl = handle.get_slice(piece["key"])
        dtype = SAFETENSORS_DTYPES.get(dtype_from_name(entry["dtype"], tensor))
        if sl.get_shape() != [piece["numel"]] or sl.get_dtype() != dtype:
            raise CheckpointError(
                f"{path}: {piece['key']!r} is {sl.get_dtype()} {sl.get_shape()}, the index says "
                f"{entry['dtype']} [{piece['numel']}] (piece of {tensor})"
            )

    def read_part(self, name: str, tp_rank: int, start: int, numel: int) -> torch.Tensor:
        """Elements ``[start, start + numel)`` of tp part ``tp_rank`` of ``name``, flattened."""
        entry = self.index["tensors"][name]
        out = torch.empty(numel, dtype=dtype_from_name(entry["dtype"], name))
        for piece in entry["parts"].get(str(tp_rank), []):
            lo, hi = max(start, piece["start"]), min(start + numel, piece["start"] + piece["numel"])
            if lo < hi:
                sl = self.verify_file(piece["file"]).get_slice(piece["key"])
                out[lo - start : hi - start] = sl[lo - piece["start"] : hi - piece["start"]]
        return out

    def read_full(self, name: str) -> torch.Tensor:
        """The whole tensor, tp parts assembled, in its full shape."""
        entry = self.index["tensors"][name]
        split = split_from_json(entry["tp"])
        if split is None:
            return self.read_part(name, 0, 0, part_numel(entry, 0)).view(entry["shape"])
        parts = []
        for t in range(len(split.block_sizes)):
            shape = list(entry["shape"])
            shape[split.dim] = split.local_size(t)
            parts.append(self.read_part(name, t, 0, part_numel(entry, t)).view(shape))
        return split.assemble(parts)
