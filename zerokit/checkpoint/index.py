"""The checkpoint format: one JSON index beside per-rank safetensors files.

Note: the index alone says where every value is, and ``validate`` checks all of it before
anything is read, allocated or copied. A piece's key is always ``<tensor>@<start>`` (a piece
cannot be pointed at another tensor's bytes), the pieces tile each tp part once and fit in
their file's listed size, and ``checksum``, the sha256 of the index's own canonical JSON,
refuses an edited or damaged index. Nothing is parsed from file names or ever unpickled.
"""

from __future__ import annotations

import hashlib
import json
import math
import re

from ..tensor_parallel.topology import TPSplit
from .extra import validate_extra
from .fields import (  # noqa: F401  (the index's names: re-exported)
    CheckpointError,
    as_dict,
    as_int,
    as_list,
    as_shape,
    check_keys,
    dtype_from_name,
    dtype_name,
    need,
)

FORMAT = "zerokit-checkpoint"
FORMAT_VERSION = 3
# Version 3 adds a list of optimizers, optimizer state held whole in a shape of its own, and
# block-quantized state; a version 2 checkpoint is a version 3 one without them.
READABLE_VERSIONS = (2, 3)
INDEX_NAME = "index.json"
MAX_INDEX_BYTES = 1 << 30
_SAFE_FILE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}\.safetensors$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_LEVEL = re.compile(r"^[a-z][a-z_]{0,31}$")


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


def piece_key(name: str, start: int) -> str:
    return f"{name}@{start}"


