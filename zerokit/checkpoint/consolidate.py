"""Offline tools (no process group): describe a checkpoint, consolidate it to plain files.

Consolidation streams: the safetensors header is computed from the index first, then each
tensor is assembled from its pieces, written and dropped, so at most one tensor (and its tp
parts) is in memory at a time.
"""

from __future__ import annotations

import json
import math
import os
import re

from ..memory import format_bytes
from .holdings import OPTIM_PREFIX
from .index import CheckpointError, CheckpointReader, dtype_from_name, read_index
from .loading import resolve
from .streaming import write_safetensors


def _nbytes(entry: dict) -> int:
    return math.prod(entry["shape"]) * dtype_from_name(entry["dtype"], "").itemsize


def _write_safetensors(path: str, names: list[str], index: dict, reader, metadata: dict) -> None:
    entries = [
        (
            name,
            dtype_from_name(index["tensors"][name]["dtype"], name),
            index["tensors"][name]["shape"],
            lambda name=name: reader.read_full(name),  # one tensor in memory at a time
        )
        for name in names
    ]
    write_safetensors(path, entries, metadata)


def parse_size(text: str) -> int:
    """'5GB', '500MB', '1.5GiB', '1000' -> bytes."""
    match = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?i?B?)\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"not a size: {text!r} (e.g. 5GB, 500MB)")
    unit = match.group(2).upper().rstrip("B")
    base = 1024 if unit.endswith("I") else 1000
    power = " KMGT".index(unit.rstrip("I") or " ")
    return int(float(match.group(1)) * base**power)


def consolidate(
    checkpoint: str,
    output: str,
    max_shard_size: int | None = None,
    optimizer_output: str | None = None,
) -> list[str]:
    """Write the full model, with the plain model's names and shapes, as one safetensors file
    (``safetensors.torch.load_model(plain_model, output)`` loads it; tied weights stored once)
    or, with ``max_shard_size``, as a Hugging Face style set in the directory ``output``.
    ``optimizer_output``: also write the full optimizer state there. Returns the files written.
    """
    directory = resolve(checkpoint)
    index = read_index(directory)
    reader = CheckpointReader(directory, index)
    names = [n for n in index["tensors"] if not n.startswith(OPTIM_PREFIX + ".")]
    metadata = {"format": "pt", "zerokit_source": os.path.basename(os.path.abspath(directory))}
    written = []
    if max_shard_size is None:
        _write_safetensors(output, names, index, reader, metadata)
        written.append(output)
    else:
        shards, size = [[]], 0
        for name in names:
            nbytes = _nbytes(index["tensors"][name])
            if shards[-1] and size + nbytes > max_shard_size:
                shards.append([])
                size = 0
            shards[-1].append(name)
            size += nbytes
        os.makedirs(output, exist_ok=True)
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            _write_safetensors(os.path.join(output, fname), shard, index, reader, metadata)
            weight_map.update(dict.fromkeys(shard, fname))
            written.append(os.path.join(output, fname))
        total = sum(_nbytes(index["tensors"][n]) for n in names)
        hf_index = os.path.join(output, "model.safetensors.index.json")
        with open(hf_index, "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
        written.append(hf_index)
    if optimizer_output is not None:
        if index["optimizer"] is None:
            raise CheckpointError(f"{directory}: holds no optimizer state")
        state = [n for n in index["tensors"] if n.startswith(OPTIM_PREFIX + ".")]
        meta = metadata | {"optimizer": json.dumps(index["optimizer"])}
        _write_safetensors(optimizer_output, state, index, reader, meta)
        written.append(optimizer_output)
    return written


def describe(checkpoint: str) -> tuple[str, bool]:
    """A report for a person, and whether the checkpoint is complete and verified."""
    directory = resolve(checkpoint)
    index = read_index(directory)
    layout = index["layout"]
    lines = [f"checkpoint {directory} (format version {index['format_version']})"]
    level = layout["level"] or "none (a bare model)"
    lines.append(
        f"saved by {layout['world_size']} rank(s), level {level}, ZeRO group of "
        f"{layout['zero_group_size']}, tp degree {layout['tp_degree']}"
        + (f", dp degree {layout['dp_degree']}" if layout["dp_degree"] else "")
    )
    optim = index["optimizer"]
    if optim:
        keys = sorted({k for ks in optim["state_tensors"].values() for k in ks})
        keys += sorted({k for ks in optim["scalar_state"].values() for k in ks})
        lines.append(
            f"optimizer: {optim['class']}, {len(optim['param_groups'])} param group(s), "
            f"state {', '.join(keys) or 'none yet'}"
        )
    reader = CheckpointReader(directory, index)
    problems = []
    for name in index["files"]:
        try:
            reader.verify_file(name)
        except CheckpointError as e:
            problems.append(str(e))
    total = sum(f["size"] for f in index["files"].values())
    lines.append(f"files: {len(index['files'])}, {format_bytes(total)}")
    model = [n for n in index["tensors"] if not n.startswith(OPTIM_PREFIX + ".")]
    lines.append(
        f"tensors: {len(model)} model, {len(index['tensors']) - len(model)} optimizer state; "
        f"tied: {', '.join(f'{a} -> {b}' for a, b in index['aliases'].items()) or 'none'}"
    )
    lines.append(f"{'tensor':<40} {'shape':<16} {'dtype':<9} {'tp split':<14} bytes")
    for name, entry in index["tensors"].items():
        tp = entry["tp"]
        split = f"dim {tp['dim']} x{len(tp['block_sizes'])}" if tp else "-"
        shape = "x".join(map(str, entry["shape"])) or "scalar"
        lines.append(
            f"{name:<40} {shape:<16} {entry['dtype']:<9} {split:<14} {format_bytes(_nbytes(entry))}"
        )
    ok = not problems
    lines.append(
        "complete and verified (every file present, sizes and sha256 match, every tensor covered)"
        if ok
        else "NOT usable:\n  " + "\n  ".join(problems)
    )
    return "\n".join(lines), ok
