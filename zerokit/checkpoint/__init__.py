"""Sharded checkpoints in safetensors: save and load at any world size, level and tp degree.

``save(path, model, optimizer)`` and ``load(path, model, optimizer)`` are collective (every
rank calls them); ``extra=`` carries the rest of a run's state (scheduler, step, RNG states).
``async_save`` returns a future once the state is copied; ``format="dcp"`` and a DCP
directory given to ``load`` speak torch.distributed.checkpoint's format (FSDP2, torchtitan).
``zerokit ckpt inspect|consolidate`` reads a checkpoint without any process group, and
``load_consolidated`` loads a consolidated file into a plain model. No pickle anywhere: a
checkpoint from an untrusted source cannot run code.
"""

from ..runtime.timeouts import CollectiveTimeout
from .background import async_save, async_save_staging_bytes, prewarm_async_save
from .consolidate import consolidate, describe, load_consolidated
from .extra import RNGState
from .index import CheckpointError
from .loading import load
from .pretrained import load_pretrained
from .saving import save

__all__ = [
    "CheckpointError",
    "CollectiveTimeout",
    "RNGState",
    "async_save",
    "async_save_staging_bytes",
    "consolidate",
    "describe",
    "load",
    "load_consolidated",
    "load_pretrained",
    "prewarm_async_save",
    "save",
]
