"""Optimizers that are not elementwise, sharded: Muon's step time per rank, and the bytes of
low-bit optimizer state, on gloo CPU ranks, side by side in one run.

(a) ``--part speed``: Muon for the matrices beside AdamW for the norms, on a stack of MLP
blocks whose Muon step dominates (``--blocks`` x (512 x 2048, 2048 x 512)). Each matrix is
owned whole by one rank (the owner layout), so N ranks divide the Newton-Schulz work; DDP +
Muon (gradients all-reduced by hand, every rank stepping every matrix) repeats it. Timed:
``opt.step()`` of every optimizer, nothing else, after ``--warmup`` steps; per rank both the
wall time and the CPU time of the process (on a machine with fewer cores than ranks the wall
time of N ranks includes waiting for a core; the CPU time is the work each rank does). Each
figure is the median over the timed steps of the slowest rank.

(b) ``--part memory``: AdamW fp32, torchao's AdamW8bit and AdamW4bit at ``'p_g_os'`` over
4 ranks on benchmarks/capacity.py's GPT (d_model 512, vocabulary 8192, ``--layers`` blocks):
each rank's ``zerokit.memory.measure`` after the second step; optimizer state per parameter
(summed over ranks / parameters), model state per parameter per rank (the most any rank
holds), and the model-state bound of capacity: how many parameters' model states fit
``--cap-mib`` per rank, relative to fp32 AdamW. torchao compiles its step on first use
(tens of seconds on CPU): the warm-up steps pay for it, outside any timing.

    python benchmarks/optimizers.py                       # both parts
    python benchmarks/optimizers.py --part speed --worlds 1,2,4 --blocks 8
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

import zerokit
from zerokit.memory import measure
from zerokit.models.gpt import GPT, GPTConfig, lm_loss, synthetic_batch
from zerokit.tools.launch import spawn_local

MIB = 2**20


class Blocks(nn.Module):
    """``n`` pre-norm MLP blocks of width ``d`` (hidden ``4 d``): Muon's matrices, few else."""

    def __init__(self, n: int, d: int = 512):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(d), nn.Linear(d, 4 * d, bias=False), nn.GELU(),
                nn.Linear(4 * d, d, bias=False),
            )
            for _ in range(n)
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, d] -> [B, d]
        for block in self.blocks:
            x = x + block(x)
        return x


def muon_and_adamw(model: nn.Module) -> list[torch.optim.Optimizer]:
    matrices = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    return [
        torch.optim.Muon(matrices, lr=0.02, momentum=0.95),
        torch.optim.AdamW(rest, lr=1e-3),
    ]


def _step_times(rank, world, args, runner) -> dict:
    torch.manual_seed(0)
    model = Blocks(args.blocks)
    if runner == "zerokit":
        model, opts, _ = zerokit.group_sharded_parallel(model, muon_and_adamw(model), args.level)
    else:  # DDP by hand: every gradient averaged, every rank steps every matrix
        opts = muon_and_adamw(model)
    gen = torch.Generator().manual_seed(1 + rank)
    wall, cpu = [], []
    for step in range(args.warmup + args.steps):
        x = torch.randn(8, 512, generator=gen)
        model(x).square().mean().backward()
        if runner == "ddp" and world > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        t0, c0 = time.perf_counter(), time.process_time()
        for opt in opts:
            opt.step()
        t1, c1 = time.perf_counter(), time.process_time()
        for opt in opts:
            opt.zero_grad()
        if step >= args.warmup:
            wall.append(t1 - t0)
            cpu.append(c1 - c0)
    return {"wall": statistics.median(wall), "cpu": statistics.median(cpu)}


def speed_worker(rank: int, world: int, args, out: str) -> None:
    logging.getLogger("zerokit").setLevel(logging.WARNING)  # no wrap line per rank
    result = {}
    for runner in ("zerokit", "ddp"):
        if runner == "ddp" and world == 1:
            continue
        if world > 1:
            dist.barrier()
        result[runner] = _step_times(rank, world, args, runner)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def _gathered(out: str, world: int) -> list[dict]:
    ranks = []
    for r in range(world):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            ranks.append(json.load(f))
    return ranks


