"""zerokit: ZeRO sharded data parallelism for PyTorch.

>>> import zerokit
>>> zerokit.LEVELS
('os', 'os_g', 'p_g_os')
"""

from .api import LEVELS, group_sharded_parallel
from .clip import clip_grad_norm_
from .config import ShardingConfig
from .tensor_parallel import init_hybrid_parallel

__all__ = [
    "LEVELS",
    "ShardingConfig",
    "clip_grad_norm_",
    "group_sharded_parallel",
    "init_hybrid_parallel",
]
__version__ = "0.1.0"
