"""A run's parallel strategy, declared once: degrees, ZeRO level, pipeline schedule, plan.

Written as a file a user keeps next to the script (TOML, JSON or YAML) and read with
``Strategy.load(path)``; ``zerokit launch --strategy FILE train.py`` hands the file to every
rank through ``$ZEROKIT_STRATEGY``, which ``Strategy.from_env()`` (and ``zerokit.parallelize``
when given no mesh and no strategy) reads.

>>> Strategy(dp=2, tp=2).world_size
4
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

from .config import DEFAULT_LEVEL, ShardingConfig, knobs_of, parse_level, read_table
from .layout import check_ep

ENV = "ZEROKIT_STRATEGY"


@dataclass(frozen=True, kw_only=True)
class Strategy(ShardingConfig):
    """Everything ``zerokit.parallelize`` needs besides the model and the optimizer: the
    degrees and the pipeline below, and every ZeRO knob of ``ShardingConfig`` (its fields,
    inherited: defined there once), with the level defaulting to ``DEFAULT_LEVEL``."""

    dp: int = 1
    """Data-parallel degree: model copies fed different batches; ZeRO shards across them."""
    tp: int = 1
    """Tensor-parallel degree: ranks splitting each planned layer (neighbouring ranks)."""
    pp: int = 1
    """Pipeline degree: stages, split at ``split_points`` (given to ``parallelize``)."""
    ep: int = 1
    """Expert-parallel degree, within dp: neighbouring dp ranks splitting each MoE layer's
    experts (tokens exchanged by all-to-all); the experts are sharded over dp / ep ranks, the
    dense parameters over dp. Divides dp and the number of experts; 1: experts are sharded
    like any dense parameter. The mesh built is ``init_mesh(dp=, ep=)``'s. ``zerokit.moe``."""
    aux_loss: str = "global"
    """With ep > 1 and ``output_router_logits=True``: the router's load-balancing loss from
    the routing statistics of every dp rank ("global": one process's on the whole batch) or
    from this rank's tokens alone ("per_rank": the model's own, as DDP runs it)."""
    level: str | int = DEFAULT_LEVEL
    """ZeRO level over dp: 'os' (stage 1), 'os_g' (stage 2) or 'p_g_os' (stage 3), or the
    stage number 1, 2, 3 (held as the name)."""
    micro_batches: int = 1
    """Micro-batches per step of the pipeline schedule (pp > 1)."""
    schedule: str = "1f1b"
    """Pipeline schedule name, as ``zerokit.pipeline`` spells it (pp > 1)."""
    plan: str | dict | None = None
    """Tensor-parallel plan: a built-in name ("llama", "gpt2") or ``{module pattern: style}``;
    None with tp > 1 is refused by ``parallelize`` unless a plan is passed to it."""
    recompute: bool = False
    """Recompute activations in backward (Hugging Face models' gradient checkpointing)."""

    def __post_init__(self):
        for name in ("dp", "tp", "pp", "ep", "micro_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Strategy.{name} must be an integer >= 1, got {value!r}")
        try:
            parse_level(self.level)
        except ValueError:
            raise ValueError(
                f"Strategy.level must be one of 'os', 'os_g', 'p_g_os' or a stage number 1, 2, "
                f"3; got {self.level!r}"
            ) from None
        check_ep(self.ep, self.dp, tp=self.tp, pp=self.pp)  # init_mesh's own check
        if self.aux_loss not in ("global", "per_rank"):
            raise ValueError(
                f"Strategy.aux_loss must be 'global' or 'per_rank', got {self.aux_loss!r}"
            )
        super().__post_init__()  # the ZeRO knobs, checked as ShardingConfig checks them
        if not (self.plan is None or isinstance(self.plan, (str, dict))):
            raise ValueError(f"Strategy.plan must be a name or a dict, got {self.plan!r}")

    def sharding(self) -> ShardingConfig:
        """The ZeRO knobs of this strategy, as the ``ShardingConfig`` they are."""
        return ShardingConfig(**knobs_of(self))

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
        data = read_table(path, "strategy", otherwise_json=False)
        known = {f.name for f in fields(cls) if f.metadata.get("in_files", True)}
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
