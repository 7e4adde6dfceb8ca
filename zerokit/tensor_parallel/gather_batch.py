"""The design documents' model-parallel head over data-parallel ranks: ``BatchGatherLinear``.

The documents' AlexNet runs its convolutions data-parallel (each rank its own images) and its
fully connected layers model-parallel on the same ranks. Each such layer all-gathers the inputs
of every rank, computes its slice of the output features for the whole gathered batch, and
hands every rank its own rows of the full output. Its parameters are rank-local: each rank
holds a different slice, marked ``param.is_distributed = True`` (Paddle's marker), which ZeRO
(``group_sharded_parallel``) neither broadcasts at wrap, nor averages, nor shards; each rank's
optimizer steps its own slice with its own gradient.

Gradient convention: each rank's loss is the mean over its own rows, and ZeRO averages the
data-parallel gradients over the ranks, so the body's gradients are those of the mean over the
whole batch. A head slice's gradient, computed across ranks, is that of the *sum* of the ranks'
losses; with ``average_grads=True`` (the default) the layer divides it by the group size, so
the whole model trains as one process on the whole batch would. ``False`` leaves the sum (for
a loss already divided by the number of ranks, as Paddle's ``scale_loss`` does).

Note: the output's "all-gather the features, keep my rows" is done as one all-to-all (each
rank receives only its rows of every rank's feature slice): the same result with 1/N of the
all-gather's traffic, and its backward is the conjugate all-to-all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from ..core import is_distributed
from ..runtime.teardown import hand, hand_all
from .mappings import gather_from_sequence_parallel_region
from .topology import TPSplit


def _check_batch(x: torch.Tensor, group: ProcessGroup) -> None:
    """Every rank must bring the same number of rows (one small all-gather): a rank with
    another batch size fails here on every rank, not inside gloo."""
    size = torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device)
    sizes = [torch.empty_like(size) for _ in range(group.size())]
    dist.all_gather(hand_all(sizes), hand(size), group=group)
    got = [int(s) for s in sizes]
    if len(set(got)) > 1:
        raise ValueError(
            f"BatchGatherLinear gathers the batch of every rank, which must be of one size: the "
            f"ranks bring {got} rows; give every rank the same local batch size"
        )


def _exchange(x: torch.Tensor, send: list[int], receive: list[int], group) -> torch.Tensor:
    """A flat all-to-all: ``send[k]`` elements of ``x`` (in order) to rank k, ``receive[k]``
    from rank k, returned in rank order."""
    out = x.new_empty(sum(receive))
    dist.all_to_all_single(hand(out), hand(x.contiguous().view(-1)), receive, send, group=group)
    return out


class _FeaturesToRows(torch.autograd.Function):
    """Forward: ``[N b, out_r]`` (this rank's features, every row) -> ``[b, out]`` (every
    feature, this rank's rows). Backward: the reverse."""

    @staticmethod
    def forward(ctx, y, widths, group):
        ctx.widths, ctx.group = widths, group
        n, me = len(widths), group.rank()
        b = y.shape[0] // n
        ctx.rows = b
        parts = _exchange(y, [b * widths[me]] * n, [b * w for w in widths], group)
        blocks = [p.view(b, w) for p, w in zip(parts.split([b * w for w in widths]), widths)]
        return torch.cat(blocks, dim=1)

    @staticmethod
    def backward(ctx, grad):
        widths, group, b = ctx.widths, ctx.group, ctx.rows
        n, me = len(widths), group.rank()
        columns = [c.contiguous().view(-1) for c in grad.split(list(widths), dim=1)]
        parts = _exchange(torch.cat(columns), [b * w for w in widths], [b * widths[me]] * n, group)
        return parts.view(n * b, widths[me]), None, None


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class BatchGatherLinear(nn.Module):
    """``y = x W^T + b`` computed model-parallel over data-parallel ranks: each rank holds
    output rows ``W[r]`` (and ``b[r]``) of the plain ``nn.Linear`` (split as
    ``ColumnParallelLinear`` splits them; built after ``torch.manual_seed(s)`` it holds exactly
    its slice of the ``nn.Linear`` built after the same seed), takes its own batch ``[b, in]``
    and returns its own rows of the full output ``[b, out]``.

    ``group``: the ranks that share the layer and gather their batches (the world if None);
    every rank of it must call forward with the same local batch size. Its parameters are
    marked ``is_distributed = True``; ``tp_splits`` says how they are split and ``split_rank``
    which part this rank holds (read by checkpoints). See the module docstring for
    ``average_grads``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        group: ProcessGroup | None = None,
        *,
        average_grads: bool = True,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if group is None and dist.is_initialized():
            group = dist.group.WORLD
        self.group = group
        size = group.size() if group is not None else 1
        self.split_rank = group.rank() if group is not None else 0
        self.in_features, self.out_features = in_features, out_features
        self.average_grads = average_grads
        split = TPSplit.of(0, out_features, size, what="out_features")
        self.tp_splits: dict[str, TPSplit] = {}
        plain = nn.Linear(in_features, out_features, bias, device=device, dtype=dtype)
        for name in ("weight", "bias"):
            full = getattr(plain, name)
            if full is None:
                self.register_parameter(name, None)
                continue
            param = nn.Parameter(split.local(full, self.split_rank).detach().clone())
            param.is_distributed = True
            setattr(self, name, param)
            self.tp_splits[name] = split

    @property
    def widths(self) -> tuple[int, ...]:
        return next(iter(self.tp_splits.values())).block_sizes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.group
        if group is None or group.size() == 1:
            return F.linear(x, self.weight, self.bias)
        _check_batch(x, group)
        lead = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])
        weight, bias = self.weight, self.bias
        if self.average_grads:
            weight = _ScaleGrad.apply(weight, 1.0 / group.size())
            bias = None if bias is None else _ScaleGrad.apply(bias, 1.0 / group.size())
        # every rank's rows in rank order; backward sums the ranks' partial gradients and keeps
        # this rank's rows: the sequence-parallel gather along dim 0, here along the batch
        rows = gather_from_sequence_parallel_region(x, group)
        y = F.linear(rows, weight, bias)  # [N b, out_r]
        return _FeaturesToRows.apply(y, self.widths, group).view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, part={self.split_rank} of {len(self.widths)}"
        )


@dataclass(frozen=True)
class DistributedParam:
    """A rank-local parameter: how it is split (None if not described) and this rank's part."""

    name: str
    param: nn.Parameter
    split: TPSplit | None
    split_rank: int
    group: ProcessGroup | None  # the ranks whose parts make the whole (None: not known)


def distributed_params(model: nn.Module) -> dict[int, DistributedParam]:
    """``id(parameter)`` -> its description, for every parameter of ``model`` marked
    ``is_distributed``; a ``BatchGatherLinear``'s describe their split and group."""
    found: dict[int, DistributedParam] = {}
    for prefix, module in model.named_modules():
        if isinstance(module, BatchGatherLinear):
            for name, split in module.tp_splits.items():
                p = getattr(module, name)
                full = f"{prefix}.{name}" if prefix else name
                found[id(p)] = DistributedParam(full, p, split, module.split_rank, module.group)
    for name, p in model.named_parameters():
        if is_distributed(p) and id(p) not in found:
            found[id(p)] = DistributedParam(name, p, None, 0, None)
    return found
