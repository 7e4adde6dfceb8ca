"""What zerokit's Lightning strategies share: the Trainer's (``lightning.py``) and Fabric's
(``fabric.py``). Imports nothing of ``lightning.pytorch``; each strategy subclasses its own
Lightning base and calls these."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from torch import nn

from ..checkpoint.reading import CheckpointReader
from ..config import DEFAULT_LEVEL, ShardingConfig, knob_names, merge_arguments, parse_level
from ..core import broadcast_module_state
from ..mixed_precision import LIGHTNING_PRECISIONS, MixedPrecision, as_policy
from ..moe import expert_groups_of
from ..scaler import ShardedGradScaler

# group_sharded_parallel's knobs a strategy passes on: every ShardingConfig field but the two
# it takes as arguments of its own (a new field is taken at once)
SHARDING_OPTIONS = set(knob_names()) - {"level", "mixed_precision"}
# registered name -> level, in Lightning's Trainer and Fabric registries alike
NAMES = {
    "zerokit": DEFAULT_LEVEL,
    "zerokit_os": "os",
    "zerokit_os_g": "os_g",
    "zerokit_p_g_os": "p_g_os",
}


def check_options(
    who: str, level: str | int | None, mixed_precision: Any, sharding: dict[str, Any]
) -> str | None:
    """The strategy's constructor arguments checked; returns the level's name (None: not
    given, so ``config``'s level or the default decides, as ``group_sharded_parallel`` does)."""
    unknown = sorted(set(sharding) - SHARDING_OPTIONS)
    if unknown:
        raise TypeError(
            f"{who} got unknown option(s) {unknown}; it takes level, mixed_precision, config "
            f"and the ShardingConfig fields {sorted(SHARDING_OPTIONS)}"
        )
    as_policy(mixed_precision)  # a policy, a name as group_sharded_parallel takes, or None
    return None if level is None else parse_level(level)


def sharding_config(config: ShardingConfig | None, sharding: dict[str, Any]) -> ShardingConfig:
    """``config`` with the strategy's keyword arguments (``ShardingConfig`` fields) filled in,
    checked now, at the strategy's construction, not when the model is wrapped."""
    return merge_arguments(config, **sharding)


def check_precision(who: str, precision: str, scaler: Any) -> ShardedGradScaler | None:
    """A Lightning precision name zerokit honours; returns the loss scaler it needs."""
    if precision not in LIGHTNING_PRECISIONS:
        raise ValueError(
            f"{who} supports precision '32-true', '16-mixed' or 'bf16-mixed', not "
            f"{precision!r}: zerokit keeps fp32 master shards and computes in the low dtype"
        )
    if scaler is not None and precision != "16-mixed":
        raise ValueError(f"precision={precision!r} uses no loss scaler, got {scaler!r}")
    if precision != "16-mixed":
        return None
    if scaler is None:
        return ShardedGradScaler()
    return scaler if isinstance(scaler, ShardedGradScaler) else ShardedGradScaler.like(scaler)


def precision_policy(precision: str, mixed_precision: MixedPrecision | None, who: str):
    """The ``MixedPrecision`` a precision name means (no autocast: zerokit casts at module
    boundaries, keeps fp32 master shards, returns the loss in fp32), or the strategy's own."""
    ours = LIGHTNING_PRECISIONS[precision]
    mixed_precision = as_policy(mixed_precision)  # a name ("bf16") as its policy
    if ours is None:
        return mixed_precision
    if mixed_precision is not None:
        raise ValueError(
            f"{who}(mixed_precision=...) and precision={precision!r} both choose a precision; "
            "pass only one"
        )
    return replace(as_policy(ours), output_dtype=torch.float32)


def refuse_precision(who: str, plugin: Any) -> ValueError:
    precision = getattr(plugin, "precision", "?")
    return ValueError(
        f"{who} cannot honour precision={precision!r} ({type(plugin).__name__}): use "
        "precision '32-true', '16-mixed' or 'bf16-mixed' (zerokit keeps fp32 master shards "
        "and computes in the low dtype)"
    )


def refuse_checkpoint_io(who: str, trainer: str, io: Any) -> None:
    """A ``CheckpointIO`` plugin would be passed over in silence: refuse it."""
    if io is not None and type(io) is not TorchCheckpointIO:  # the default, unused
        raise ValueError(
            f"{who} cannot honour {trainer}(plugins=[{type(io).__name__}(...)]): zerokit writes "
            "its own sharded checkpoint directories, not through a CheckpointIO plugin; remove "
            "the plugin"
        )


def start_alike(module: nn.Module) -> None:
    """A model set up without an optimizer (evaluation): nothing to shard; every rank starts
    from rank 0's weights, and experts split across ranks (``zerokit.moe``) from their
    expert-data-parallel group's rank 0, since rank 0 holds other experts."""
    own_groups = expert_groups_of(module)
    broadcast_module_state(module, dist.group.WORLD, params=True, own_groups=own_groups)


def saved_extra_keys(path: str, prefix: str = "") -> list[str]:
    """The names of a checkpoint's extra entries that start with ``prefix``."""
    with CheckpointReader(path) as reader:
        return [k for k in reader.index.get("extra", {}) if k.startswith(prefix)]


def register(strategy_registry, cls) -> None:
    for name, level in NAMES.items():
        if name not in strategy_registry:
            strategy_registry.register(
                name, cls, description=f"zerokit ZeRO level {level!r}", level=level
            )
