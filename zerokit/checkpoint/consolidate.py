"""Offline tools (no process group): describe a checkpoint, consolidate it to plain files, and
load a consolidated file into a plain model.

Consolidation streams: sizes and headers of every file are checked first (no tensor can claim
more bytes than its files hold), the sha256s are computed in threads beside the writing and
checked before it returns (on a mismatch what was written is removed), and each tensor is
written from its pieces' mapped bytes (a tp-split one assembled first), so at most one tensor
is in memory at a time. Tied names are stored once; the ``zerokit_aliases`` metadata names
the others, and ``load_consolidated`` restores them.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from ..memory import format_bytes
from .dcp_format import is_dcp
from .holdings import OPTIM_PREFIX
from .index import INDEX_NAME, CheckpointError, dtype_from_name
from .reading import CheckpointReader, kind_of
from .streaming import write_safetensors
from .writers import ALIASES_KEY, HF_INDEX, Writers, hf_index, plan_files, write_set


def _nbytes(entry: dict) -> int:
    return math.prod(entry["shape"]) * dtype_from_name(entry["dtype"], "").itemsize


@dataclass(frozen=True)
class Export:
    """What an export writes: tensors (``name -> (dtype, shape)``, in order), each ``read``
    just before its bytes go out (a tensor, or buffers holding its bytes), and what the
    files' metadata and the set's index say."""

    tensors: dict[str, tuple[torch.dtype, list[int]]]
    read: Callable
    metadata: dict[str, str]
    aliases: dict[str, str]
    model_config: dict[str, str]  # config.json's text, ...: from_pretrained needs them


def write_file(path: str, export: Export) -> None:
    """Every tensor of ``export`` in one safetensors file (no sha256: no one will check it)."""
    entries = [
        (name, dtype, list(shape), lambda name=name: export.read(name))
        for name, (dtype, shape) in export.tensors.items()
    ]
    write_safetensors(path, entries, export.metadata, digest=False)


def write_hf_set(
    output: str,
    export: Export,
    max_shard_size: int,
    many: Writers,
    start_check=lambda writer: lambda: None,
) -> list[str]:
    """``export`` as a Hugging Face set in the directory ``output``, with its index and config
    files, split across ``many`` writers (``writers.write_set``)."""
    sizes = {n: math.prod(shape) * dtype.itemsize for n, (dtype, shape) in export.tensors.items()}
    files = plan_files(sizes, max_shard_size)
    index = hf_index(files, sum(sizes.values()), export.aliases)

    def write_one(path: str, file) -> None:
        write_file(path, replace(export, tensors={n: export.tensors[n] for n in file.tensors}))

    finish = {HF_INDEX: index, **export.model_config}
    return write_set(output, files, write_one, finish, many, start_check)


def parse_size(text: str) -> int:
    """'5GB', '500MB', '1.5GiB', '1000' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"not a size: {text!r} (e.g. 5GB, 500MB)")
    unit = match.group(2).upper().rstrip("B")
    base = 1024 if unit.endswith("I") else 1000
    power = " KMGT".index(unit.rstrip("I") or " ")
    size = int(float(match.group(1)) * base**power)
    if size < 1:
        raise ValueError(f"--max-shard-size must be at least 1 byte, got {text!r}")
    return size


def _check_file_output(path: str, what: str) -> None:
    """A new or replaceable ``.safetensors`` file in an existing directory."""
    if os.path.isdir(path) or path.endswith(os.sep):
        raise CheckpointError(
            f"{what} {path} is a directory: give a .safetensors file name, or "
            "--max-shard-size to write a set of files into a directory"
        )
    if not path.endswith(".safetensors"):
        raise CheckpointError(f"{what} {path} must end in .safetensors")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise CheckpointError(f"{what} {path}: the directory {parent} does not exist")
    if os.path.lexists(path):
        mode = os.lstat(path).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
            raise CheckpointError(f"{what} {path} is {kind_of(mode)}")


