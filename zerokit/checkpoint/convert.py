"""``zerokit ckpt convert SRC DST --to dcp|zerokit|hf``: one process, no process group.

A checkpoint (zerokit's format or a DCP directory) is read as a ``_Full`` source and written
in the other format as if one rank had saved it: a zerokit checkpoint of world size 1, a DCP
directory with one ``.distcp`` file, or Hugging Face files (``consolidate.write_hf_set``).
Checkpoints are built in a temp directory and renamed into place, as ``save`` does; a path
holding anything but a checkpoint is refused.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from . import extra as extra_state
from .consolidate import Export, write_file, write_hf_set
from .dcp_format import OPTIMIZER, is_dcp
from .fields import scalar_value
from .index import (
    FORMAT,
    FORMAT_VERSION,
    INDEX_NAME,
    CheckpointError,
    dtype_from_name,
    dtype_name,
    piece_key,
    seal,
)
from .places import make_temp, remove, why_not_replaceable, write_whole
from .protocol import swap_in
from .reading import CheckpointReader, resolve
from .streaming import write_safetensors
from .writers import ALIASES_KEY, Writers

TARGETS = ("dcp", "zerokit", "hf")


@dataclass
class _Full:
    """A checkpoint as one process sees it: the model's tensors, each read whole when it is
    written, one at a time; the optimizer's class, groups and state; the extra state."""

    tensors: dict[str, tuple[torch.dtype, list[int]]]  # name -> dtype, shape: nothing read
    read: Callable[[str], torch.Tensor]
    aliases: dict[str, str] = field(default_factory=dict)
    optimizer_class: str | None = None
    groups: list[dict] = field(default_factory=list)  # {"hyperparameters", "params"}
    state: dict[str, dict] = field(default_factory=dict)  # param -> {key: tensor or number}
    extra: dict[str, object] = field(default_factory=dict)
    model_config: dict[str, str] = field(default_factory=dict)  # config.json's text, ...


def optimizer_state(reader: CheckpointReader, saved: dict) -> dict[str, dict]:
    """One saved optimizer's state as it held it: ``param -> {key: tensor or number}``."""
    state: dict[str, dict] = {}
    for param, keys in saved["state_tensors"].items():
        state.setdefault(param, {}).update({k: reader.read_full(t) for k, t in keys.items()})
    for param, scalars in saved["scalar_state"].items():
        for key, scalar in scalars.items():
            state.setdefault(param, {})[key] = scalar_value(scalar, key)
    return state


def saved_extra(reader: CheckpointReader, key: str):
    """The extra state ``key`` as saved (per rank: rank 0's)."""
    saved = reader.index["extra"][key]["values"][0]
    return extra_state.read_saved(saved, reader.read_tensor, key)


def _from_zerokit(reader: CheckpointReader, optimizer: bool) -> _Full:
    index = reader.index
    tensors = {
        n: (dtype_from_name(e["dtype"], n), e["shape"])
        for n, e in index["tensors"].items()
        if not n.startswith("optim.")
    }
    full = _Full(tensors, reader.read_full, dict(index["aliases"]))
    full.model_config = dict(index.get("model_config", {}))
    saved = index.get("optimizer")
    if isinstance(saved, list) and optimizer:
        raise CheckpointError(
            f"{reader.directory}: saved with {len(saved)} optimizers, and convert carries one: "
            "convert the model and extra state with the optimizers left out (--no-optimizer)"
        )
    if saved is not None and optimizer:
        full.optimizer_class, full.groups = saved["class"], saved["param_groups"]
        full.state = optimizer_state(reader, saved)
    full.extra = {key: saved_extra(reader, key) for key in index.get("extra", {})}
    return full


def _optimizer_class(groups: list[dict], state: dict) -> str:
    """DCP does not record the optimizer's class: told by its state and hyperparameters."""
    keys = {k for s in state.values() for k in s}
    if "exp_avg" in keys and groups:
        return "AdamW" if groups[0].get("decoupled_weight_decay", True) else "Adam"
    if "momentum_buffer" in keys or (
        groups and "momentum" in groups[0] and "dampening" in groups[0]
    ):
        return "SGD"
    raise CheckpointError(
        "cannot tell the DCP checkpoint's optimizer class (not Adam, AdamW or "
        "SGD): convert it with the optimizer left out (--no-optimizer)"
    )


