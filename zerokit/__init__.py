"""zerokit: ZeRO sharded data parallelism for PyTorch.

>>> import zerokit
>>> zerokit.LEVELS
('os', 'os_g', 'p_g_os')
"""

from . import _moved, checkpoint, data, pipeline, plans
from .api import LEVELS, group_sharded_parallel, num_params
from .clip import clip_grad_norm_
from .config import ShardingConfig, load_config
from .core import NotGatheredError, ShardedGradError
from .layout import Layout, init_hybrid_parallel, init_mesh
from .meta_init import MetaInitError, empty_init
from .mixed_precision import MixedPrecision
from .parallelize import parallelize
from .scaler import ShardedGradScaler
from .strategy import Strategy
from .unwrap import unwrap

_moved.install()  # the tools' old module names (zerokit.compare, ...), deprecated


def save_group_sharded_model(model, output: str, optimizer=None) -> None:
    """PaddlePaddle's name for ``zerokit.checkpoint.save(output, model, optimizer)``."""
    checkpoint.save(output, model, optimizer)


__all__ = [
    "LEVELS",
    "Layout",
    "MetaInitError",
    "MixedPrecision",
    "NotGatheredError",
    "ShardedGradError",
    "ShardedGradScaler",
    "ShardingConfig",
    "Strategy",
    "checkpoint",
    "clip_grad_norm_",
    "data",
    "empty_init",
    "group_sharded_parallel",
    "init_hybrid_parallel",
    "init_mesh",
    "load_config",
    "num_params",
    "parallelize",
    "pipeline",
    "plans",
    "save_group_sharded_model",
    "unwrap",
]
__version__ = "0.1.0"
