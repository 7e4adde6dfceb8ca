"""Tensor-parallel layers with torch conventions (``weight`` is ``[out, in]``).

Each layer is built the way the plain layer would be (same random draws, so after the same
``torch.manual_seed`` it holds exactly its slice of ``nn.Linear`` / ``nn.Embedding``), then
keeps only this tp rank's part. A layer says which of its parameters are split, and how, in
``tp_splits``; every other parameter of it (a row-parallel bias) is replicated on the tp
ranks. That declaration is what ZeRO, ``clip_grad_norm_`` and the full state dict read.

Note: building the plain layer first costs one full-size temporary per layer at construction.

With ``sequence_parallel=True`` the activations outside the column -> row pair are
sequence-first ``[s, b, h]`` split along the sequence (each tp rank ``[s/t, b, h]``): a column
layer all-gathers the sequence before its matmul (and keeps only its own block for backward,
gathering again there), a row layer reduce-scatters its output instead of all-reducing it. A
parameter replicated across tp but used inside that region (a LayerNorm's, the row bias) then
gets a different partial gradient on each tp rank; it is marked ``param.sequence_parallel =
True`` (Megatron's mark, read by ZeRO, which sums it over the tp group) and, for a model not
wrapped by ZeRO, ``allreduce_sequence_parallel_grads(model)`` sums it after backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layout import Layout, as_layout
from .mappings import (
    _gather_first,
    _reduce_scatter_first,
    copy_to_tp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
)
from .topology import TPSplit


class TensorParallelLayer(nn.Module):
    """Base of the layers below: the layout they use and how their parameters are split."""

    def __init__(self, layout: Layout | None):
        super().__init__()
        self.layout = as_layout(layout, type(self).__name__)
        self.tp_splits: dict[str, TPSplit] = {}  # parameter name -> its split

    @property
    def tp_group(self):
        return self.layout.tp_group

    def _plain(self, device=None, dtype=None) -> nn.Module:
        """The plain layer this one is a slice of (drawn from the default generator)."""
        raise NotImplementedError

    def _linear_weight(self) -> torch.Tensor:
        """The weight as ``F.linear`` takes it, ``[out, in]`` (a transposed layout overrides)."""
        return self.weight

    def reset_parameters(self) -> None:
        """This rank's slices of a freshly drawn plain layer: on a model built on meta (the
        default ``init_fn``), each tp rank gets the slice eager construction gives it from the
        same generator state. Costs one full plain layer while it runs."""
        plain = self._plain(device=self.weight.device, dtype=self.weight.dtype)
        with torch.no_grad():
            for name, full in plain.named_parameters():
                split = self.tp_splits.get(name)
                local = full if split is None else split.local(full, self.layout.tp_rank)
                getattr(self, name).copy_(local)

    def _keep_local(self, name: str, full: torch.Tensor, split: TPSplit | None) -> None:
        local = full if split is None else split.local(full, self.layout.tp_rank)
        setattr(self, name, nn.Parameter(local.detach().clone()))
        if split is not None:
            self.tp_splits[name] = split


def _features_split(size: int, layout: Layout, what: str, even: bool, stride: int = 1):
    if even and size % (layout.tp_degree * stride):
        raise ValueError(
            f"{what} = {size} must be divisible by the tp degree {layout.tp_degree}"
            + (f" times the {stride} fused blocks" if stride > 1 else "")
            + " (the activation is split or gathered in equal parts across tp ranks)"
        )
    return TPSplit.of(0, size, layout.tp_degree, stride, what)


def _check_width(x: torch.Tensor, layer: nn.Module, want: int, full: bool) -> None:
    """Refuse an input whose features do not fit the layer, saying what to pass instead (a
    bare matmul error names neither the layer nor the split)."""
    got = x.shape[-1] if x.dim() else None
    if got == want:
        return
    name, tp = type(layer).__name__, layer.layout.tp_degree
    wanted = "the full input" if full else f"this rank's slice of the input ({tp} tp ranks)"
    message = (
        f"{name}(in_features={layer.in_features}) takes {wanted}, [..., {want}]; got [..., {got}]"
    )
    local = layer._linear_weight().shape[1]
    if isinstance(layer, RowParallelLinear) and full and got == local:
        message += (
            ": that is one rank's slice; pass input_is_parallel=True when the input is the "
            "output of a ColumnParallelLinear(gather_output=False)"
        )
    elif isinstance(layer, RowParallelLinear) and not full and got == layer.in_features:
        message += ": that is the full input; pass input_is_parallel=False to split it here"
    elif isinstance(layer, ColumnParallelLinear) and tp > 1 and got * tp == layer.in_features:
        message += (
            ": that is one rank's slice; gather it first (gather_output=True on the layer that "
            "made it), or use a RowParallelLinear(input_is_parallel=True) here"
        )
    raise ValueError(message)


class ColumnParallelLinear(TensorParallelLayer):
    """``y = x W^T + b`` with W's output rows (and b) split across the tp ranks.

    ``gather_output=True`` all-gathers the output features so every rank gets the full ``y``
    (needs ``out_features`` divisible by the tp degree); with ``False`` each rank keeps its own
    output features, ready for a ``RowParallelLinear(input_is_parallel=True)``. ``stride`` > 1
    declares ``stride`` fused projections side by side (q, k, v: 3), each split on its own.
    ``sequence_parallel=True`` takes this rank's sequence block ``[s/t, b, in]``, gathers the
    sequence for the matmul and returns ``[s, b, out/tp]`` (needs ``gather_output=False``).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        gather_output: bool = True,
        *,
        stride: int = 1,
        sequence_parallel: bool = False,
        layout: Layout | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__(layout)
        if gather_output and stride > 1:
            raise ValueError("gather_output=True would interleave the fused blocks; use stride=1")
        if gather_output and sequence_parallel:
            raise ValueError("sequence_parallel=True needs gather_output=False (a row layer next)")
        self.sequence_parallel = sequence_parallel
        # Set by a plan's "sequence" style: the input is already the whole sequence, gathered
        # at the entry of the module holding this layer by a gather whose backward
        # reduce-scatters, so the input gradient's sum over tp happens there, not here.
        self.input_sequence_gathered = False
        self.in_features, self.out_features, self.gather_output = (
            in_features,
            out_features,
            gather_output,
        )
        split = _features_split(out_features, self.layout, "out_features", gather_output, stride)
        self._bias = bias
        plain = self._plain(device, dtype)
        self._keep_local("weight", plain.weight, split)
        if bias:
            self._keep_local("bias", plain.bias, split)
        else:
            self.register_parameter("bias", None)

    def _plain(self, device=None, dtype=None) -> nn.Module:
        return nn.Linear(
            self.in_features, self.out_features, self._bias, device=device, dtype=dtype
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_width(x, self, self.in_features, full=True)
        if self.sequence_parallel:  # x: [s/t, b, in] -> [s, b, out/tp]
            w = self._linear_weight()
            return _SequenceGatheredLinear.apply(x, w, self.bias, self.tp_group)
        if not self.input_sequence_gathered:
            x = copy_to_tp_region(x, self.tp_group)
        y = F.linear(x, self._linear_weight(), self.bias)  # [..., out/tp]
        return gather_from_tp_region(y, self.tp_group) if self.gather_output else y


class RowParallelLinear(TensorParallelLayer):
    """``y = x W^T + b`` with W's input columns split across the tp ranks; partial products are
    all-reduced and the (replicated) bias is added once, after the reduction.

    ``input_is_parallel=True`` takes this rank's slice of the input features (the output of a
    ``ColumnParallelLinear(gather_output=False)``); otherwise the full input is split here,
    which needs ``in_features`` divisible by the tp degree. ``sequence_parallel=True``
    reduce-scatters the output along the sequence, ``[s, b, in/tp] -> [s/t, b, out]``, and adds
    the bias (marked ``bias.sequence_parallel = True``) after, inside the region;
    ``sequence_dim`` is the sequence dimension (1 for batch-first ``[b, s, h]``).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        input_is_parallel: bool = False,
        *,
        sequence_parallel: bool = False,
        sequence_dim: int = 0,
        layout: Layout | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__(layout)
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        self.in_features, self.out_features, self.input_is_parallel = (
            in_features,
            out_features,
            input_is_parallel,
        )
        split = _features_split(in_features, self.layout, "in_features", not input_is_parallel)
        split = TPSplit(1, split.block_sizes)  # the weight's input features are its columns
        self._bias = bias
        plain = self._plain(device, dtype)
        self._keep_local("weight", plain.weight, split)
        if bias:
            self._keep_local("bias", plain.bias, None)
            if sequence_parallel:  # added per sequence block: a partial gradient per tp rank
                self.bias.sequence_parallel = True
        else:
            self.register_parameter("bias", None)

    def _plain(self, device=None, dtype=None) -> nn.Module:
        return nn.Linear(
            self.in_features, self.out_features, self._bias, device=device, dtype=dtype
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        full = not self.input_is_parallel
        local_in = self._linear_weight().shape[1]
        _check_width(x, self, self.in_features if full else local_in, full)
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.tp_group)  # [..., in/tp]
        if self.sequence_parallel:  # [s, b, in/tp] -> [s/t, b, out]
            y = F.linear(x, self._linear_weight())
            y = reduce_scatter_to_sequence_parallel_region(y, self.tp_group, self.sequence_dim)
        else:
            y = reduce_from_tp_region(F.linear(x, self._linear_weight()), self.tp_group)
        return y if self.bias is None else y + self.bias


class _SequenceGatheredLinear(torch.autograd.Function):
    """``F.linear(all_gather_seq(x), w, b)`` keeping only this rank's block ``x`` for backward
    (the paper's count: the gathered input is not stored), gathered again there; the input
    gradient, a partial sum per rank, is reduce-scattered back to ``[s/t, b, in]``."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(_gather_first(x, group), weight, bias)  # [s, b, out/tp]

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        total = _gather_first(x, ctx.group)  # [s, b, in]
        grad_x = _reduce_scatter_first(grad.matmul(weight), ctx.group)  # [s/t, b, in]
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_w = grad_2d.t().matmul(total.reshape(-1, total.shape[-1]))
        grad_b = grad_2d.sum(dim=0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


class VocabParallelEmbedding(TensorParallelLayer):
    """An embedding whose rows (the vocabulary) are split across the tp ranks; the last rank
    takes the remainder when the vocabulary does not divide. Each rank looks up the ids in its
    range, zeros the rest, and the all-reduce completes every row."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        layout: Layout | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__(layout)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        split = _features_split(num_embeddings, self.layout, "num_embeddings", even=False)
        self.vocab_start = split.start(self.layout.tp_rank)
        self.vocab_end = self.vocab_start + split.local_size(self.layout.tp_rank)
        plain = self._plain(device, dtype)
        self._keep_local("weight", plain.weight, split)

    def _plain(self, device=None, dtype=None) -> nn.Module:
        return nn.Embedding(self.num_embeddings, self.embedding_dim, device=device, dtype=dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp_region(out, self.tp_group)  # [..., embedding_dim]


def tensor_parallel_params(model: nn.Module) -> dict[int, tuple[TensorParallelLayer, TPSplit]]:
    """``id(parameter)`` -> (its layer, its split), for every split parameter of ``model``."""
    found = {}
    for module in model.modules():
        if isinstance(module, TensorParallelLayer):
            for name, split in module.tp_splits.items():
                found[id(getattr(module, name))] = (module, split)
    return found


def tp_group_of(model: nn.Module):
    """The tp group of the model's tensor-parallel layers, or None if it has none."""
    groups = {
        id(m.tp_group): m.tp_group for m in model.modules() if isinstance(m, TensorParallelLayer)
    }
    if len(groups) > 1:
        raise ValueError("the model's tensor-parallel layers use more than one tp group")
    return next(iter(groups.values()), None)


def allreduce_sequence_parallel_grads(model: nn.Module) -> None:
    """Sum the gradient of every parameter marked ``sequence_parallel`` over the tp group, once,
    after backward (Megatron's ``finalize_model_grads`` role) for a model not wrapped by
    ``group_sharded_parallel``; a wrapped model's marked gradients are summed by ZeRO itself.

    Collective over the tp group: every tp rank calls it, before clipping and the step.
    """
    from ..core import state_of  # is ZeRO on it? asked of the core at call time

    if state_of(model) is not None:
        raise RuntimeError(
            "this model is wrapped by group_sharded_parallel, which already sums the marked "
            "gradients over the tp group; calling allreduce_sequence_parallel_grads would "
            "double them"
        )
    group = tp_group_of(model)
    grads = [
        p.grad
        for p in model.parameters()
        if getattr(p, "sequence_parallel", False) is True and p.grad is not None
    ]
    if group is None or group.size() == 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])  # one all-reduce for all of them
    torch.distributed.all_reduce(flat, group=group)
    for g, summed in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(summed.view_as(g))