def _from_dcp(directory: str, optimizer: bool) -> _Full:
    from .dcp_load import DcpDirectory, ask_extra, reads_of

    src = DcpDirectory.open(directory, set())
    meta = src.metadata.state_dict_metadata

    def read(name: str) -> torch.Tensor:
        reads = reads_of(src.metadata)
        out = reads.whole(src.model[name])
        reads.read(directory)
        return out

    described = {n: meta[src.model[n]] for n in sorted(src.model)}
    full = _Full({n: (md.properties.dtype, list(md.size)) for n, md in described.items()}, read)
    reads, asked = reads_of(src.metadata), {}
    if optimizer and src.groups:
        for param, keys in src.state.items():
            asked[param] = {
                k: reads.value(key) if not hasattr(meta[key], "size") else reads.whole(key)
                for k, key in keys.items()
            }
        groups = {i: {hk: reads.value(k) for hk, k in g.items()} for i, g in src.groups.items()}
    extras = {name: ask_extra(src, reads, name) for name in src.other if name != OPTIMIZER}
    reads.read(directory)
    for param, keys in asked.items():
        full.state[param] = {k: reads.got(r) for k, r in keys.items()}
    if asked:
        for i in sorted(groups):
            values = {hk: reads.values[k] for hk, k in groups[i].items()}
            params = values.pop("params", [])
            full.groups.append({"hyperparameters": _json(values), "params": list(params)})
        full.optimizer_class = _optimizer_class(
            [g["hyperparameters"] for g in full.groups], full.state
        )
    full.extra = {name: finish() for name, finish in extras.items()}
    full.aliases = _ties(full)
    full.tensors = {n: d for n, d in full.tensors.items() if n not in full.aliases}
    return full


def _ties(full: _Full) -> dict[str, str]:
    """DCP does not record tied weights (``get_state_dict`` gives each name its own entry):
    a name no param group holds, equal in shape, dtype and every bit to one a group holds, is
    taken for a tied name of it."""
    params = {p for g in full.groups for p in g["params"]}
    ties = {}
    for name, described in full.tensors.items():
        if name in params or not params:
            continue
        same = [p for p, d in full.tensors.items() if p in params and d == described]
        value = full.read(name) if same else None
        ties.update({name: next((p for p in same if torch.equal(full.read(p), value)), None)})
    return {name: p for name, p in ties.items() if p is not None}


def _json(values: dict) -> dict:
    """DCP's param-group values as the index keeps hyperparameters: JSON scalars and lists."""
    out = {}
    for key, value in values.items():
        value = value.item() if isinstance(value, torch.Tensor) else value
        value = list(value) if isinstance(value, tuple) else value
        if value is None or isinstance(value, (bool, int, float, str, list)):
            out[key] = value
    return out


def _to_zerokit(full: _Full, tmp: str) -> None:
    fname = "rank00000.safetensors"
    tensors, entries, scalars, state_names = {}, [], {}, {}

    def add(name: str, dtype, shape, produce) -> None:  # one piece, unless it is empty
        numel, key = math.prod(shape), piece_key(name, 0)
        piece = {"file": fname, "key": key, "start": 0, "numel": numel}
        parts = {"0": [piece]} if numel else {}
        tensors[name] = {
            "shape": list(shape),
            "dtype": dtype_name(dtype),
            "tp": None,
            "parts": parts,
        }
        if numel:
            entries.append((key, dtype, [numel], lambda: produce().reshape(-1)))

    for name, (dtype, shape) in full.tensors.items():
        add(name, dtype, shape, lambda name=name: full.read(name))
    for param, keys in full.state.items():
        for key, value in keys.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                state_names.setdefault(param, {})[key] = f"optim.{key}.{param}"
                add(f"optim.{key}.{param}", value.dtype, value.shape, lambda v=value: v)
            else:
                dtype = dtype_name(value.dtype) if isinstance(value, torch.Tensor) else None
                scalars.setdefault(param, {})[key] = {
                    "value": value.item() if dtype else value,
                    "tensor_dtype": dtype,
                }
    extra = {}
    for n, (key, value) in enumerate(sorted(full.extra.items())):
        doc, values = extra_state.encode(value, f"extra {key!r}")
        refs = []
        for i, t in enumerate(values):
            tkey = extra_state.tensor_key(n, 0, i)
            entries.append((tkey, t.dtype, list(t.shape), lambda t=t: t))
            refs.append(extra_state.tensor_ref(fname, tkey, t))
        extra[key] = {"per_rank": False, "values": [{"json": doc, "tensors": refs}]}
    size, sha = write_safetensors(
        os.path.join(tmp, fname), entries, {"format": FORMAT, "rank": "0"}
    )
    index = {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "layout": {"world_size": 1, "level": None, "dp_degree": None, "tp_degree": 1,
                   "zero_group_size": 1, "replicas": 1},
        "files": {fname: {"size": size, "sha256": sha}}, "tensors": tensors,
        "aliases": full.aliases, "extra": extra,
        **({"model_config": full.model_config} if full.model_config else {}),
        "optimizer": None if full.optimizer_class is None else {
            "class": full.optimizer_class, "param_groups": full.groups,
            "scalar_state": scalars, "state_tensors": state_names},
    }  # fmt: skip
    write_whole(os.path.join(tmp, INDEX_NAME), seal(index))


