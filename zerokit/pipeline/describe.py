"""Layer descriptions: what to build, built only on the stage that holds the layer.

Paddle's ``LayerDesc`` / ``SharedLayerDesc``: a ``PipelineModule`` is given descriptions, not
modules, so a rank never allocates another stage's layers (``partition.py`` builds them on the
meta device to count their parameters).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn


class LayerDesc:
    """``LayerDesc(nn.Linear, 8, 8)``: ``nn.Linear(8, 8)``, built when ``build()`` is called."""

    def __init__(self, layer_cls: Callable[..., nn.Module], *args: Any, **kwargs: Any):
        if not callable(layer_cls):
            raise TypeError(f"LayerDesc takes a module class or factory, got {layer_cls!r}")
        self.layer_cls, self.args, self.kwargs = layer_cls, args, kwargs

    def build(self) -> nn.Module:
        return self.layer_cls(*self.args, **self.kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({getattr(self.layer_cls, '__name__', self.layer_cls)})"


class SharedLayerDesc(LayerDesc):
    """A layer whose ``shared_weight_attr`` parameter is one tensor wherever ``key`` appears
    (e.g. a token embedding and the LM head tied to it). Paddle's argument order.

    Every stage holding ``key`` builds the layer once; ``forward_func(layer, x)`` (default:
    ``layer(x)``) is how this occurrence uses it. Across stages the weight starts equal
    (broadcast from the first stage holding it) and its gradients are summed before the step.
    """

    def __init__(
        self,
        key: str,
        layer_cls: Callable[..., nn.Module],
        forward_func: Callable[[nn.Module, Any], Any] | None = None,
        shared_weight_attr: str = "weight",
        *args: Any,
        **kwargs: Any,
    ):
        super().__init__(layer_cls, *args, **kwargs)
        self.key, self.forward_func, self.shared_weight_attr = key, forward_func, shared_weight_attr

    def __repr__(self) -> str:
        return f"SharedLayerDesc({self.key!r}, {getattr(self.layer_cls, '__name__', '?')})"


def is_desc(item: object) -> bool:
    return isinstance(item, LayerDesc)