def speed(args) -> None:
    worlds = [int(w) for w in args.worlds.split(",")]
    n = args.blocks
    print(
        f"(a) Muon step per rank: {n} blocks of (512 x 2048, 2048 x 512) matrices (Muon, "
        f"{2 * n} matrices, {2 * n * 512 * 2048 / 1e6:.1f}M parameters) + LayerNorms (AdamW); "
        f"zerokit level '{args.level}'; opt.step() only, median of {args.steps} steps after "
        f"{args.warmup}, the slowest rank; gloo, 1 thread per rank",
        flush=True,
    )
    print(f"{'runner':<16}{'world':>6}{'wall s':>9}{'cpu s':>9}{'cpu vs world 1':>16}")
    base = None
    for world in worlds:
        with tempfile.TemporaryDirectory() as out:
            spawn_local(speed_worker, world, args, out)
            ranks = _gathered(out, world)
        for runner in ("zerokit", "ddp"):
            if runner not in ranks[0]:
                continue
            wall = max(r[runner]["wall"] for r in ranks)
            cpu = max(r[runner]["cpu"] for r in ranks)
            base = cpu if base is None else base
            label = f"{runner} + Muon" if runner == "ddp" else "zerokit"
            print(f"{label:<16}{world:>6}{wall:>9.3f}{cpu:>9.3f}{cpu / base:>15.2f}x", flush=True)


# -- (b) optimizer state per parameter ---------------------------------------------------------
def _make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3)
    from torchao.optim import AdamW4bit, AdamW8bit

    return {"adamw8bit": AdamW8bit, "adamw4bit": AdamW4bit}[name](params, lr=1e-3)


def memory_worker(rank: int, world: int, args, out: str) -> None:
    logging.getLogger("zerokit").setLevel(logging.WARNING)
    cfg = GPTConfig(vocab_size=8192, block_size=128, n_layer=args.layers, n_head=8, n_embd=512)
    result = {}
    for name in ("adamw", "adamw8bit", "adamw4bit"):
        torch.manual_seed(0)
        model = GPT(cfg)
        psi = sum(p.numel() for p in model.parameters())
        opt = _make_optimizer(name, model.parameters())
        model, opt, _ = zerokit.group_sharded_parallel(model, opt, "p_g_os")
        for step in range(2):  # the first compiles torchao's step and makes the state
            x, y = synthetic_batch(cfg.vocab_size, 4 * world, 32, step)
            mine = slice(rank * 4, (rank + 1) * 4)
            lm_loss(model(x[mine]), y[mine]).backward()
            opt.step()
            if step == 1:
                held = measure(model, opt)
            opt.zero_grad()
        result[name] = {"psi": psi, "params": held.params, "grads": held.grads,
                        "optimizer": held.optimizer}  # fmt: skip
        del model, opt
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def memory(args) -> None:
    with tempfile.TemporaryDirectory() as out:
        spawn_local(memory_worker, args.nproc, args, out)
        ranks = _gathered(out, args.nproc)
    psi = ranks[0]["adamw"]["psi"]
    print(
        f"\n(b) model state at 'p_g_os' on {args.nproc} ranks: GPT d_model 512, vocab 8192, "
        f"{args.layers} blocks ({psi / 1e6:.1f}M parameters), zerokit.memory.measure after "
        f"the second step; capacity: the parameters whose model states fit {args.cap_mib} MiB "
        "per rank (the model-state bound; activations, buffers and the allocator not counted)"
    )
    print(f"{'optimizer':<12}{'state B/param':>14}{'model state B/param/rank':>26}"
          f"{'capacity M params':>19}{'vs fp32':>9}")  # fmt: skip
    base = None
    for name in ("adamw", "adamw8bit", "adamw4bit"):
        state = sum(r[name]["optimizer"] for r in ranks) / psi
        per_rank = max(r[name]["params"] + r[name]["grads"] + r[name]["optimizer"] for r in ranks)
        per_param = per_rank / psi
        capacity = args.cap_mib * MIB / per_param
        base = capacity if base is None else base
        print(f"{name:<12}{state:>14.3f}{per_param:>26.3f}{capacity / 1e6:>19.1f}"
              f"{capacity / base:>8.2f}x", flush=True)  # fmt: skip


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The docstring as written, and every option's default (as the other benchmarks)."""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument(
        "--part", choices=["speed", "memory", "both"], default="both", help="which to measure"
    )
    p.add_argument("--worlds", default="1,2,4", help="(a) world sizes, comma-separated")
    p.add_argument("--blocks", type=int, default=8, help="(a) MLP blocks (2 Muon matrices each)")
    p.add_argument("--level", default="p_g_os", help="(a) zerokit's level")
    p.add_argument("--warmup", type=int, default=2, help="(a) untimed steps")
    p.add_argument("--steps", type=int, default=5, help="(a) timed steps")
    p.add_argument("--nproc", type=int, default=4, help="(b) ranks")
    p.add_argument("--layers", type=int, default=4, help="(b) GPT blocks")
    p.add_argument("--cap-mib", type=int, default=1024, help="(b) memory per rank, MiB")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.part in ("speed", "both"):
        speed(args)
    if args.part in ("memory", "both"):
        memory(args)


if __name__ == "__main__":
    main()
