"""The rest of a run's state (step, LR scheduler, RNG states, data position), without pickle.

``save(..., extra={"scheduler": sched, "step": 12, "rng": RNGState()})``: an object with
``state_dict()`` and ``load_state_dict()`` (DCP's ``Stateful``) is stored as its state dict;
anything else as it is. Values may be None, bool, int, float (NaN and infinities included),
str, lists, tuples, dicts, torch tensors and NumPy arrays, nested: containers and scalars go
to the index as tagged JSON (``{"list": [...]}``, ``{"tensor": 0}``, ...), tensors to
safetensors files. Anything else (a function, an arbitrary object) is refused at save.

Note: each key is stored once when every rank passed the same value (a scheduler), and once
per rank when they differ (RNG states, a data position): the index says which. A per-rank
value can only be restored at the world size that saved it; ``load`` says so instead of
handing one rank's value to another.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from typing import Any

import numpy as np
import torch

from . import fields
from .fields import CheckpointError, dtype_from_name, dtype_name
from .streaming import SAFETENSORS_DTYPES

MAX_DEPTH = 64


def is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


class RNGState:
    """This process's random number generators as a ``Stateful`` for ``extra``: torch's CPU
    generator, each CUDA device's (when CUDA is initialised), Python's ``random`` and NumPy's
    global generator."""

    def state_dict(self) -> dict:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
        return {
            "torch": torch.get_rng_state(),
            "cuda": cuda,
            "python": random.getstate(),
            "numpy": np.random.get_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state["torch"])
        if state["cuda"]:
            torch.cuda.set_rng_state_all(state["cuda"])
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])


def encode(value: Any, where: str) -> tuple[Any, list[torch.Tensor]]:
    """``value`` (or its ``state_dict()``) as tagged JSON and the tensors it refers to."""
    tensors: list[torch.Tensor] = []
    if is_stateful(value):
        value = value.state_dict()
    return _to_json(value, tensors, where, 0), tensors


def _to_json(value: Any, tensors: list, where: str, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise CheckpointError(f"{where}: nested more than {MAX_DEPTH} deep")
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else {"float": repr(float(value))}
    if isinstance(value, torch.Tensor):
        if value.dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{where}: a {value.dtype} tensor cannot be stored")
        tensors.append(value.detach().to("cpu").contiguous())
        return {"tensor": len(tensors) - 1}
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise CheckpointError(f"{where}: a NumPy array of Python objects cannot be stored")
        raw = torch.from_numpy(np.ascontiguousarray(value).reshape(-1).view(np.uint8).copy())
        tensors.append(raw)
        return {"ndarray": len(tensors) - 1, "dtype": value.dtype.str, "shape": list(value.shape)}
    if isinstance(value, (list, tuple)):
        items = [_to_json(v, tensors, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
        return {"tuple" if isinstance(value, tuple) else "list": items}
    if isinstance(value, dict):
        return {
            "dict": [
                [_to_json(k, tensors, f"{where} key", depth + 1),
                 _to_json(v, tensors, f"{where}[{k!r}]", depth + 1)]
                for k, v in value.items()
            ]
        }  # fmt: skip
    raise CheckpointError(
        f"{where}: a {type(value).__name__} cannot be stored without pickle; pass an object with "
        "state_dict()/load_state_dict(), or numbers, strings, lists, dicts and tensors"
    )


def decode(doc: Any, tensors: list[torch.Tensor], where: str, depth: int = 0) -> Any:
    """The value ``encode`` stored; raises ``CheckpointError`` on anything it cannot have
    written."""
    fields.need(depth <= MAX_DEPTH, f"{where}: nested more than {MAX_DEPTH} deep")
    if doc is None or isinstance(doc, (bool, str, int, float)):
        fields.need(not isinstance(doc, float) or math.isfinite(doc), f"{where}: bad number")
        return doc
    fields.need(
        isinstance(doc, dict) and len(doc) >= 1, f"{where}: not a stored value: {doc!r:.80}"
    )
    tag = next(iter(doc))
    if tag == "float" and len(doc) == 1:
        fields.need(doc["float"] in ("nan", "inf", "-inf"), f"{where}: bad number {doc['float']!r}")
        return float(doc["float"])
    if tag == "tensor" and len(doc) == 1:
        fields.need(
            type(doc["tensor"]) is int and 0 <= doc["tensor"] < len(tensors), f"{where}: bad tensor"
        )
        return tensors[doc["tensor"]]
    if tag == "ndarray" and set(doc) == {"ndarray", "dtype", "shape"}:
        fields.need(
            type(doc["ndarray"]) is int and 0 <= doc["ndarray"] < len(tensors),
            f"{where}: bad array",
        )
        try:
            dtype = np.dtype(doc["dtype"])
        except (TypeError, ValueError):
            raise CheckpointError(f"{where}: bad NumPy dtype {doc['dtype']!r}") from None
        fields.need(not dtype.hasobject, f"{where}: a NumPy array of Python objects")
        shape = fields.as_list(doc["shape"], f"{where}: shape")
        raw = tensors[doc["ndarray"]].numpy().tobytes()
        fields.need(
            all(type(n) is int and n >= 0 for n in shape)
            and math.prod(shape) * dtype.itemsize == len(raw),
            f"{where}: the array's shape does not match its bytes",
        )
        return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    if tag in ("list", "tuple") and len(doc) == 1:
        items = [
            decode(v, tensors, f"{where}[{i}]", depth + 1)
            for i, v in enumerate(fields.as_list(doc[tag], where))
        ]
        return tuple(items) if tag == "tuple" else items
    if tag == "dict" and len(doc) == 1:
        out = {}
        for pair in fields.as_list(doc["dict"], where):
            fields.need(isinstance(pair, list) and len(pair) == 2, f"{where}: bad dict item")
            key = decode(pair[0], tensors, f"{where} key", depth + 1)
            fields.need(
                key is None or isinstance(key, (bool, int, float, str, tuple)),
                f"{where}: unhashable key",
            )
            out[key] = decode(pair[1], tensors, f"{where}[{key!r}]", depth + 1)
        return out
    raise CheckpointError(f"{where}: not a stored value: {doc!r:.80}")


def digest(doc: Any, tensors: list[torch.Tensor]) -> str:
    """Equal for equal values: decides whether a key is stored once or once per rank."""
    h = hashlib.sha256(json.dumps(doc, sort_keys=True).encode())
    for t in tensors:
        h.update(f"{t.dtype}{list(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def read_saved(value: dict, read_tensor, key: str) -> Any:
    """A stored value of the extra key ``key`` (``{"json", "tensors"}``), its tensors read by
    ``read_tensor(file, key)``."""
    tensors = [read_tensor(ref["file"], ref["key"]) for ref in value["tensors"]]
    return decode(value["json"], tensors, f"extra {key!r}")


def tensor_key(position: int, rank: int, n: int) -> str:
    """The safetensors key of the n-th tensor of the position-th extra key (sorted), as saved
    by ``rank``."""
    return f"extra.{position}.{rank}.{n}"


def tensor_ref(file: str, key: str, tensor: torch.Tensor) -> dict:
    return {
        "file": file,
        "key": key,
        "dtype": dtype_name(tensor.dtype),
        "shape": list(tensor.shape),
    }


def validate_extra(extra: dict, files: dict, used: dict) -> None:
    """The index's ``extra``: each key's values and where their tensors are."""
    for key, entry in extra.items():
        what = f"extra {key!r}"
        fields.need(isinstance(key, str) and len(key) <= 1000, f"{what}: a bad key")
        fields.check_keys(fields.as_dict(entry, what), what, {"per_rank", "values"})
        fields.need(isinstance(entry["per_rank"], bool), f"{what}: per_rank must be true or false")
        values = fields.as_list(entry["values"], f"{what}: values")
        fields.need(len(values) >= 1 and (entry["per_rank"] or len(values) == 1), f"{what}: values")
        for saved in values:
            fields.check_keys(fields.as_dict(saved, what), what, {"json", "tensors"})
            for ref in fields.as_list(saved["tensors"], f"{what}: tensors"):
                fields.check_keys(
                    fields.as_dict(ref, what),
                    f"{what}: a tensor",
                    {"file", "key", "dtype", "shape"},
                )
                fields.need(
                    ref["file"] in files, f"{what}: a tensor in unlisted file {ref['file']!r}"
                )
                fields.need(
                    isinstance(ref["key"], str) and ref["key"].startswith("extra."),
                    f"{what}: bad key",
                )
                itemsize = dtype_from_name(ref["dtype"], what).itemsize
                used[ref["file"]] += math.prod(fields.as_shape(ref["shape"], what)) * itemsize
