"""The design documents' AlexNet trains with a data-parallel body and a model-parallel head on
the same ranks, printing its losses beside one process training the plain model on the whole
batch.

The convolutions run data-parallel under a ZeRO level (each rank its own images); the three
fully connected layers are ``tp.BatchGatherLinear``: each gathers every rank's batch, computes
its slice of the output features and hands every rank its own rows. Their parameters are
rank-local (``is_distributed``): ZeRO neither broadcasts, averages nor shards them. Small
random 16x16 images, CPU, dropout off by default (so the two runs match).

    python examples/alexnet_hybrid.py --nproc 2 --level os_g    # starts local gloo ranks
    torchrun --nproc-per-node 2 examples/alexnet_hybrid.py --level p_g_os
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zerokit
from zerokit import tensor_parallel as tp
from zerokit.tools.launch import spawn_local

IMAGE = 16  # pixels a side; three 2x2 poolings leave 2x2


class AlexNet(nn.Module):
    """Three convolutions (data-parallel) and three fully connected layers: plain
    ``nn.Linear`` with ``hybrid=False``, ``tp.BatchGatherLinear`` over ``group`` with
    ``hybrid=True``. Built after the same seed, the hybrid one holds its slices of the plain
    one's values."""

    def __init__(
        self,
        classes: int = 10,
        width: int = 8,
        hidden: int = 32,
        dropout: float = 0.0,
        hybrid: bool = False,
        group=None,
    ):
        super().__init__()

        def linear(i: int, o: int) -> nn.Module:
            return tp.BatchGatherLinear(i, o, group=group) if hybrid else nn.Linear(i, o)

        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(2 * width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        flat = 2 * width * (IMAGE // 8) ** 2
        self.classifier = nn.Sequential(
            nn.Dropout(dropout),
            linear(flat, hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            linear(hidden, hidden),
            nn.ReLU(),
            linear(hidden, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


def batch(step: int, size: int, classes: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: random images and labels, the same on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    images = torch.randn(size, 3, IMAGE, IMAGE, generator=g)
    return images, torch.randint(classes, (size,), generator=g)


def run(rank: int, world_size: int, args) -> dict:
    """Train the hybrid model (ZeRO ``args.level`` over every rank) and, in this process, the
    plain one on the whole batch; returns both runs' losses and the largest parameter
    difference at the end (over every rank)."""
    group = dist.group.WORLD
    torch.manual_seed(0)
    reference = AlexNet(dropout=args.dropout)  # one process, the plain model
    torch.manual_seed(0)  # the hybrid model holds its slices of the same values
    model = AlexNet(dropout=args.dropout, hybrid=True, group=group)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=args.lr)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, opt, _ = zerokit.group_sharded_parallel(model, opt, args.level, group=group)
    per_rank = args.batch // world_size
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    ref_losses, losses, ref_norms, norms = [], [], [], []
    for step in range(args.steps):
        x, y = batch(step, args.batch)
        ref_loss = F.cross_entropy(reference(x), y)
        ref_loss.backward()
        if args.clip:
            ref_norms.append(torch.nn.utils.clip_grad_norm_(reference.parameters(), args.clip))
        ref_opt.step()
        ref_opt.zero_grad()
        loss = F.cross_entropy(model(x[mine]), y[mine])  # the mean over this rank's images
        loss.backward()
        if args.clip:  # each element counted once over the ranks
            norms.append(zerokit.clip_grad_norm_(model, args.clip))
        opt.step()
        opt.zero_grad()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss, group=group)
        ref_losses.append(ref_loss.item())
        losses.append(global_loss.item() / world_size)
    return {
        "reference": ref_losses,
        "hybrid": losses,
        "reference_norms": [n.item() for n in ref_norms],
        "norms": [n.item() for n in norms],
        "max_diff": max_difference(model, reference),
    }


def max_difference(model: nn.Module, reference: nn.Module) -> float:
    """The largest difference between the hybrid model's parameters and the plain one's, over
    every rank: a rank-local parameter against its slice of the plain one (collective)."""
    local = tp.distributed_params(model)
    plain = dict(reference.named_parameters())
    state = model.state_dict()  # at 'p_g_os' gathered for the call
    worst = torch.zeros(())
    for name, param in model.named_parameters():
        d = local.get(id(param))
        if d is not None:
            want = d.split.local(plain[name].detach(), d.split_rank)
            got = param.detach()
        else:
            want, got = plain[name].detach(), state[name]
        worst = torch.maximum(worst, (got - want).abs().max())
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item()


def train(rank: int, world_size: int, args) -> None:
    result = run(rank, world_size, args)
    if rank == 0:
        print(f"{world_size} ranks, level {args.level!r}: data-parallel convolutions, FC split")
        print(f"{'step':>4}{'1 process':>14}{'hybrid':>14}")
        for step, (ref, got) in enumerate(zip(result["reference"], result["hybrid"])):
            print(f"{step:4d}{ref:14.6f}{got:14.6f}")
        print(f"largest parameter difference from 1 process: {result['max_diff']:.2e}")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help keeps the docstring's layout and shows every default."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="ranks to start (without torchrun)")
    parser.add_argument("--level", default="os_g", choices=zerokit.LEVELS, help="ZeRO level")
    parser.add_argument("--steps", type=int, default=5, help="training steps")
    parser.add_argument(
        "--batch", type=int, default=12, help="global batch; divisible by the ranks"
    )
    parser.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate")
    parser.add_argument("--clip", type=float, default=0.3, help="gradient norm clip; 0: none")
    parser.add_argument(
        "--dropout", type=float, default=0.0, help="dropout before the FC layers (0: match)"
    )
    args = parser.parse_args()
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group("gloo")
        world = dist.get_world_size()
        if args.batch % world:
            parser.error(f"--batch {args.batch} is not divisible by {world} ranks")
        train(dist.get_rank(), world, args)
        dist.destroy_process_group()
    else:
        if args.batch % args.nproc:
            parser.error(f"--batch {args.batch} is not divisible by --nproc {args.nproc}")
        spawn_local(train, args.nproc, args)


if __name__ == "__main__":
    main()
