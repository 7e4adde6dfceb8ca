"""Tokens to the ranks holding their experts and back: the all-to-all with variable split
sizes, as an autograd function (its backward is the all-to-all the other way), and the
routing arithmetic around it. gloo and NCCL both run ``all_to_all_single`` with uneven
splits, empty ones included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group: ProcessGroup):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return all_to_all(grad, in_splits, out_splits, ctx.group), None, None, None


def all_to_all(x, out_splits: list[int], in_splits: list[int], group: ProcessGroup):
    """Rows ``x[sum(in_splits[:r]):...]`` to rank r of ``group``; returns the rows each rank
    sent here, in rank order. Nothing is sent at group size 1."""
    if group.size() == 1:
        return x.clone()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def exchange(x, out_splits: list[int], in_splits: list[int], group: ProcessGroup):
    """``all_to_all`` with a gradient (the reverse exchange)."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


@dataclass(frozen=True)
class Routing:
    """Where this rank's (token, choice) assignments go: sorted by expert (so each ep rank's
    are contiguous), and what comes back in."""

    token: torch.Tensor  # [A] the token of each sorted assignment
    choice: torch.Tensor  # [A] its position among the token's top-k
    send: list[int]  # assignments to each ep rank
    receive: list[int]  # assignments from each ep rank
    local_expert: torch.Tensor  # [R] the local expert of each received row
    expert_rows: list[int] | None = None  # assumed routing: rows of each local expert, in order


def route(top_k_index: torch.Tensor, num_experts: int, group: ProcessGroup) -> Routing:
    """Exchange the per-expert counts (one small all-to-all) and sort the assignments."""
    ep = group.size()
    local = num_experts // ep
    flat = top_k_index.reshape(-1)  # [T * k]
    order = torch.argsort(flat, stable=True)  # by expert, then by token: the model's order
    k = top_k_index.shape[-1]
    counts = torch.bincount(flat, minlength=num_experts).view(ep, local)  # [ep, local]
    received = all_to_all(counts, [1] * ep, [1] * ep, group)  # [ep, local]: from each rank
    local_expert = torch.arange(local, device=flat.device).repeat(ep)
    return Routing(
        token=order // k,
        choice=order % k,
        send=counts.sum(1).tolist(),
        receive=received.sum(1).tolist(),
        local_expert=local_expert.repeat_interleave(received.reshape(-1)),
    )


def assumed_route(
    top_k_index: torch.Tensor, num_experts: int, group: ProcessGroup, imbalance: float
) -> Routing:
    """The routing ``zerokit plan`` assumes, reading no values (its dry run has none): this
    rank's assignments spread evenly over the ep ranks, and this rank the busiest, receiving
    ``imbalance`` x the mean (``imbalance`` = max / mean received; 1.0: uniform routing), spread
    evenly over its local experts. The counts' all-to-all is issued as the real one is."""
    ep, local = group.size(), num_experts // group.size()
    device, k = top_k_index.device, top_k_index.shape[-1]
    assignments = top_k_index.numel()  # [T * k]
    all_to_all(top_k_index.new_empty((ep, local)), [1] * ep, [1] * ep, group)
    received = round(imbalance * assignments)  # the mean received is what each rank sends
    per_expert = _even(received, local)
    index = torch.arange(assignments, device=device)
    return Routing(
        token=index // k,
        choice=index % k,
        send=_even(assignments, ep),
        receive=_even(received, ep),
        local_expert=torch.arange(local, device=device).repeat_interleave(
            torch.tensor(per_expert, device=device), output_size=received
        ),
        expert_rows=per_expert,
    )


def _even(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` as evenly as integers allow, the larger first."""
    return [total // parts + (i < total % parts) for i in range(parts)]
