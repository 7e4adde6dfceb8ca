"""Mixed precision at the module boundaries: the model's floating inputs cast to the compute
dtype (and its outputs to ``output_dtype``), and full-precision units (BatchNorm) fed and
left in their own dtype. Parameters are cast by the buckets (``flat_param.py``); these hooks
only cast activations. They hold dtypes, never the state; ``hooks.py`` registers them."""

from __future__ import annotations

import functools

import torch
from torch.utils._pytree import tree_map


def _cast(value, dtype: torch.dtype):
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
        return value.to(dtype)
    return value


def cast_args(dtype, module, args, kwargs):
    return tree_map(functools.partial(_cast, dtype=dtype), (args, kwargs))


def cast_output(dtype, module, args, output):
    return tree_map(functools.partial(_cast, dtype=dtype), output)
