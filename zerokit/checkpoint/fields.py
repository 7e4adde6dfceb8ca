"""The checkpoint index's field checks and dtype names: what ``index`` (the index's own format)
and ``extra`` (the extra state's) both validate with, below both so neither imports the other."""

from __future__ import annotations

import torch

from .streaming import SAFETENSORS_DTYPES

DTYPES = {str(d).removeprefix("torch."): d for d in SAFETENSORS_DTYPES}


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as it is; the message names the file or tensor."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str, what: str) -> torch.dtype:
    if not isinstance(name, str) or name not in DTYPES:
        raise CheckpointError(f"{what}: unknown dtype {name!r}")
    return DTYPES[name]


def scalar_value(scalar: dict, what: str):
    """Saved scalar optimizer state (``{"value", "tensor_dtype"}``) as the optimizer held it:
    a number, or a 0-dim tensor of its dtype (Adam's ``step``)."""
    if scalar["tensor_dtype"] is None:
        return scalar["value"]
    return torch.tensor(scalar["value"], dtype=dtype_from_name(scalar["tensor_dtype"], what))


def listing(names: list[str], most: int = 10, show=str) -> str:
    """The first ``most`` names for an error message (each as ``show`` gives it), then how
    many more."""
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(map(show, names[:most])) + more


def need(ok: bool, message: str) -> None:
    if not ok:
        raise CheckpointError(message)


def as_int(value, what: str, low: int = 0) -> int:
    need(type(value) is int and value >= low, f"{what} must be an integer >= {low}, got {value!r}")
    return value


def as_dict(value, what: str) -> dict:
    need(isinstance(value, dict), f"{what} must be an object, got {type(value).__name__}")
    return value


def as_list(value, what: str) -> list:
    need(isinstance(value, list), f"{what} must be a list, got {type(value).__name__}")
    return value


def as_shape(value, what: str) -> list[int]:
    shape = as_list(value, f"{what}: shape")
    need(len(shape) <= 64, f"{what}: {len(shape)} dimensions")
    for size in shape:
        as_int(size, f"{what}: a dimension")
    return shape


def check_keys(
    value: dict, what: str, required: set[str], optional: frozenset = frozenset()
) -> None:
    missing, extra = required - value.keys(), value.keys() - required - optional
    need(not missing and not extra, f"{what}: missing {sorted(missing)}, unknown {sorted(extra)}")
