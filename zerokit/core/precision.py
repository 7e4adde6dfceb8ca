"""Mixed precision at the module boundaries: the model's floating inputs cast to the compute
dtype (and its outputs to ``output_dtype``), and full-precision units (BatchNorm) fed and
left in their own dtype. Parameters are cast by the buckets (``flat_param.py``); these hooks
only cast activations. They hold dtypes, never the state."""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..mixed_precision import MixedPrecision


def _cast(value, dtype: torch.dtype):
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
        return value.to(dtype)
    return value


def _cast_args(dtype, module, args, kwargs):
    return tree_map(functools.partial(_cast, dtype=dtype), (args, kwargs))


def _cast_output(dtype, module, args, output):
    return tree_map(functools.partial(_cast, dtype=dtype), output)


def register_precision_hooks(
    model: nn.Module, policy: MixedPrecision, full_precision: list[tuple[nn.Module, torch.dtype]]
) -> list:
    """``full_precision``: (module, its parameters' dtype) for each full-precision unit."""
    if policy.param_dtype is None:
        return []
    handles = []
    if policy.cast_forward_inputs:
        hook = functools.partial(_cast_args, policy.param_dtype)
        handles.append(model.register_forward_pre_hook(hook, with_kwargs=True, prepend=True))
    if policy.output_dtype is not None:
        handles.append(
            model.register_forward_hook(functools.partial(_cast_output, policy.output_dtype))
        )
    for module, dtype in full_precision:
        handles.append(
            module.register_forward_pre_hook(functools.partial(_cast_args, dtype), with_kwargs=True)
        )
        handles.append(
            module.register_forward_hook(functools.partial(_cast_output, policy.param_dtype))
        )
    return handles
