"""``ExpertParallelExperts``: a Hugging Face experts module (3-D ``gate_up_proj`` [E, 2I, H]
and ``down_proj`` [E, H, I], the forward ``(hidden [T, H], top_k_index [T, k], top_k_weights
[T, k]) -> [T, H]``) holding only this rank's E / ep experts, its tokens exchanged with the
ep group around the expert computation.

Note: the gradient of a local expert sums the tokens of every rank of the ep group, each
rank's loss being its own batch's mean; the experts' shard group (world / ep ranks) then
averages over its size. One process's gradient is the mean over all world ranks, so the
expert weights' gradients are scaled by 1 / ep in backward (``_ScaleGrad``): sum over the
ep group, then the shard group's mean, is the world's mean.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .dispatch import assumed_route, exchange, route
from .expert_init import initialize_experts
from .groups import ExpertGroups

EXPERT_PARAMS = ("gate_up_proj", "down_proj")  # the 3-D parameters split along experts


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, scale: float):
        ctx.scale = scale
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class ExpertParallelExperts(nn.Module):
    """This rank's experts of one layer, under the original's parameter names."""

    def __init__(self, original: nn.Module, groups: ExpertGroups):
        super().__init__()
        self.num_experts = original.num_experts  # all of them, as the model's own says
        self.num_local_experts = original.num_experts // groups.ep
        self.first_expert = groups.ep_rank * self.num_local_experts
        self.hidden_dim = original.hidden_dim
        self.intermediate_dim = original.intermediate_dim
        self.act_fn = original.act_fn
        self.groups = groups
        # ``zerokit plan``'s dry run (no values): the routing it assumes (``assumed_route``)
        self.assumed_imbalance: float | None = None
        mine = slice(self.first_expert, self.first_expert + self.num_local_experts)
        # built on meta: the original, storage-less, is kept (unregistered) to run init_fn on
        # (``zerokit_init``); a real original is dropped, its experts copied out
        template = original if original.gate_up_proj.is_meta else None
        object.__setattr__(self, "_template", template)  # not a submodule: not a parameter
        for name in EXPERT_PARAMS:
            whole = getattr(original, name)
            part = nn.Parameter(whole.detach()[mine].clone(), requires_grad=whole.requires_grad)
            setattr(self, name, part)  # [E / ep, ...]

    def zerokit_init(self, init_fn) -> None:
        """``zerokit.meta_init``'s walk: ``init_fn`` on the original experts module, its
        fills landing in this rank's experts (``expert_init``)."""
        if self._template is None:
            init_fn(self)
        else:
            initialize_experts(self, self._template, EXPERT_PARAMS, init_fn)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        group = self.groups.ep_group
        if self.assumed_imbalance is None:
            routing = route(top_k_index, self.num_experts, group)
        else:
            routing = assumed_route(top_k_index, self.num_experts, group, self.assumed_imbalance)
        sent = hidden_states[routing.token]  # [A, H], grouped by expert
        rows = exchange(sent, routing.receive, routing.send, group)  # [R, H]
        out = self._compute(rows, routing)
        back = exchange(out, routing.send, routing.receive, group)  # [A, H], as sent
        back = back * top_k_weights[routing.token, routing.choice, None]
        final = torch.zeros_like(hidden_states)
        return final.index_add(0, routing.token, back.to(final.dtype))

    def _compute(self, rows, routing):
        """Each local expert on its rows, as the model's own forward computes one expert.

        Note: a rank receiving no rows at all still ties its (empty) output to the rows and
        the weights: without the rows, autograd would never run the dispatch's backward here,
        so this rank would skip an all-to-all its ep group runs (a hang); without the weights,
        the experts' unit would get no gradient to reduce (zeros: one process leaves unused
        experts' rows of the gradient zero too)."""
        scale = 1.0 / self.groups.ep
        gate_up = _ScaleGrad.apply(self.gate_up_proj, scale)
        down = _ScaleGrad.apply(self.down_proj, scale)
        out = rows.new_zeros(rows.shape[0], self.hidden_dim)
        if rows.shape[0] == 0:  # no tokens here: see the Note below
            return out + 0 * (gate_up.sum() + down.sum() + rows.sum()).to(out.dtype)
        starts = None if routing.expert_rows is None else [0, *routing.expert_rows]
        for e in range(self.num_local_experts):
            if starts is not None:  # assumed routing: each expert's rows in a run (no values)
                start = sum(starts[: e + 1])
                index = torch.arange(start, start + starts[e + 1], device=rows.device)
            else:
                (index,) = torch.where(routing.local_expert == e)
            if index.numel() == 0:
                continue
            gate, up = F.linear(rows[index], gate_up[e]).chunk(2, dim=-1)
            out = out.index_copy(0, index, F.linear(self.act_fn(gate) * up, down[e]))
        return out

    def extra_repr(self) -> str:
        first, n = self.first_expert, self.num_local_experts
        return f"experts {first}..{first + n - 1} of {self.num_experts}, ep={self.groups.ep}"