def _to_dcp(full: _Full, tmp: str) -> None:
    import pickle

    from .dcp_format import METADATA, MODEL
    from .dcp_save import DcpFile, dcp_metadata

    out = DcpFile(os.path.join(tmp, "__0_0.distcp"))
    try:
        for name in full.tensors:
            out.whole([MODEL, name], full.read(name))
        for param, keys in full.state.items():
            for key, value in keys.items():
                out.whole([OPTIMIZER, "state", param, key], value)
        out.param_groups(full.groups)
        for key, value in full.extra.items():
            out.value([key], value)
    finally:
        out.close()

    class _Aliases:  # what dcp_metadata reads of a rank's holdings
        aliases = full.aliases

    metadata = dcp_metadata(_Aliases, [{"file": out.name, "items": out.items}])
    write_whole(os.path.join(tmp, METADATA), pickle.dumps(metadata))


def _to_hf(full: _Full, output: str, max_shard_size: int | None, many: Writers) -> list[str]:
    """One ``model.safetensors`` in the directory ``output``, or a set split across ``many``."""
    metadata = {"format": "pt", ALIASES_KEY: json.dumps(full.aliases)}
    export = Export(full.tensors, full.read, metadata, full.aliases, full.model_config)
    if max_shard_size is not None:
        if os.path.lexists(output) and not os.path.isdir(output):
            raise CheckpointError(f"output {output} exists and is not a directory")
        return write_hf_set(output, export, max_shard_size, many)
    os.makedirs(output, exist_ok=True)
    write_file(os.path.join(output, "model.safetensors"), export)
    for name, text in full.model_config.items():  # from_pretrained(output) needs config.json
        with open(os.path.join(output, name), "w", encoding="utf-8") as f:
            f.write(text)
    return [os.path.join(output, n) for n in ("model.safetensors", *full.model_config)]


def convert(
    source: str,
    output: str,
    to: str,
    optimizer: bool = True,
    max_shard_size: int | None = None,
    writers: int = 1,
    group=None,
) -> list[str]:
    """Write the checkpoint ``source`` (zerokit's or DCP) as ``to`` (``"dcp"``, ``"zerokit"``
    or ``"hf"``) at ``output``; returns what was written. ``--to hf`` with ``max_shard_size``
    writes a set of files, split across ``writers`` local processes or the ranks of
    ``group`` (each calls this): the same bytes as one writer's."""
    if to not in TARGETS:
        raise ValueError(f"--to {to!r}: one of {', '.join(TARGETS)}")
    many = Writers(group, writers)
    if (many.size() > 1 or max_shard_size is not None) and (to != "hf" or max_shard_size is None):
        raise CheckpointError(
            "several writers and --max-shard-size write a set of files: use them together, "
            "with --to hf"
        )
    output, directory = os.path.abspath(output), resolve(source)
    if is_dcp(directory) and not os.path.exists(os.path.join(directory, INDEX_NAME)):
        return _write(_from_dcp(directory, optimizer), output, to, max_shard_size, many)
    with CheckpointReader(source) as reader:  # open while the tensors are read
        reader.verify_all()
        return _write(_from_zerokit(reader, optimizer), output, to, max_shard_size, many)


def _write(full: _Full, output: str, to: str, max_shard_size, many: Writers) -> list[str]:
    if to == "hf":
        return _to_hf(full, output, max_shard_size, many)
    refused = why_not_replaceable(output)
    if refused:
        raise CheckpointError(f"{refused}; zerokit never replaces it")
    os.makedirs(os.path.dirname(output), exist_ok=True)  # as save does (`mkdir -p`)
    tmp = make_temp(output)
    try:
        (_to_dcp if to == "dcp" else _to_zerokit)(full, tmp)
        swap_in(output, tmp)
    except BaseException:
        remove(tmp)
        raise
    return [output]
