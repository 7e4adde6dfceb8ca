"""Cross-entropy over vocabulary-split logits, without gathering them.

Each tp rank holds the logits of its own vocabulary range ``[..., V/tp]``. A forward makes
three all-reduces over the tp group: the ranks' vocabulary sizes (``[tp]``: where this rank's
range begins), the row maximum (``[N]``, MAX), and the sum of exponentials with the target's
logit (``[2, N]``, one SUM), so the ``[N, V]`` logits never cross the wire. The backward sends
nothing: the gradient is ``softmax - one_hot`` restricted to this rank's range.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from ..layout import Layout, as_layout
from ..runtime.teardown import hand


def _all_reduce(x: torch.Tensor, group: ProcessGroup, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group.size() > 1:
        dist.all_reduce(hand(x), op=op, group=group)
    return x


def vocab_start(local_vocab: int, group: ProcessGroup) -> int:
    """Where this rank's vocabulary range begins: the sum of the lower ranks' sizes."""
    sizes = torch.zeros(group.size(), dtype=torch.long)
    sizes[group.rank()] = local_vocab
    return int(_all_reduce(sizes, group)[: group.rank()].sum())


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, start, ignore_index, group):
        # logits: [N, V_local] this rank's vocabulary columns; target: [N] global ids
        ctx.dtype = logits.dtype
        logits = logits.float()
        row_max = _all_reduce(logits.max(dim=-1).values, group, dist.ReduceOp.MAX)
        shifted = logits - row_max.unsqueeze(-1)
        exp = shifted.exp()
        local_target = target - start
        mine = (local_target >= 0) & (local_target < logits.shape[-1])
        local_target = local_target.masked_fill(~mine, 0)
        picked = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) * mine
        sums = _all_reduce(torch.stack([exp.sum(dim=-1), picked]), group)  # [2, N]
        loss = sums[0].log() - sums[1]
        valid = target != ignore_index
        ctx.save_for_backward(exp.div_(sums[0].unsqueeze(-1)), local_target, mine, valid)
        return loss.masked_fill(~valid, 0.0)

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, mine, valid = ctx.saved_tensors
        grad = softmax  # saved for this one backward: updated in place
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_target] -= mine.to(grad.dtype)
        grad.mul_((grad_loss * valid).unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None, None


class ParallelCrossEntropy(nn.Module):
    """``F.cross_entropy`` for logits split along the vocabulary across the tp group.

    Takes this rank's logits ``[..., V_local]`` and the global target ids ``[...]``;
    ``reduction`` is ``'mean'`` (over targets that are not ``ignore_index``), ``'sum'`` or
    ``'none'``. Every tp rank gets the same loss.
    """

    def __init__(
        self,
        reduction: str = "mean",
        ignore_index: int = -100,
        *,
        layout: Layout | None = None,
    ):
        super().__init__()
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
        self.layout = as_layout(layout, "ParallelCrossEntropy")
        self.reduction, self.ignore_index = reduction, ignore_index

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        group = self.layout.tp_group
        start = vocab_start(logits.shape[-1], group)
        flat_logits = logits.reshape(-1, logits.shape[-1])
        loss = _VocabParallelCrossEntropy.apply(
            flat_logits, target.reshape(-1), start, self.ignore_index, group
        ).to(logits.dtype)
        if self.reduction == "none":
            return loss.view(target.shape)
        if self.reduction == "sum":
            return loss.sum()
        return loss.sum() / (target != self.ignore_index).sum()
