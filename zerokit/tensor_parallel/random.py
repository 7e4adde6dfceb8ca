"""Seeding the layout's random streams for tensor parallelism (``zerokit.rng``)."""

from __future__ import annotations

import torch

from ..rng import GLOBAL_SEED, LOCAL_SEED, RNGStatesTracker  # noqa: F401


def model_parallel_random_seed(seed: int, layout) -> None:
    """Seed for a dp x tp run: the default generator (and ``GLOBAL_SEED``) with ``seed`` on
    every rank, ``LOCAL_SEED`` with a seed of this tp rank's own, in ``layout.rng`` (the
    layout owns its streams: no tracker is global)."""
    torch.manual_seed(seed)
    layout.rng.reset()
    layout.rng.add(GLOBAL_SEED, seed)
    layout.rng.add(LOCAL_SEED, seed + 1 + 1009 * (layout.tp_rank + 1))