def consolidate(
    checkpoint: str,
    output: str,
    max_shard_size: int | None = None,
    optimizer_output: str | None = None,
    verify: bool = True,
    writers: int = 1,
    group=None,
) -> list[str]:
    """Write the full model, with the plain model's names and shapes, as one safetensors file
    (``load_consolidated(path, plain_model)`` loads it, tied names included) or, with
    ``max_shard_size``, as a Hugging Face style set in the directory ``output``, with the
    model's ``config.json`` where it had one (``from_pretrained(output)`` loads it), written by
    ``writers`` local processes or every rank of ``group`` (each calls this): the same bytes
    as one writer's. ``optimizer_output``: the full optimizer state there too. ``verify=False``
    trusts the files' contents: sizes and headers are still checked, not the sha256s. Returns
    the files written; on an error, the files it wrote are removed."""
    many = Writers(group, writers)
    if many.size() > 1 and (max_shard_size is None or optimizer_output is not None):
        raise CheckpointError(
            "several writers split a set of files: give --max-shard-size, and write "
            "--optimizer in a run of one writer"
        )
    with CheckpointReader(checkpoint) as reader:
        _check_outputs(reader, output, max_shard_size, optimizer_output)
        reader.verify_all(hash=False)  # sizes and headers on every writer, before any byte
        model, state = _exports(reader)
        check = _sha256_check(reader, verify, many)
        written = []
        try:
            if optimizer_output is not None:  # first: a failing set leaves nothing of itself
                written.append(_write_checked(optimizer_output, state, check))
            if max_shard_size is None:
                written.insert(0, _write_checked(output, model, check))
            else:
                written[:0] = write_hf_set(output, model, max_shard_size, many, check)
        except BaseException:
            for path in written:
                os.unlink(path)
            raise
    return written


def _check_outputs(reader, output: str, max_shard_size, optimizer_output) -> None:
    directory = os.path.realpath(reader.directory)
    for out in (output, optimizer_output):
        if out is not None and os.path.commonpath([os.path.realpath(out), directory]) == directory:
            raise CheckpointError(
                f"{out} is inside the checkpoint {reader.directory} it reads: write it elsewhere"
            )
    parent = os.path.dirname(os.path.abspath(output))
    if max_shard_size is None:
        _check_file_output(output, "output")
    elif os.path.lexists(output) and not os.path.isdir(output):
        raise CheckpointError(
            f"output {output} exists and is not a directory (--max-shard-size writes a directory)"
        )
    elif not os.path.isdir(parent):
        raise CheckpointError(f"output {output}: the directory {parent} does not exist")
    if optimizer_output is not None:
        _check_file_output(optimizer_output, "--optimizer")
        if reader.index["optimizer"] is None:
            raise CheckpointError(f"{reader.directory}: holds no optimizer state")


def _exports(reader) -> tuple[Export, Export]:
    """The model's tensors and the optimizer's state, read from the checkpoint."""
    index = reader.index

    def read(name: str):
        if index["tensors"][name]["tp"] is None:  # its pieces, straight from the mappings
            return reader.buffers(name)
        return reader.read_full(name)  # tp parts assembled: one tensor in memory at a time

    def described(optim: bool) -> dict:
        return {
            n: (dtype_from_name(e["dtype"], n), e["shape"])
            for n, e in index["tensors"].items()
            if n.startswith(OPTIM_PREFIX + ".") == optim
        }

    metadata = {
        "format": "pt",
        "zerokit_source": os.path.basename(os.path.abspath(reader.directory)),
        ALIASES_KEY: json.dumps(index["aliases"]),
    }
    model = Export(
        described(False), read, metadata, index["aliases"], index.get("model_config", {})
    )
    optim = metadata | {"optimizer": json.dumps(index["optimizer"])}
    return model, replace(model, tensors=described(True), metadata=optim)


def _sha256_check(reader, verify: bool, many: Writers):
    """``start_check(writer)``: that writer's share of the files' sha256s (all of them unless
    a group's ranks share them), hashed in threads beside the first write. Every file, as
    each rank's file holds its model and optimizer pieces together."""
    left = sorted(reader.index["files"]) if verify else []

    def start(writer: int):
        share = left[writer :: many.size()] if many.group is not None else list(left)
        left.clear()
        return reader.verify_all(hash_in_background=True, hash=bool(share), hashed=set(share))

    return start


def _write_checked(path: str, export: Export, check) -> str:
    wait = check(0)
    write_file(path, export)
    try:
        wait()
    except BaseException:
        os.unlink(path)
        raise
    return path


def load_consolidated(path: str | os.PathLike, model: nn.Module, strict: bool = True):
    """Load a consolidated file (or a ``--max-shard-size`` directory) into a plain model, tied
    names included (they are stored once; the metadata names the others). Returns what
    ``model.load_state_dict`` returns."""
    path = os.fspath(path)
    if os.path.isdir(path):
        with open(os.path.join(path, HF_INDEX), encoding="utf-8") as f:
            hf = json.load(f)
        state = {}
        for fname in sorted(set(hf["weight_map"].values())):
            if os.path.basename(fname) != fname:
                raise CheckpointError(f"{path}/{HF_INDEX}: file name {fname!r} would escape it")
            state.update(load_file(os.path.join(path, fname)))
        aliases = hf.get("metadata", {}).get(ALIASES_KEY, {})
    else:
        with safe_open(path, framework="pt") as f:
            aliases = json.loads((f.metadata() or {}).get(ALIASES_KEY, "{}"))
        state = load_file(path)
    for alias, target in aliases.items():
        if target in state and alias not in state:
            state[alias] = state[target]
    return model.load_state_dict(state, strict=strict)


