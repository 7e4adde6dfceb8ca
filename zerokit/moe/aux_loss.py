"""The router's load-balancing loss over the global batch.

Hugging Face's MoE models (``output_router_logits=True``) add ``router_aux_loss_coef *
load_balancing_loss_func(router_logits, ...)`` to the loss: the fraction of assignments each
expert gets times its mean routing probability, summed, times the number of experts. Both
are means over the batch, and a product of means is not a mean of products: each rank's
own aux loss, averaged as DDP averages gradients, is not the aux loss of the whole batch.
``GlobalAuxLoss`` sums the statistics over the data-parallel ranks first (Qwen's
global-batch balancing, Megatron's global aux loss), so every rank's loss holds the aux loss
one process computes on the whole batch.

Note: every rank's aux loss is then the same function of the summed probabilities S, so
the gradient reaching S is the same on every rank; the all-reduce's backward (a sum of those
gradients) is that gradient times the group size, with no communication (``_SumOver``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

AUX_LOSS_MODES = ("global", "per_rank")


class _SumOver(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: ProcessGroup):
        ctx.size = group.size()
        out = x.clone()
        if ctx.size > 1:
            dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.size, None


def global_load_balancing_loss(
    router_logits: tuple[torch.Tensor, ...],
    num_experts: int,
    top_k: int,
    group: ProcessGroup,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``load_balancing_loss_func`` of transformers' Mixtral, Qwen3-MoE and OLMoE, its sums
    taken over every rank of ``group``. Collective."""
    device = router_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    mask = None
    if attention_mask is not None:
        mask = attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for logits in router_logits:  # [T, E] per layer
        weights = torch.softmax(logits.to(device), dim=-1)
        _, chosen = torch.topk(weights, top_k, dim=-1)
        ones = torch.ones_like(chosen, dtype=torch.float32) if mask is None else None
        each = ones if mask is None else mask.unsqueeze(-1).expand_as(chosen)
        counts = counts.scatter_add(0, chosen.reshape(-1), each.reshape(-1))
        row_mask = 1.0 if mask is None else mask.unsqueeze(-1)
        probs = probs + (weights.float() * row_mask).sum(dim=0)
        rows = rows + (weights.shape[0] if mask is None else mask.sum())
    stats = torch.cat([counts, rows.reshape(1)]).detach()
    if group.size() > 1:
        dist.all_reduce(stats, group=group)
    counts, rows = stats[:-1], stats[-1]
    probs = _SumOver.apply(probs, group)
    return torch.sum((counts / rows) * (probs / rows)) * num_experts


class GlobalAuxLoss:
    """A forward hook on the model: its ``aux_loss`` (and the ``router_aux_loss_coef`` share
    of its ``loss``) replaced by the global batch's."""

    def __init__(self, model: nn.Module, group: ProcessGroup):
        self.group = group
        self.handle = model.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, model, args, kwargs, output):
        local = getattr(output, "aux_loss", None)
        logits = getattr(output, "router_logits", None)
        if local is None or not logits:
            return output  # output_router_logits off: nothing to replace
        cfg = model.config
        experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
        mask = kwargs.get("attention_mask")
        aux = global_load_balancing_loss(logits, experts, cfg.num_experts_per_tok, self.group, mask)
        if output.loss is not None:
            coef = model.router_aux_loss_coef
            output.loss = output.loss + coef * (aux - local.to(output.loss.device))
        output.aux_loss = aux
        return output