# -- the index's own checksum -----------------------------------------------------------------
def _canonical(index: dict) -> bytes:
    body = {k: v for k, v in index.items() if k != "checksum"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def seal(index: dict) -> bytes:
    """The index as written: its JSON with ``checksum``, the sha256 of the rest."""
    index = dict(index, checksum=hashlib.sha256(_canonical(index)).hexdigest())
    return json.dumps(index, indent=1, allow_nan=False).encode()


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise CheckpointError(f"{text} is not a finite number")
    return value


def parse_index(raw: bytes, where: str) -> dict:
    """Parse, checksum and validate an index read from ``where``."""
    try:
        index = json.loads(raw.decode("utf-8"), parse_constant=_finite, parse_float=_finite)
    except CheckpointError as e:
        raise CheckpointError(f"{where}: {e}") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{where}: unreadable index: {e}") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise CheckpointError(f"{where}: not a zerokit checkpoint index")
    if index.get("format_version") not in READABLE_VERSIONS:
        raise CheckpointError(
            f"{where}: format version {index.get('format_version')!r}; this zerokit reads "
            f"versions {' and '.join(map(str, READABLE_VERSIONS))} (use the zerokit that wrote it, "
            "or a newer one)"
        )
    if index.get("checksum") != hashlib.sha256(_canonical(index)).hexdigest():
        raise CheckpointError(
            f"{where}: the index's checksum does not match its contents (edited or corrupted)"
        )
    try:
        validate(index)
    except CheckpointError as e:
        raise CheckpointError(f"{where}: {e}") from None
    return index


# -- validation: every field, before anything is allocated ------------------------------------
def is_finite_number(value) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


def check_name(name, what: str = "tensor name") -> str:
    need(
        isinstance(name, str)
        and 0 < len(name) <= 1000
        and name.isprintable()
        and "/" not in name
        and "\\" not in name
        and ".." not in name.split("."),
        f"{what} {name!r} would escape the checkpoint directory or is not a plain name",
    )
    return name


def validate(index: dict) -> None:
    """Every field of an index: raises ``CheckpointError`` naming the first bad one."""
    check_keys(
        index,
        "index",
        {"format", "format_version", "checksum", "layout", "files", "tensors", "aliases"},
        frozenset({"optimizer", "extra", "model_config"}),
    )
    for name, text in as_dict(index.get("model_config", {}), "model_config").items():
        need(
            name in ("config.json", "generation_config.json") and isinstance(text, str),
            f"model_config: {name!r} is not a Hugging Face config file's text",
        )
    _check_layout(as_dict(index["layout"], "layout"))
    files = as_dict(index["files"], "files")
    for name, listed in files.items():
        need(
            bool(_SAFE_FILE.match(name)),
            f"file name {name!r} would escape the checkpoint directory (or is not *.safetensors)",
        )
        check_keys(as_dict(listed, f"files[{name!r}]"), f"files[{name!r}]", {"size", "sha256"})
        as_int(listed["size"], f"files[{name!r}].size")
        need(
            isinstance(listed["sha256"], str) and bool(_SHA256.match(listed["sha256"])),
            f"files[{name!r}].sha256 is not a sha256",
        )
    used = dict.fromkeys(files, 0)  # bytes the index places in each file
    tensors = as_dict(index["tensors"], "tensors")
    for name, entry in tensors.items():
        check_tensor_entry(name, entry, files, used)
    for name, nbytes in used.items():
        need(
            nbytes <= files[name]["size"],
            f"files[{name!r}]: the index places {nbytes} bytes in a file of {files[name]['size']}",
        )
    for alias, stored in as_dict(index["aliases"], "aliases").items():
        check_name(alias, "alias")
        need(
            isinstance(stored, str) and stored in tensors and not stored.startswith("optim."),
            f"alias {alias!r} points to {stored!r}, which is not a saved model tensor",
        )
        need(alias not in tensors, f"alias {alias!r} is also a saved tensor")
    if index.get("optimizer") is not None:
        _check_optimizer(index["optimizer"], tensors, index["aliases"])

    validate_extra(as_dict(index.get("extra", {}), "extra"), files, used)


def _check_layout(layout: dict) -> None:
    """Informational (``load`` reads only the world size): the known fields are checked,
    further scalar fields (from a newer zerokit) are allowed."""
    required = {"world_size", "level", "dp_degree", "tp_degree", "zero_group_size"}
    need(required <= layout.keys(), f"layout: missing {sorted(required - layout.keys())}")
    for key, value in layout.items():
        need(
            value is None or (type(value) in (bool, int, str) and len(str(value)) <= 100),
            f"layout.{key} must be a plain value, got {type(value).__name__}",
        )
    for key in ("world_size", "dp_degree", "tp_degree", "zero_group_size"):
        if key != "dp_degree" or layout[key] is not None:  # dp_degree may be None
            as_int(layout[key], f"layout.{key}", 1)
    need(
        layout["level"] is None or bool(_LEVEL.match(str(layout["level"]))),
        f"layout.level {layout['level']!r} is not a level",
    )


def _check_split(name: str, tp, shape: list[int]) -> None:
    if tp is None:
        return
    what = f"{name}: tensor-parallel split"
    check_keys(as_dict(tp, what), what, {"dim", "block_sizes", "stride"})
    need(type(tp["dim"]) is int and 0 <= tp["dim"] < len(shape), f"{what}: bad dim {tp['dim']!r}")
    sizes = as_list(tp["block_sizes"], f"{what}: block_sizes")
    need(0 < len(sizes) <= 1 << 16, f"{what}: {len(sizes)} parts")
    for size in sizes:
        as_int(size, f"{what}: a block size", 1)
    as_int(tp["stride"], f"{what}: stride", 1)
    need(sum(sizes) * tp["stride"] == shape[tp["dim"]], f"{what} does not add up to its shape")


def check_tensor_entry(name: str, entry: dict, files: dict, used: dict | None = None) -> None:
    """A tensor's index entry: safe name, known dtype, sane shape and split, and pieces in
    listed files, keyed ``<name>@<start>``, that tile each tp part exactly once."""
    check_name(name)
    check_keys(as_dict(entry, name), name, {"shape", "dtype", "tp", "parts"})
    shape = as_shape(entry["shape"], name)
    itemsize = dtype_from_name(entry["dtype"], name).itemsize
    _check_split(name, entry["tp"], shape)
    nparts = len(entry["tp"]["block_sizes"]) if entry["tp"] else 1
    parts = as_dict(entry["parts"], f"{name}: parts")
    expected = {str(t) for t in range(nparts)}
    need(set(parts) <= expected, f"{name}: has parts {sorted(parts)}, expected {sorted(expected)}")
    for t in range(nparts):
        pieces = as_list(parts.get(str(t), []), f"{name}: part {t}")
        for piece in pieces:
            what = f"{name}: a piece"
            check_keys(as_dict(piece, what), what, {"file", "key", "start", "numel"})
            as_int(piece["start"], f"{what}'s start")
            as_int(piece["numel"], f"{what}'s numel", 1)
            need(piece["file"] in files, f"{name}: piece in unlisted file {piece['file']!r}")
        end = 0
        for piece in sorted(pieces, key=lambda piece: piece["start"]):
            need(piece["start"] >= end, f"{name}: pieces overlap at element {piece['start']}")
            need(piece["start"] == end, f"{name}: elements {end}..{piece['start']} are in no piece")
            end = piece["start"] + piece["numel"]
        need(
            end == part_numel(entry, t),
            f"{name}: pieces cover {end} of {part_numel(entry, t)} elements (part {t})",
        )
        for piece in pieces:
            need(
                piece["key"] == piece_key(name, piece["start"]),
                f"{name}: the piece at {piece['start']} is keyed {piece['key']!r}, "
                f"expected {piece_key(name, piece['start'])!r}",
            )
            if used is not None:
                used[piece["file"]] += piece["numel"] * itemsize


def check_hyperparameter(what: str, value) -> None:
    """A saved hyperparameter: JSON scalars, lists of finite numbers or of strings."""
    if value is None or isinstance(value, (bool, str)):
        return
    if isinstance(value, list):  # betas; param_names; Adafactor's eps (None: from the dtype)
        need(
            all(v is None or is_finite_number(v) for v in value)
            or all(isinstance(v, str) for v in value),
            f"{what} must hold finite numbers or strings, got {value!r:.200}",
        )
        return
    need(is_finite_number(value), f"{what} must be a finite number, got {value!r}")


def _check_optimizer(optimizer, tensors: dict, aliases: dict) -> None:
    """One optimizer's entry, or a list of them (each parameter in one optimizer only)."""
    entries = as_list(optimizer, "optimizer") if isinstance(optimizer, list) else [optimizer]
    seen: set[str] = set()
    for k, entry in enumerate(entries):
        what = "optimizer" if entries[0] is optimizer else f"optimizer[{k}]"
        params = _check_one_optimizer(as_dict(entry, what), what, tensors, aliases)
        need(not params & seen, f"{what}: {sorted(params & seen)[:3]} in two optimizers")
        seen |= params


def _check_one_optimizer(optimizer: dict, what_opt: str, tensors: dict, aliases: dict) -> set:
    check_keys(
        optimizer,
        what_opt,
        {"class", "param_groups", "scalar_state", "state_tensors"},
        frozenset({"quantized_state"}),
    )
    need(isinstance(optimizer["class"], str), f"{what_opt}.class must be a string")
    model = {n for n in tensors if not n.startswith("optim.")} | set(aliases)
    params: set[str] = set()
    for i, group in enumerate(as_list(optimizer["param_groups"], f"{what_opt}.param_groups")):
        what = f"{what_opt} param group {i}"
        check_keys(as_dict(group, what), what, {"hyperparameters", "params"})
        for key, value in as_dict(group["hyperparameters"], what).items():
            check_hyperparameter(f"{what}: {key}", value)
        for param in as_list(group["params"], f"{what}: params"):
            need(param in model, f"{what}: {param!r} is not a saved model tensor")
            params.add(param)
    for param, scalars in as_dict(optimizer["scalar_state"], f"{what_opt}.scalar_state").items():
        need(param in model, f"{what_opt}.scalar_state: {param!r} is not a saved model tensor")
        for key, scalar in as_dict(scalars, f"optimizer state of {param}").items():
            what = f"optimizer state {key!r} of {param}"
            check_keys(as_dict(scalar, what), what, {"value", "tensor_dtype"})
            need(is_finite_number(scalar["value"]), f"{what} must be a finite number")
            if scalar["tensor_dtype"] is not None:
                dtype_from_name(scalar["tensor_dtype"], what)
    for param, names in as_dict(optimizer["state_tensors"], f"{what_opt}.state_tensors").items():
        need(
            param in tensors and not param.startswith("optim."),
            f"{what_opt}.state_tensors: {param!r} is not a saved model tensor",
        )
        for key, name in as_dict(names, f"optimizer state of {param}").items():
            need(
                name == f"optim.{key}.{param}" and name in tensors,
                f"optimizer state {key!r} of {param} points to {name!r}",
            )
            # per element: shaped and split like its parameter; else held whole, unsplit
            per_element = tensors[name]["shape"] == tensors[param]["shape"]
            need(
                tensors[name]["tp"] == tensors[param]["tp"]
                if per_element
                else tensors[name]["tp"] is None and tensors[param]["tp"] is None,
                f"{name}: its split differs from {param}'s",
            )
    quantized = as_dict(optimizer.get("quantized_state", {}), f"{what_opt}.quantized_state")
    for param, states in quantized.items():
        need(param in params, f"{what_opt}.quantized_state: {param!r} is not in its groups")
        for key, described in as_dict(states, f"quantized state of {param}").items():
            _check_quantized(f"quantized state {key!r} of {param}", key, param, described, tensors)
    return params


def _check_quantized(what: str, key: str, param: str, described: dict, tensors: dict) -> None:
    check_keys(as_dict(described, what), what, {"class", "block_size", "signed", "codes", "scale"})
    need(isinstance(described["class"], str), f"{what}: class must be a string")
    need(described["signed"] in (None, True, False), f"{what}: signed must be a boolean")
    block = as_int(described["block_size"], f"{what}: block_size", 1)
    numel = math.prod(tensors[param]["shape"]) if param in tensors else -1
    for part in ("codes", "scale"):
        name = described[part]
        need(
            name == f"optim.{key}:{part}.{param}" and name in tensors,
            f"{what}: {part} points to {name!r}",
        )
        entry = tensors[name]
        need(len(entry["shape"]) == 1 and entry["tp"] is None, f"{name}: not 1-D and unsplit")
    need(
        tensors[described["scale"]]["shape"][0] * block == numel,
        f"{what}: its scales do not cover {param} in blocks of {block}",
    )
    need(tensors[described["codes"]]["dtype"] == "uint8", f"{what}: codes must be uint8")
