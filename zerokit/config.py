"""Rarely used knobs, in one place."""

from __future__ import annotations

from dataclasses import dataclass

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
