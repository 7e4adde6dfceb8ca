"""Pipeline parallelism: layers split by depth across ranks, activations and their gradients
passed between neighbouring stages, micro-batches scheduled naive, F-then-B or 1F1B.

describe (what to build) -> partition (pure: which stage holds what) -> p2p (transfers) ->
schedules (pure action lists, executor) -> finalize (``finalize_grads``: the reductions after
the schedule) -> module (``PipelineModule``: builds the stage, runs ``forward_backward``) ->
split (``split_model``: an unmodified Hugging Face model cut into stages at named blocks).
"""

from .describe import LayerDesc, SharedLayerDesc
from .finalize import finalize_grads
from .module import PipelineModule, PipelineStage
from .partition import count_params, partition_balanced, partition_uniform
from .schedules import Action, f_then_b, naive, one_f_one_b, schedule
from .split import SplitPipeline, split_model

__all__ = [
    "Action",
    "LayerDesc",
    "PipelineModule",
    "PipelineStage",
    "SharedLayerDesc",
    "SplitPipeline",
    "count_params",
    "f_then_b",
    "finalize_grads",
    "naive",
    "one_f_one_b",
    "partition_balanced",
    "partition_uniform",
    "schedule",
    "split_model",
]
