"""Misuse refused at the call: what ``group_sharded_parallel`` checks before building, the
agreement of every rank on what it builds, and what a wrapped model checks before each forward
and step. Each message says what to do instead.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.utils.weak import WeakIdKeyDictionary

from . import agreement

# Parameters already inside a wrapped model (weak, by identity: a parameter freed with its
# model leaves; tensors compare elementwise, so a plain WeakSet cannot hold them).
_WRAPPED_PARAMS = WeakIdKeyDictionary()


def check_not_wrapped(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    if hasattr(optimizer, "_zerokit"):
        raise ValueError("this optimizer is already wrapped by group_sharded_parallel")
    for name, module in model.named_modules():
        if hasattr(module, "_zerokit"):
            where = f"its submodule {name!r}" if name else "this model"
            raise ValueError(
                f"{where} is already wrapped by group_sharded_parallel; wrap a model once, "
                "as a whole (use ShardingConfig(wrap=...) to choose its units)"
            )
    inside = [n for n, p in model.named_parameters() if p in _WRAPPED_PARAMS]
    if inside:
        raise ValueError(
            f"parameters {inside[:3]} already belong to a model wrapped by "
            "group_sharded_parallel (is this a submodule of a wrapped model?); wrap a model "
            "once, as a whole"
        )


def remember_wrapped(params) -> None:
    for param in params:
        _WRAPPED_PARAMS[param] = True


def forget_wrapped(params) -> None:
    """``zerokit.unwrap``: these parameters may be wrapped again."""
    for param in params:
        _WRAPPED_PARAMS.pop(param, None)


def check_dense_gradients(model: nn.Module) -> None:
    sparse = [name for name, m in model.named_modules() if getattr(m, "sparse", False) is True]
    if sparse:
        raise ValueError(
            f"modules {sparse[:3]} make sparse gradients (sparse=True), which zerokit cannot "
            "reduce or shard; build them with sparse=False"
        )


def agree_arguments(what: dict[str, object], groups: list[ProcessGroup]) -> None:
    """Every rank of ``groups`` must have the same ``what``; else raise ``AgreementError`` on
    every rank, naming the fields and the ranks that differ (and ``CollectiveTimeout`` naming
    the ranks that never call, after the collective timeout)."""
    fields = {k: repr(v).encode() for k, v in what.items()}
    for group in groups:
        agreement.agree_all("group_sharded_parallel", fields, group)


def is_distributed(param: torch.Tensor) -> bool:
    """Marked rank-local (``param.is_distributed = True``, Paddle's marker): each rank holds
    its own values (a model-parallel slice), which ZeRO neither broadcasts, nor averages, nor
    shards; the rank's optimizer steps them with their own gradient. ``torch.Tensor`` has a
    method of that name, so the test is ``is True``, never truthiness."""
    return getattr(param, "is_distributed", None) is True


def layout_summary(model: nn.Module) -> list[tuple[str, tuple[int, ...] | str, str, bool, str]]:
    """(name, shape, dtype, requires_grad, device type) of every parameter, for ``agree``. A
    rank-local (``is_distributed``) parameter's shape is its rank's slice, which may differ
    between ranks: it is compared as "is_distributed" instead."""
    return [
        (
            n,
            "is_distributed" if is_distributed(p) else tuple(p.shape),
            str(p.dtype),
            p.requires_grad,
            p.device.type,
        )
        for n, p in model.named_parameters()
    ]


def check_params_intact(buckets, frozen: list[tuple[str, nn.Parameter]]) -> None:
    """Before a forward or step: the model was not cast, moved or refrozen after wrapping."""
    for bucket in buckets:
        data = bucket.data
        for i, param in enumerate(bucket.params):
            name = bucket.layout.slots[i].name
            if param.dtype != data.dtype or param.device != data.device:
                raise RuntimeError(
                    f"parameter {name!r} is now {param.dtype} on {param.device}, but zerokit "
                    f"holds it as {data.dtype} on {data.device}: the model was cast or moved "
                    "after group_sharded_parallel (.to(), .half(), .double()). Cast or move it "
                    "before wrapping; for low precision use mixed_precision=MixedPrecision(...)."
                )
            if (
                param.numel()
                and param.untyped_storage().data_ptr() != data.untyped_storage().data_ptr()
            ):
                raise RuntimeError(
                    f"parameter {name!r} no longer lives in zerokit's flat buffer (its .data "
                    "was replaced after group_sharded_parallel); change parameters before "
                    "wrapping, or load values with model.load_state_dict / zerokit.checkpoint"
                )
            if not param.requires_grad:
                raise RuntimeError(
                    f"parameter {name!r} was frozen after group_sharded_parallel; freeze "
                    "parameters before wrapping (zerokit would keep reducing and stepping it)"
                )
    for name, param in frozen:
        if param.requires_grad:
            raise RuntimeError(
                f"parameter {name!r} was frozen when group_sharded_parallel ran and now "
                "requires grad: it is in no bucket and would never be trained. Unfreeze "
                "parameters before wrapping (a frozen-at-wrap parameter cannot be unfrozen)"
            )
