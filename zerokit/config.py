"""Rarely used knobs, in one place."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True, kw_only=True)
class ShardingConfig:
    """Every knob of ``group_sharded_parallel`` beyond the model, the optimizer, the scaler and
    the groups, in one place. ``group_sharded_parallel``'s keyword arguments of the same names
    (Paddle's signature) fill one of these; ``load_config`` reads one from a file."""

    level: str | None = None
    """``'os'``, ``'os_g'``, ``'p_g_os'`` (or 1, 2, 3); None: the ``level`` argument, else
    ``$ZEROKIT_LEVEL``."""
    mixed_precision: Any = None
    """A ``zerokit.MixedPrecision`` policy; None: fp32."""
    offload: bool = False
    """Keep the fp32 master shards and optimizer state in CPU memory and step there (a no-op
    when the model is already on the CPU)."""
    sync_buffers: bool = False
    """Broadcast rank 0's buffers to every rank before each forward."""
    buffer_max_size: int = 2**23
    """Most elements per flat bucket (one collective per bucket)."""
    segment_size: int = 2**20
    """A module whose own parameters reach this many elements becomes a unit of its own."""
    sync_comm: bool = False
    """Finish each collective at once instead of overlapping it with compute (the least
    memory in backward, paid for in time)."""
    exclude_layer: tuple = ()
    """Level 'p_g_os': modules (or module classes) kept whole on every rank."""
    step_in_backward: bool = False
    """Levels 'os_g', 'p_g_os': step each unit as soon as its gradients are reduced, inside
    backward (no global-norm clipping or loss scaler then)."""
    wrap: tuple[type[nn.Module], ...] = ()
    """Module classes whose instances become units: a unit's gradients are reduced together
    as soon as its backward is done, and at level 'p_g_os' its parameters are gathered and
    freed together. Empty: the default policy — children of ``nn.ModuleList``/
    ``nn.Sequential``. Either way, modules whose own parameters reach ``segment_size``
    elements are units too."""
    elementwise_optimizer: bool = False
    """Declare that an optimizer zerokit does not know (not SGD, Adam, AdamW, Adagrad,
    Adadelta, Adamax, ASGD, NAdam, RAdam, RMSprop or Rprop) updates each element from that
    element's gradient and state alone, so stepping shards is exact. Unknown optimizers are
    refused otherwise."""
    whole_parameter_optimizer: bool = False
    """Declare that an optimizer zerokit does not know reads whole parameters in its update
    (as Muon and Adafactor, which zerokit knows, do): each parameter it steps is then owned
    whole by one rank, which steps it on the averaged gradient (the owner layout). A class can
    say so itself with the attribute ``zerokit_whole_parameter = True``."""
    debug_agreement: bool = False
    """Debug mode for level 'p_g_os': before every gather the ranks check (one blocking
    all-reduce and a host sync) that they gather the same unit, so a module that runs on some
    ranks only is named at once. Off by default: it costs a collective per gather. Without it
    a rank that gathers alone is named by the bounded wait (``CollectiveTimeout`` after
    ``$ZEROKIT_COLLECTIVE_TIMEOUT``) and a different unit order by the one check after each
    forward. ``$ZEROKIT_DEBUG_AGREEMENT=1`` turns it on without changing code."""


#: the knobs ``group_sharded_parallel`` also takes as arguments (Paddle's signature)
ARGUMENT_KNOBS = (
    "level", "mixed_precision", "offload", "sync_buffers", "buffer_max_size", "segment_size",
    "sync_comm", "exclude_layer", "step_in_backward",
)  # fmt: skip


def merge_arguments(config: ShardingConfig | None, **arguments) -> ShardingConfig:
    """``config`` with the knobs given as ``group_sharded_parallel`` arguments filled in. A
    knob given both ways, with different values, is refused: nothing is silently overridden."""
    config = config or ShardingConfig()
    defaults = ShardingConfig()
    changes = {}
    for name, value in arguments.items():
        if name == "exclude_layer":
            value = tuple(value or ())
        if value == getattr(defaults, name):
            continue
        held = getattr(config, name)
        if held != getattr(defaults, name) and held != value:
            raise ValueError(
                f"{name} is given twice, as an argument ({value!r}) and in config "
                f"({held!r}): give it once"
            )
        changes[name] = value
    return replace(config, **changes)


#: stage numbers (DeepSpeed's names) and Paddle's level names, to the level
LEVEL_ALIASES = {1: "os", 2: "os_g", 3: "p_g_os", "1": "os", "2": "os_g", "3": "p_g_os"}
LEVEL_ENV = "ZEROKIT_LEVEL"
DEBUG_AGREEMENT_ENV = "ZEROKIT_DEBUG_AGREEMENT"
CONFIG_KEYS = (
    "level",
    "offload",
    "sync_buffers",
    "buffer_max_size",
    "segment_size",
    "sync_comm",
    "step_in_backward",
    "debug_agreement",
    "mixed_precision",
)


def debug_agreement(config: ShardingConfig) -> bool:
    """``config.debug_agreement``, or ``$ZEROKIT_DEBUG_AGREEMENT`` set to 1."""
    return config.debug_agreement or os.environ.get(DEBUG_AGREEMENT_ENV, "").strip() == "1"


def resolve_level(level) -> str:
    """``'os'``/``'os_g'``/``'p_g_os'``, a stage number 1/2/3 (or ``'1'``...), or None to read
    ``$ZEROKIT_LEVEL``.

    >>> resolve_level(3), resolve_level("os_g")
    ('p_g_os', 'os_g')
    """
    if level is None:
        level = os.environ.get(LEVEL_ENV)
        if level is None:
            raise ValueError(
                f"no level given and ${LEVEL_ENV} is not set: pass level='os' | 'os_g' | "
                "'p_g_os' (or a stage number 1 | 2 | 3), or set it in the environment"
            )
        level = level.strip()
    return LEVEL_ALIASES.get(level, level)


def load_config(path: str | os.PathLike) -> ShardingConfig:
    """A ``ShardingConfig`` from a small TOML or JSON file: ``level`` (a name or a stage
    number), ``offload``, ``sync_buffers``, ``buffer_max_size``, ``segment_size``,
    ``sync_comm``, ``step_in_backward``, ``debug_agreement`` and ``mixed_precision``
    (``"bf16"``, ``"fp16"`` or none). Use it as
    ``group_sharded_parallel(model, opt, config=zerokit.load_config("zerokit.toml"))``.
    """
    import json

    from .mixed_precision import MixedPrecision

    text = Path(path).read_text()
    if str(path).endswith(".toml"):
        try:
            import tomllib
        except ImportError:  # Python 3.10
            raise ValueError(f"{path}: TOML needs Python 3.11 or newer; use JSON") from None
        raw = tomllib.loads(text)
    else:
        raw = json.loads(text)
    unknown = sorted(set(raw) - set(CONFIG_KEYS))
    if unknown:
        raise ValueError(f"{path}: unknown keys {unknown}; valid keys: {', '.join(CONFIG_KEYS)}")
    out = dict(raw)
    if "level" in out:
        out["level"] = resolve_level(out["level"])
    precision = out.pop("mixed_precision", None)
    if precision is not None:
        dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
        if precision not in dtypes:
            raise ValueError(f"{path}: mixed_precision must be 'bf16' or 'fp16', got {precision!r}")
        out["mixed_precision"] = MixedPrecision(param_dtype=dtypes[precision])
    return ShardingConfig(**out)
