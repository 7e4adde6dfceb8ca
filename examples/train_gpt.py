"""Train the built-in small GPT under each zerokit level and print the losses side by side,
next to one process training on the whole global batch: the columns must agree.

    python examples/train_gpt.py                          # starts 2 local gloo ranks itself
    torchrun --nproc-per-node 2 examples/train_gpt.py     # or under torchrun
"""

from __future__ import annotations

import argparse
import copy
import os

import torch
import torch.distributed as dist

import zerokit
from zerokit.models.gpt import GPT, GPTConfig, lm_loss, synthetic_batch
from zerokit.tools.launch import spawn_local

LEVELS = zerokit.LEVELS  # "os", "os_g", "p_g_os"


def train(rank: int, world_size: int, args) -> None:
    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64)
    torch.manual_seed(0)
    base = GPT(cfg)
    per_rank = args.batch // world_size
    batches = [
        synthetic_batch(cfg.vocab_size, args.batch, 32, seed=step) for step in range(args.steps)
    ]
    columns = {}

    reference = copy.deepcopy(base)  # one process, the whole global batch
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    columns["1 process"] = []
    for x, y in batches:
        loss = lm_loss(reference(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        columns["1 process"].append(loss.item())

    for level in LEVELS:
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt, _ = zerokit.group_sharded_parallel(model, opt, level)
        columns[level] = []
        for x, y in batches:
            mine = slice(rank * per_rank, (rank + 1) * per_rank)  # this rank's slice
            loss = lm_loss(model(x[mine]), y[mine])
            loss.backward()
            opt.step()
            opt.zero_grad()
            global_loss = loss.detach().clone()
            dist.all_reduce(global_loss)
            columns[level].append(global_loss.item() / world_size)

    if rank == 0:
        n_params = sum(p.numel() for p in base.parameters())
        print(f"GPT {n_params / 1e3:.0f}K params, {world_size} ranks, global batch {args.batch}")
        print("step" + "".join(f"{name:>12}" for name in columns))
        for step in range(args.steps):
            print(f"{step:4d}" + "".join(f"{col[step]:>12.6f}" for col in columns.values()))
        worst = max(abs(col[-1] - columns["1 process"][-1]) for col in columns.values())
        print(f"largest final-loss difference from 1 process: {worst:.2e}")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help keeps the docstring's layout and shows every default."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="ranks to start (without torchrun)")
    parser.add_argument("--steps", type=int, default=20, help="training steps per level")
    parser.add_argument("--batch", type=int, default=8, help="global batch; divisible by ranks")
    args = parser.parse_args()
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group("gloo")
        train(dist.get_rank(), dist.get_world_size(), args)
        dist.destroy_process_group()
    else:
        if args.nproc < 1 or args.batch % args.nproc:
            parser.error("--nproc must be >= 1 and divide --batch")
        spawn_local(train, args.nproc, args)


if __name__ == "__main__":
    main()
