"""What this rank's gradients are a part of, beyond the module that holds them.

A pipeline stage holds a slice of the model by depth: a norm over "the model" must also be
summed over the other stages, an overflow must skip the step on every stage, and a tied
weight's later copy (the same tensor as one process sees it) must not be counted twice.
``zerokit.clip_grad_norm_`` and ``zerokit.ShardedGradScaler`` read that here, so they need not
know what a pipeline is: a model says so by offering ``grad_scope()`` (``PipelineModule`` and
its ``PipelineStage`` do).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.distributed import ProcessGroup


@dataclass(frozen=True)
class GradScope:
    holder: nn.Module
    """The module whose parameters hold this rank's gradients (a pipeline's stage)."""
    across: tuple[ProcessGroup, ...] = ()
    """Groups of ranks holding the rest of the model (the pipeline's stages): a norm's partial
    sum and the overflow flag are reduced over them too."""
    left_out: frozenset[int] = frozenset()
    """ids of parameters that are a copy of one counted elsewhere (a tied weight on a later
    stage): not counted again in a norm, still scaled by a clip."""


def grad_scope(model: nn.Module) -> GradScope | None:
    """``model.grad_scope()`` where the model is a part of something larger, else None."""
    scope = getattr(model, "grad_scope", None)
    return scope() if callable(scope) else None
