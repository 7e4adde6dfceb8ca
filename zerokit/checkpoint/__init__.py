"""Sharded checkpoints in safetensors: save and load at any world size, level and tp degree.

``save(path, model, optimizer)`` and ``load(path, model, optimizer)`` are collective (every
rank calls them). ``zerokit ckpt inspect|consolidate`` reads a checkpoint without any process
group. No pickle anywhere: a checkpoint from an untrusted source cannot run code.
"""

from .consolidate import consolidate, describe
from .index import CheckpointError
from .loading import load
from .saving import save

__all__ = ["CheckpointError", "consolidate", "describe", "load", "save"]
