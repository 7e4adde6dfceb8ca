"""Tensor-parallel layers made from a model's existing layers, keeping this tp rank's slice of
their weights: what ``zerokit.parallelize`` swaps into an unmodified model by its plan.

Beside ``nn.Linear`` and ``nn.Embedding`` this covers Hugging Face GPT-2's ``Conv1D``, which
stores its weight transposed (``[in, out]``): its tensor-parallel layers keep that layout, so a
full state dict or consolidated checkpoint has the original model's names and shapes, and an
output head split by vocabulary (``VocabParallelHead``) whose logits come back whole on every
tp rank for any vocabulary size (50257 on 2 ranks included).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..layout import Layout
from ..runtime.teardown import hand, hand_all
from .layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelLayer,
    VocabParallelEmbedding,
    _features_split,
)
from .mappings import copy_to_tp_region
from .topology import TPSplit


class _Conv1DPlain(nn.Module):
    """The shape and draw of GPT-2's ``Conv1D(nf, nx)``: weight ``[nx, nf]``, bias zeros."""

    def __init__(self, nx: int, nf: int, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(nx, nf, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(nf, device=device, dtype=dtype))
        nn.init.normal_(self.weight, std=0.02)


class ColumnParallelConv1D(ColumnParallelLinear):
    """A ``ColumnParallelLinear`` whose weight is stored ``[in, out/tp]`` as ``Conv1D``'s; its
    output stays split (a row layer follows)."""

    def __init__(self, in_features: int, out_features: int, *, stride: int = 1,
                 layout: Layout, device=None, dtype=None):  # fmt: skip
        TensorParallelLayer.__init__(self, layout)
        self.in_features, self.out_features, self._bias = in_features, out_features, True
        self.gather_output, self.sequence_parallel = False, False
        self.input_sequence_gathered = False
        split = _features_split(out_features, self.layout, "out_features", False, stride)
        plain = self._plain(device, dtype)
        self._keep_local("weight", plain.weight, TPSplit(1, split.block_sizes, stride))
        self._keep_local("bias", plain.bias, split)

    def _plain(self, device=None, dtype=None) -> nn.Module:
        return _Conv1DPlain(self.in_features, self.out_features, device, dtype)

    def _linear_weight(self) -> torch.Tensor:
        return self.weight.t()


class RowParallelConv1D(RowParallelLinear):
    """A ``RowParallelLinear`` whose weight is stored ``[in/tp, out]`` as ``Conv1D``'s; it
    takes the split output of a column layer."""

    def __init__(self, in_features: int, out_features: int, *, sequence_parallel: bool = False,
                 sequence_dim: int = 0, layout: Layout, device=None, dtype=None):  # fmt: skip
        TensorParallelLayer.__init__(self, layout)
        self.in_features, self.out_features, self._bias = in_features, out_features, True
        self.input_is_parallel = True
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        split = _features_split(in_features, self.layout, "in_features", False)
        plain = self._plain(device, dtype)
        self._keep_local("weight", plain.weight, TPSplit(0, split.block_sizes))
        self._keep_local("bias", plain.bias, None)
        if sequence_parallel:  # added per sequence block: a partial gradient per tp rank
            self.bias.sequence_parallel = True

    def _plain(self, device=None, dtype=None) -> nn.Module:
        return _Conv1DPlain(self.in_features, self.out_features, device, dtype)

    def _linear_weight(self) -> torch.Tensor:
        return self.weight.t()


class VocabParallelHead(TensorParallelLayer):
    """An output projection ``[hidden] -> [vocab]`` with the vocabulary split across the tp
    ranks as ``VocabParallelEmbedding`` splits it (the last rank takes the remainder), so a
    head tied to that embedding shares its parameter. With ``gather`` the logits are
    all-gathered: whole on every tp rank, the gradient of each rank's part flowing back to it;
    without, each rank returns its own part ``[..., V_local]`` (for ``ParallelCrossEntropy``)."""

    def __init__(
        self, in_features: int, num_embeddings: int, bias: bool, *, layout: Layout,
        gather: bool = True,
    ):  # fmt: skip
        super().__init__(layout)
        self.in_features, self.num_embeddings = in_features, num_embeddings
        self.gather = gather
        self.split = TPSplit.of(0, num_embeddings, self.layout.tp_degree, 1, "vocabulary")
        rows = self.split.local_size(self.layout.tp_rank)
        self.weight = nn.Parameter(torch.empty(rows, in_features, device="meta"))
        self.tp_splits["weight"] = self.split
        self.bias = nn.Parameter(torch.empty(rows, device="meta")) if bias else None
        if bias:
            self.tp_splits["bias"] = self.split

    def _plain(self, device=None, dtype=None) -> nn.Module:
        bias = self.bias is not None
        return nn.Linear(self.in_features, self.num_embeddings, bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to_tp_region(x, self.tp_group), self.weight, self.bias)  # [..., V/tp]
        return _GatherVocab.apply(y, self.split, self.tp_group) if self.gather else y


class _GatherVocab(torch.autograd.Function):
    """All-gather uneven vocabulary parts along the last dimension (padded to the largest part
    for the collective, then trimmed); backward keeps this rank's part of the gradient."""

    @staticmethod
    def forward(ctx, y, split: TPSplit, group):
        rank, size = group.rank(), group.size()
        ctx.start, ctx.size = split.start(rank), split.local_size(rank)
        if size == 1:
            return y
        sizes = [split.local_size(r) for r in range(size)]
        padded = y.new_zeros(*y.shape[:-1], max(sizes))
        padded[..., : y.shape[-1]] = y
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(hand_all(parts), hand(padded), group=group)
        return torch.cat([p[..., :n] for p, n in zip(parts, sizes)], dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(-1, ctx.start, ctx.size).contiguous(), None, None


def _take(layer: TensorParallelLayer, name: str, full: torch.Tensor | None) -> None:
    """Give ``layer.<name>`` this rank's slice of ``full`` (its split from ``tp_splits``)."""
    if full is None:
        return
    split = layer.tp_splits.get(name)
    local = full if split is None else split.local(full, layer.layout.tp_rank)
    sequence_parallel = getattr(getattr(layer, name), "sequence_parallel", False)
    param = nn.Parameter(local.detach().clone(), requires_grad=full.requires_grad)
    if sequence_parallel:
        param.sequence_parallel = True
    setattr(layer, name, param)


def column(
    src: nn.Module, layout: Layout, stride: int = 1, sequence_gathered: bool = False
) -> ColumnParallelLinear:
    """``src`` (``nn.Linear`` or ``Conv1D``) split by its output features; ``stride`` fused
    blocks (q, k, v: 3) each split on its own. Its output stays split (a row layer follows).
    ``sequence_gathered``: its input comes from a sequence gather that sums its gradient."""
    n_in, n_out = _features(src)
    if _is_conv1d(src):
        layer = ColumnParallelConv1D(n_in, n_out, stride=stride, layout=layout, device="meta")
    else:
        layer = ColumnParallelLinear(n_in, n_out, src.bias is not None, gather_output=False,
                                     stride=stride, layout=layout, device="meta")  # fmt: skip
    layer.input_sequence_gathered = sequence_gathered
    _take(layer, "weight", src.weight)
    _take(layer, "bias", src.bias)
    return layer


def row(src: nn.Module, layout: Layout, sequence_dim: int | None = None) -> RowParallelLinear:
    """``src`` (``nn.Linear`` or ``Conv1D``) split by its input features, taking the split
    output of a column layer; its output is all-reduced, whole on every tp rank, or with a
    ``sequence_dim`` reduce-scattered along it (this rank's block of the sequence)."""
    n_in, n_out = _features(src)
    sp = {"sequence_parallel": sequence_dim is not None, "sequence_dim": sequence_dim or 0}
    if _is_conv1d(src):
        layer = RowParallelConv1D(n_in, n_out, layout=layout, device="meta", **sp)
    else:
        layer = RowParallelLinear(n_in, n_out, src.bias is not None, input_is_parallel=True,
                                  layout=layout, device="meta", **sp)  # fmt: skip
    _take(layer, "weight", src.weight)
    _take(layer, "bias", src.bias)
    return layer


def vocab(src: nn.Module, layout: Layout, gather: bool = True) -> TensorParallelLayer:
    """An ``nn.Embedding`` or an output ``nn.Linear`` split by vocabulary (``gather``: the
    head's logits whole on every tp rank)."""
    if isinstance(src, nn.Embedding):
        layer = VocabParallelEmbedding(src.num_embeddings, src.embedding_dim, layout=layout,
                                       device="meta")  # fmt: skip
    else:
        layer = VocabParallelHead(src.in_features, src.out_features, src.bias is not None,
                                  layout=layout, gather=gather)  # fmt: skip
        _take(layer, "bias", src.bias)
    _take(layer, "weight", src.weight)
    return layer


def _is_conv1d(module: nn.Module) -> bool:
    """GPT-2's ``Conv1D`` (by name and shape: zerokit does not import transformers)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def _features(module: nn.Module) -> tuple[int, int]:
    if _is_conv1d(module):
        return module.nx, module.nf
    return module.in_features, module.out_features
