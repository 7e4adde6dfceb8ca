"""The sharding core: flat layout, buckets, collectives, shard groups and their life cycle.

Only ``zerokit.api`` builds it; the tools around it (checkpoint, memory, clip, scaler) use the
small public protocol of ``ShardState`` (``zerokit.core.state``).
"""

from .optimizer import as_optimizer_list, optimizer_params_of

__all__ = ["as_optimizer_list", "optimizer_params_of"]
