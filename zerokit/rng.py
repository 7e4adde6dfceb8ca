"""Named random-number streams (Paddle's ``get_rng_state_tracker``), one tracker per layout.

Dropout inside a tensor-parallel region (on split activations) must differ across tp ranks,
or every rank would drop the same features of its different slice; dropout on replicated
activations must be identical on every tp rank, or the replicas drift apart. The tracker keeps
one generator state per name; ``rng_state(name)`` swaps it in for the default generator (CPU,
and the current CUDA device once CUDA is in use), runs the block, and keeps the advanced state.
Each ``Layout`` owns one tracker (``layout.rng``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

LOCAL_SEED = "local_seed"  # differs across tp ranks: dropout on split activations
GLOBAL_SEED = "global_seed"  # the same on every tp rank: dropout on replicated activations


def _get_states() -> dict[str, torch.Tensor]:
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _set_states(states: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(states["cpu"])
    if "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"])


class RNGStatesTracker:
    """Named generator states. ``add(name, seed)`` once, then ``with rng_state(name): ...``."""

    def __init__(self):
        self._states: dict[str, dict[str, torch.Tensor]] = {}
        self._seeds: dict[int, str] = {}

    def reset(self) -> None:
        self._states.clear()
        self._seeds.clear()

    def add(self, name: str, seed: int) -> None:
        if name in self._states:
            raise ValueError(f"rng state {name!r} already exists; reset() the tracker first")
        if seed in self._seeds:
            raise ValueError(f"seed {seed} is already used by rng state {self._seeds[seed]!r}")
        outer = _get_states()
        torch.manual_seed(seed)
        self._states[name] = _get_states()
        self._seeds[seed] = name
        _set_states(outer)

    @contextlib.contextmanager
    def rng_state(self, name: str = LOCAL_SEED) -> Iterator[None]:
        if name not in self._states:
            raise KeyError(f"no rng state named {name!r}; add it with add({name!r}, seed) first")
        outer = _get_states()
        _set_states(self._states[name])
        try:
            yield
        finally:
            self._states[name] = _get_states()
            _set_states(outer)
