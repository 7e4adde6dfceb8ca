"""A run's parallel strategy, declared once: degrees, ZeRO level, pipeline schedule, plan.

Written as a file a user keeps next to the script (TOML, JSON or YAML) and read with
``Strategy.load(path)``; ``zerokit launch --strategy FILE train.py`` hands the file to every
rank through ``$ZEROKIT_STRATEGY``, which ``Strategy.from_env()`` (and ``zerokit.parallelize``
when given no mesh and no strategy) reads.

>>> Strategy(dp=2, tp=2).world_size
4
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields

from .mixed_precision import PRECISIONS

ENV = "ZEROKIT_STRATEGY"


@dataclass(frozen=True, kw_only=True)
class Strategy:
    """Everything ``zerokit.parallelize`` needs besides the model and the optimizer."""

    dp: int = 1
    """Data-parallel degree: model copies fed different batches; ZeRO shards across them."""
    tp: int = 1
    """Tensor-parallel degree: ranks splitting each planned layer (neighbouring ranks)."""
    pp: int = 1
    """Pipeline degree: stages, split at ``split_points`` (given to ``parallelize``)."""
    level: str = "p_g_os"
    """ZeRO level over dp: 'os' (stage 1), 'os_g' (stage 2) or 'p_g_os' (stage 3)."""
    micro_batches: int = 1
    """Micro-batches per step of the pipeline schedule (pp > 1)."""
    schedule: str = "1f1b"
    """Pipeline schedule name, as ``zerokit.pipeline`` spells it (pp > 1)."""
    plan: str | dict | None = None
    """Tensor-parallel plan: a built-in name ("llama", "gpt2") or ``{module pattern: style}``;
    None with tp > 1 is refused by ``parallelize`` unless a plan is passed to it."""
    mixed_precision: str | None = None
    """None (the parameters' dtype), "bf16" or "fp16": the compute dtype, fp32 masters."""
    recompute: bool = False
    """Recompute activations in backward (Hugging Face models' gradient checkpointing)."""

    def __post_init__(self):
        for name in ("dp", "tp", "pp", "micro_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Strategy.{name} must be an integer >= 1, got {value!r}")
        from .api import LEVELS

        if self.level not in LEVELS:
            raise ValueError(f"Strategy.level must be one of {LEVELS}, got {self.level!r}")
        if self.mixed_precision is not None and self.mixed_precision not in PRECISIONS:
            raise ValueError(
                f"Strategy.mixed_precision must be None or one of {tuple(PRECISIONS)}, got "
                f"{self.mixed_precision!r}"
            )
        if not (self.plan is None or isinstance(self.plan, (str, dict))):
            raise ValueError(f"Strategy.plan must be a name or a dict, got {self.plan!r}")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def check_world(self, world_size: int) -> None:
        """Refuse degrees whose product is not ``world_size`` (no communication)."""
        if self.world_size != world_size:
            raise ValueError(
                f"the strategy's dp * tp * pp = {self.dp} * {self.tp} * {self.pp} = "
                f"{self.world_size}, but the world size is {world_size}; launch "
                f"{self.world_size} ranks or change the degrees"
            )

    @classmethod
    def load(cls, path: str) -> Strategy:
        """Read a strategy from a ``.toml``, ``.json`` or ``.yaml``/``.yml`` file (its keys are
        the fields; unknown keys are refused)."""
        ext = os.path.splitext(path)[1].lower()
        if ext == ".toml":
            import tomllib

            with open(path, "rb") as f:
                data = tomllib.load(f)
        elif ext == ".json":
            with open(path) as f:
                data = json.load(f)
        elif ext in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError:
                raise ImportError(
                    f"{path}: reading YAML needs PyYAML (pip install pyyaml); or write the "
                    "strategy as TOML or JSON"
                ) from None
            with open(path) as f:
                data = yaml.safe_load(f)
        else:
            raise ValueError(f"{path}: a strategy file ends in .toml, .json, .yaml or .yml")
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a strategy file holds a table of fields, got {data!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"{path}: unknown strategy keys {unknown}; the fields are {sorted(known)}"
            )
        return cls(**data)

    @classmethod
    def from_env(cls) -> Strategy | None:
        """The strategy file named by ``$ZEROKIT_STRATEGY`` (set by ``zerokit launch
        --strategy``), or None when it is unset."""
        path = os.environ.get(ENV)
        return cls.load(path) if path else None