def describe(checkpoint: str, tensors: bool = False) -> tuple[str, bool]:
    """A report for a person (a summary; ``tensors=True`` adds one line per tensor), and
    whether the checkpoint is complete and verified. A DCP directory gets its own summary."""
    if is_dcp(checkpoint) and not os.path.exists(os.path.join(checkpoint, INDEX_NAME)):
        from .dcp_load import describe_dcp

        return describe_dcp(os.fspath(checkpoint))
    with CheckpointReader(checkpoint) as reader:
        problems = []
        for name in reader.index["files"]:
            try:
                reader.verify_file(name)
            except CheckpointError as e:
                problems.append(str(e))
        index, directory = reader.index, reader.directory
    layout = index["layout"]
    lines = [f"checkpoint {directory} (format version {index['format_version']})"]
    level = layout["level"] or "none (a bare model)"
    lines.append(
        f"saved by {layout['world_size']} rank(s), level {level}, ZeRO group of "
        f"{layout['zero_group_size']}, tp degree {layout['tp_degree']}"
        + (f", dp degree {layout['dp_degree']}" if layout["dp_degree"] else "")
        + (f", {layout['replicas']} replicas" if layout.get("replicas", 1) != 1 else "")
        + (f", {layout['pp_degree']} pipeline stages" if layout.get("pp_degree", 1) != 1 else "")
    )
    model = {n: e for n, e in index["tensors"].items() if not n.startswith(OPTIM_PREFIX + ".")}
    split = sum(1 for e in model.values() if e["tp"])
    tied = ", ".join(f"{a} -> {b}" for a, b in index["aliases"].items()) or "none"
    lines.append(
        f"model: {len(model)} tensors, {format_bytes(sum(map(_nbytes, model.values())))}"
        + (f" ({split} {_split_kind(layout)})" if split else "")
        + f"; tied: {tied}"
    )
    state = [e for n, e in index["tensors"].items() if n not in model]
    lines += _optimizer_lines(index["optimizer"], state)
    extra = index.get("extra", {})
    if extra:
        shown = [k + (" (per rank)" if e["per_rank"] else "") for k, e in extra.items()]
        lines.append(f"extra state: {', '.join(shown)}")
    total = sum(f["size"] for f in index["files"].values())
    lines.append(f"files: {len(index['files'])}, {format_bytes(total)}")
    if tensors:
        lines += _tensor_table(index["tensors"])
    ok = not problems
    lines.append(
        "complete and verified (every file present, sizes and sha256 match, every tensor covered)"
        if ok
        else "NOT usable:\n  " + "\n  ".join(problems)
    )
    if not tensors:
        lines.append("(--tensors lists every tensor)")
    return "\n".join(lines), ok


def _optimizer_lines(optim, state: list[dict]) -> list[str]:
    """Each optimizer's class, groups and state keys; the state's tensors and bytes."""
    if not optim:
        return []
    lines = []
    entries = optim if isinstance(optim, list) else [optim]
    for k, entry in enumerate(entries):
        held = [*entry["state_tensors"].values(), *entry.get("quantized_state", {}).values()]
        keys = sorted({key for ks in held for key in ks})
        keys += sorted({key for ks in entry["scalar_state"].values() for key in ks})
        quantized = " (block-quantized)" if entry.get("quantized_state") else ""
        lines.append(
            f"optimizer{f' {k}' if len(entries) > 1 else ''}: {entry['class']}, "
            f"{len(entry['param_groups'])} param group(s), "
            f"state {', '.join(keys) or 'none yet'}{quantized}"
        )
    lines.append(f"optimizer state: {len(state)} tensors, {format_bytes(sum(map(_nbytes, state)))}")
    return lines


def _split_kind(layout: dict) -> str:
    """What splits the index's split tensors: experts over ep ranks run on a mesh of dp alone
    (``layout.check_ep``: tp degree 1), so where ep > 1 every split is an expert split."""
    if layout.get("ep_degree", 1) > 1 and layout["tp_degree"] == 1:
        return f"split in {layout['ep_degree']} ep parts"
    return "split across tp ranks"


def _tensor_table(tensors: dict) -> list[str]:
    rows = [("tensor", "shape", "dtype", "tp split", "bytes")]
    for name, e in tensors.items():
        shape = "x".join(map(str, e["shape"])) or "scalar"
        tp = f"dim {e['tp']['dim']} x{len(e['tp']['block_sizes'])}" if e["tp"] else "-"
        rows.append((name, shape, e["dtype"], tp, format_bytes(_nbytes(e))))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[4] for row in rows]
