"""Pure: which layers each stage holds, as boundaries ``[0, b1, ..., n]`` (stage ``s`` holds
layers ``b[s]:b[s+1]``). Counting parameters builds each layer on the meta device: no memory.

>>> partition_uniform(7, 3)
[0, 3, 5, 7]
>>> partition_balanced([1, 1, 10, 1, 1], 3)
[0, 2, 3, 5]
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from .describe import LayerDesc


def count_params(item: object) -> int:
    """Parameters of one layer description (0 for a plain function), without allocating."""
    if isinstance(item, LayerDesc):
        with torch.device("meta"):
            layer = item.build()
        return sum(p.numel() for p in layer.parameters())
    if isinstance(item, torch.nn.Module):
        return sum(p.numel() for p in item.parameters())
    return 0


def partition_uniform(num_layers: int, num_stages: int) -> list[int]:
    """Equal layer counts; the first ``num_layers % num_stages`` stages take one more (the
    last stage also computes the loss)."""
    _check_enough(num_layers, num_stages)
    base, extra = divmod(num_layers, num_stages)
    bounds = [0]
    for s in range(num_stages):
        bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    return bounds


def partition_balanced(weights: Sequence[int], num_stages: int) -> list[int]:
    """Contiguous stages of at least one layer each, minimising the heaviest stage's weight
    (ties: the earliest split). Dynamic programming, O(stages * layers^2)."""
    n = len(weights)
    _check_enough(n, num_stages)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[s][i]: the least max-weight splitting layers [0, i) into s stages; cut[s][i]: where
    # the last of those stages begins.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, i):
                cost = max(best[s - 1][j], prefix[i] - prefix[j])
                if cost < best[s][i]:
                    best[s][i], cut[s][i] = cost, j
    bounds, i = [n], n
    for s in range(num_stages, 0, -1):
        i = cut[s][i]
        bounds.append(i)
    return bounds[::-1]


def check_boundaries(bounds: Sequence[int], num_layers: int, num_stages: int) -> list[int]:
    bounds = list(bounds)
    ok = (
        len(bounds) == num_stages + 1
        and bounds[0] == 0
        and bounds[-1] == num_layers
        and all(a < b for a, b in itertools.pairwise(bounds))
    )
    if not ok:
        raise ValueError(
            f"partition boundaries must rise strictly from 0 to {num_layers} with "
            f"{num_stages + 1} entries (stage s holds layers b[s]:b[s+1]), got {bounds}"
        )
    return bounds


def partition(layers: Sequence[object], num_stages: int, method) -> list[int]:
    """``method``: ``"parameters"`` (balance parameter counts), ``"uniform"`` or boundaries."""
    if method == "uniform":
        return partition_uniform(len(layers), num_stages)
    if method == "parameters":
        return partition_balanced([count_params(item) for item in layers], num_stages)
    if isinstance(method, (list, tuple)):
        return check_boundaries(method, len(layers), num_stages)
    raise ValueError(
        f"partition must be 'parameters', 'uniform' or a list of boundaries, got {method!r}"
    )


def _check_enough(num_layers: int, num_stages: int) -> None:
    if num_stages < 1 or num_layers < num_stages:
        raise ValueError(
            f"cannot split {num_layers} layers into {num_stages} stages of at least one layer"
        )
