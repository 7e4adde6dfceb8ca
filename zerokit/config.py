"""Rarely used knobs, in one place."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True, kw_only=True)
class ShardingConfig:
    wrap: tuple[type[nn.Module], ...] = ()
    """Level 'p_g_os': module classes that become units (each instance gathered and freed as a
    whole). Empty: the default policy — children of ``nn.ModuleList``/``nn.Sequential`` and
    modules whose own parameters reach ``segment_size`` elements."""
