"""Rarely used knobs, in one place."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn


@dataclass(frozen=True, kw_only=True)
class ShardingConfig:
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
    debug_agreement: bool = False
    """Debug mode for level 'p_g_os': before every gather the ranks check (one blocking
    all-reduce and a host sync) that they gather the same unit, so a module that runs on some
    ranks only is named at once. Off by default: it costs a collective per gather. Without it
    a rank that gathers alone is named by the bounded wait (``CollectiveTimeout`` after
    ``$ZEROKIT_COLLECTIVE_TIMEOUT``) and a different unit order by the one check after each
    forward. ``$ZEROKIT_DEBUG_AGREEMENT=1`` turns it on without changing code."""


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


def load_config(path: str | os.PathLike) -> dict:
    """``group_sharded_parallel`` keyword arguments from a small TOML or JSON file:

    ``level`` (a name or a stage number), ``offload``, ``sync_buffers``, ``buffer_max_size``,
    ``segment_size``, ``sync_comm`` and ``mixed_precision`` (``"bf16"``, ``"fp16"`` or none).
    Use it as ``group_sharded_parallel(model, opt, **zerokit.load_config("zerokit.toml"))``.
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
    return out
