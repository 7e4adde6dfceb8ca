"""The GPT's mixture-of-experts MLP (``GPTConfig(n_experts=E, top_k=k)``): a router and E
experts in the layout Hugging Face's MoE models use in transformers 5, so that
``zerokit.moe``'s plan splits them across ep ranks like a Mixtral's.

``MoEMLP``: router logits [T, E], softmax, top-k, the k weights renormalised to sum to one
(Mixtral's routing), then ``GPTExperts(hidden, top_k_index, top_k_weights)``. The experts
are two 3-D parameters, ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]; expert e
computes ``down[e] @ (act(gate) * up)`` with ``gate, up = (gate_up[e] @ x).chunk(2)``, and
its output is scaled by the token's weight for it: the forward
``zerokit.moe.ExpertParallelExperts`` reproduces on this rank's E / ep experts.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class GPTExperts(nn.Module):
    """E experts of one block, all of them (``zerokit.moe`` splits them)."""

    def __init__(self, num_experts: int, hidden_dim: int, intermediate_dim: int, n_layer: int):
        super().__init__()
        self.num_experts = num_experts
        self.hidden_dim = hidden_dim
        self.intermediate_dim = intermediate_dim
        self.act_fn = nn.SiLU()  # a gated MLP, as Mixtral's experts
        E, H, intermediate = num_experts, hidden_dim, intermediate_dim
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * intermediate, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, intermediate))
        self.n_layer = n_layer
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT's initialisation (also meta init's default ``init_fn``): the projection back
        into the residual stream scaled by 1/sqrt(2 n_layer)."""
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02 / math.sqrt(2 * self.n_layer))

    def forward(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        # hidden [T, H], top_k_index / top_k_weights [T, k] -> [T, H]
        if _without_values(hidden):
            return self._every_expert(hidden, top_k_index, top_k_weights)
        out = torch.zeros_like(hidden)
        for e in top_k_index.unique().tolist():  # only the experts some token chose
            token, choice = torch.where(top_k_index == e)
            gate, up = F.linear(hidden[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(self.act_fn(gate) * up, self.down_proj[e])  # [n, H]
            out = out.index_add(0, token, y * top_k_weights[token, choice, None])
        return out

    def _every_expert(self, hidden, top_k_index, top_k_weights):
        """The same output with no value-dependent shape (``zerokit plan``'s dry run runs
        the model on meta or fake tensors): every expert over every token, weighted by that
        token's weight for it (zero where unchosen). E / k times the work: never trained."""
        out = torch.zeros_like(hidden)
        for e in range(self.num_experts):
            weight = (top_k_weights * (top_k_index == e)).sum(dim=-1, keepdim=True)  # [T, 1]
            gate, up = F.linear(hidden, self.gate_up_proj[e]).chunk(2, dim=-1)
            out = out + F.linear(self.act_fn(gate) * up, self.down_proj[e]) * weight
        return out


def _without_values(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake  # the dry run's tensors

    return t.device.type == "meta" or is_fake(t)


class MoEMLP(nn.Module):
    """A block's MLP as a router over experts: [B, T, C] -> [B, T, C]."""

    def __init__(self, n_embd: int, n_experts: int, top_k: int, expert_dim: int, n_layer: int):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(n_embd, n_experts, bias=False)
        self.experts = GPTExperts(n_experts, n_embd, expert_dim, n_layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        hidden = x.reshape(-1, shape[-1])  # [T, C], every position of the batch
        probs = torch.softmax(self.router(hidden), dim=-1, dtype=torch.float32)  # [T, E]
        weights, index = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(hidden.dtype)
        return self.experts(hidden, index, weights).reshape(shape)
