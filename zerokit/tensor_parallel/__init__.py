"""Tensor parallelism (Megatron style) that composes with every ZeRO level over dp x tp.

>>> from zerokit import tensor_parallel as tp
>>> tp.TPSplit.of(dim=0, size=11, tp_degree=3).block_sizes
(3, 3, 5)
"""

from .cross_entropy import ParallelCrossEntropy
from .gather_batch import BatchGatherLinear, distributed_params, is_distributed
from .layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelLayer,
    VocabParallelEmbedding,
    allreduce_sequence_parallel_grads,
)
from .mappings import (
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
)
from .random import GLOBAL_SEED, LOCAL_SEED, RNGStatesTracker, model_parallel_random_seed
from .state_dict import gather_full_state_dict, load_full_state_dict
from .topology import TPSplit

__all__ = [
    "GLOBAL_SEED",
    "LOCAL_SEED",
    "BatchGatherLinear",
    "ColumnParallelLinear",
    "ParallelCrossEntropy",
    "RNGStatesTracker",
    "RowParallelLinear",
    "TPSplit",
    "TensorParallelLayer",
    "VocabParallelEmbedding",
    "allreduce_sequence_parallel_grads",
    "copy_to_tp_region",
    "distributed_params",
    "gather_from_sequence_parallel_region",
    "gather_from_tp_region",
    "gather_full_state_dict",
    "is_distributed",
    "load_full_state_dict",
    "model_parallel_random_seed",
    "reduce_from_tp_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tp_region",
]
