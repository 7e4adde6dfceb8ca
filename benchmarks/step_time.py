"""Step time and bytes per rank: torch DDP, ZeroRedundancyOptimizer and zerokit's levels, side
by side in one run on gloo CPU ranks, alternating so every runner sees the same machine state.

    python benchmarks/step_time.py                       # 27M-parameter GPT, 2 ranks, AdamW
    MALLOC_MMAP_THRESHOLD_=131072 python benchmarks/step_time.py   # freed memory back to the OS
    python benchmarks/step_time.py --mixed-precision bf16   # zerokit and FSDP2 policies,
                                                            # DDP/ZeRO-1/local under autocast
    python benchmarks/step_time.py --model mlp --breakdown  # 8 MLP blocks; where time goes
    python benchmarks/step_time.py --model mlp --repeat 5   # 5 runs: ratios' spread over runs

Run it in a network namespace of its own (``unshare -n sh -c 'ip link set lo up; python ...'``)
for ``sent/step`` to count only its own ranks' bytes: loopback is shared by every process of
the host.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import functools
import json
import os
import resource
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

import zerokit
from zerokit.memory import measure
from zerokit.models.gpt import GPT, GPTConfig, lm_loss, synthetic_batch
from zerokit.tools.launch import spawn_local

try:  # run as a script (benchmarks/ on the path) or as benchmarks.step_time
    from breakdown import PHASES, Breakdown
except ImportError:
    from benchmarks.breakdown import PHASES, Breakdown

# "local" trains each rank alone with no communication: the floor no data-parallel runner can beat.
# "<level>_sib": that zerokit level with step_in_backward=True (each unit stepped as soon as its
# gradients are reduced; no global-norm clipping): the gradients never exist all at once.
# "<level>_lean": step_in_backward plus sync_comm=True (each reduction finished before backward
# goes on): the least memory a level holds in backward, paid for with no communication overlap.
# "os_whole": level 'os' with whole_grads=True (gradients all-reduced, .grad whole on every rank:
# 3P(N-1)/N a step) where 'os' reduce-scatters by default (DDP's 2P(N-1)/N).
RUNNERS = ("ddp", "zero_redundancy", "fsdp2", "os", "os_g", "p_g_os", "local")
STEP_IN_BACKWARD = ("os_g_sib", "p_g_os_sib", "os_g_lean", "p_g_os_lean")


def build(
    runner: str,
    base: torch.nn.Module,
    lr: float,
    bucket_elems: int = 2**23,
    low=None,
    *,
    copy_model: bool = True,
):
    """``runner``'s model and optimizer from ``base`` (a copy of it unless ``copy_model`` is
    False: then ``base`` itself is converted, so no second copy of the model ever exists)."""
    model = copy.deepcopy(base) if copy_model else base
    if runner == "local":
        return model, torch.optim.AdamW(model.parameters(), lr=lr)
    if runner == "ddp":
        model = DistributedDataParallel(model, gradient_as_bucket_view=True)
        return model, torch.optim.AdamW(model.parameters(), lr=lr)
    if runner == "fsdp2":  # fully_shard per block plus the root, as the issue asks
        policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        return model, torch.optim.AdamW(model.parameters(), lr=lr)
    if runner == "zero_redundancy":
        model = DistributedDataParallel(model, gradient_as_bucket_view=True)
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=lr)
        return model, opt
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    policy = zerokit.MixedPrecision(param_dtype=low)
    model, opt, _ = zerokit.group_sharded_parallel(
        model,
        opt,
        runner.removesuffix("_sib").removesuffix("_lean").removesuffix("_whole"),
        buffer_max_size=bucket_elems,
        mixed_precision=policy,
        step_in_backward=runner.endswith(("_sib", "_lean")),
        sync_comm=runner.endswith("_lean"),
        config=zerokit.ShardingConfig(whole_grads=runner.endswith("_whole")),
    )
    return model, opt


def loopback_tx_bytes() -> int:
    """Bytes sent over the loopback interface so far: what gloo's TCP transport really sent."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, fields = line.partition(":")
            if name.strip() == "lo":
                return int(fields.split()[8])
    return 0


AUTOCAST = ("ddp", "zero_redundancy", "local")  # no policy of their own: torch.autocast


class MLP(torch.nn.Module):
    """``--model mlp``: residual blocks of Linear(w, 4w), GELU, Linear(4w, w) on rows of width
    w, a mean-squared-error loss (``blocks``: what FSDP2 shards one by one)."""

    def __init__(self, layers: int, width: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.Linear(width, 4 * width),
                torch.nn.GELU(),
                torch.nn.Linear(4 * width, width),
            )
            for _ in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def mlp_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, y)


def train_step(model, opt, x, y, autocast=None, loss_fn=lm_loss, timer=None) -> float:
    phase = timer.timing if timer is not None else lambda _: contextlib.nullcontext()
    with phase("forward"), autocast or contextlib.nullcontext():
        logits = model(x)
    loss = loss_fn(logits.float(), y)
    with phase("backward"):
        loss.backward()
    with phase("step"):
        opt.step()
    with phase("zero_grad"):
        opt.zero_grad(set_to_none=True)
    return loss.item()


def worker(rank: int, world_size: int, args) -> None:
    cfg = GPTConfig(
        vocab_size=4096,
        block_size=args.seq,
        n_layer=args.layers,
        n_head=8,
        n_embd=args.width,
    )
    torch.manual_seed(0)
    base = GPT(cfg) if args.model == "gpt" else MLP(args.layers, args.width)
    loss_fn = lm_loss if args.model == "gpt" else mlp_loss
    n_params = sum(p.numel() for p in base.parameters())
    runners = args.runners.split(",")
    low = {"bf16": torch.bfloat16, None: None}[args.mixed_precision]
    built = {r: build(r, base, 1e-4, args.bucket_elems, low) for r in runners}
    autocast = {
        r: torch.autocast("cpu", dtype=low) if low is not None and r in AUTOCAST else None
        for r in runners
    }
    if args.model == "gpt":
        x, y = synthetic_batch(cfg.vocab_size, args.batch, args.seq, seed=rank)
    else:
        gen = torch.Generator().manual_seed(rank)
        x, y = torch.randn(2, args.batch * args.seq, args.width, generator=gen)
    step = functools.partial(train_step, loss_fn=loss_fn)
    memory = {}
    for r, (
        model,
        opt,
    ) in built.items():  # warm-up; measure held bytes after a step + backward
        step(model, opt, x, y, autocast[r])
        with autocast[r] or contextlib.nullcontext():
            logits = model(x)
        loss_fn(logits.float(), y).backward()
        m = measure(model, opt)
        memory[r] = {"params": m.params, "grads": m.grads, "optimizer": m.optimizer}
        opt.zero_grad(set_to_none=True)
    times = {r: [] for r in runners}
    cpu = {r: [] for r in runners}  # CPU seconds of this rank's process (all its threads)
    faults = {r: [] for r in runners}  # minor page faults: fresh memory touched the first time
    sent = dict.fromkeys(runners, 0)  # loopback bytes sent by all ranks
    for _ in range(args.rounds):
        for r, (model, opt) in built.items():
            dist.barrier()
            before = loopback_tx_bytes()
            for _ in range(args.steps):
                dist.barrier()
                start, start_cpu = time.perf_counter(), time.process_time()
                start_faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                step(model, opt, x, y, autocast[r])
                times[r].append(time.perf_counter() - start)
                cpu[r].append(time.process_time() - start_cpu)
                faults[r].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start_faults)
            dist.barrier()
            sent[r] += loopback_tx_bytes() - before
    # the slowest rank decides a step: take each step's max over ranks
    stacked = torch.tensor([times[r] for r in runners], dtype=torch.float64)
    dist.all_reduce(stacked, op=dist.ReduceOp.MAX)
    # CPU work: summed over ranks (on cores the ranks share, the work is what they share)
    cpu_work = torch.tensor([cpu[r] for r in runners], dtype=torch.float64)
    dist.all_reduce(cpu_work)
    page_faults = torch.tensor([faults[r] for r in runners], dtype=torch.float64)
    dist.all_reduce(page_faults)
    phases = breakdown_rounds(built, x, y, step, autocast, args) if args.breakdown else None
    if rank != 0:
        return
    medians = {r: statistics.median(stacked[i].tolist()) for i, r in enumerate(runners)}
    cpu_medians = {
        r: statistics.median(cpu_work[i].tolist()) / world_size for i, r in enumerate(runners)
    }
    fault_medians = {
        r: statistics.median(page_faults[i].tolist()) / world_size for i, r in enumerate(runners)
    }
    if args.json:  # --repeat reads each run's medians from here
        with open(args.json, "w") as f:
            json.dump({"step": medians, "cpu": cpu_medians}, f)
    base_time = medians.get("ddp", next(iter(medians.values())))
    base_cpu = cpu_medians.get("ddp", next(iter(cpu_medians.values())))
    fsdp2 = medians.get("fsdp2")
    mib = 2**20
    steps = args.rounds * args.steps
    param_bytes = n_params * 4
    print(
        f"{args.model.upper()} {n_params / 1e6:.1f}M params, {world_size} gloo ranks, AdamW "
        f"{args.mixed_precision or 'fp32'}, batch "
        f"{args.batch}x{args.seq} per rank, zerokit buckets of {args.bucket_elems} elements"
    )
    print(
        f"{'runner':<16}{'step s':>9}{'vs ddp':>8}{'vs fsdp2':>9}{'params MiB':>12}{'grads MiB':>11}"
        f"{'optim MiB':>11}{'total MiB':>11}{'sent/step':>11}{'cpu s':>8}{'vs ddp':>8}{'faults':>8}"
    )
    for r in runners:
        m = memory[r]
        total = m["params"] + m["grads"] + m["optimizer"]
        per_rank_step = sent[r] / world_size / steps  # barriers included: negligible
        print(
            f"{r:<16}{medians[r]:>9.3f}{medians[r] / base_time:>7.2f}x"
            f"{'' if fsdp2 is None else f'{medians[r] / fsdp2:.2f}x':>9}"
            f"{m['params'] / mib:>12.1f}{m['grads'] / mib:>11.1f}{m['optimizer'] / mib:>11.1f}"
            f"{total / mib:>11.1f}{per_rank_step / param_bytes:>10.2f}P"
            f"{cpu_medians[r]:>8.3f}{cpu_medians[r] / base_cpu:>7.2f}x{fault_medians[r]:>8.0f}"
        )
    print(
        "sent/step: bytes one rank sent per step over loopback TCP (gloo's transport), read from\n"
        "/proc/net/dev around each runner's steps, in units of P = the model's fp32 bytes.\n"
        "cpu s: CPU seconds per step of one rank's process, every thread (gloo's too), the\n"
        "median over steps of the ranks' mean: the work the shared cores had to do.\n"
        "faults: minor page faults per step of one rank (the same median): memory freed to the\n"
        "OS and touched again (4 KiB each; glibc returns large freed blocks to the OS)."
    )
    if phases is not None:
        print_breakdown(phases)


def breakdown_rounds(built, x, y, step, autocast, args) -> dict[str, dict[str, float]]:
    """Each runner's step time per phase (ms per step, this rank's, exclusive: they add up to
    the step), from rounds of their own after the timed ones (the timers cost ~1 us a call)."""
    timer = Breakdown()
    phases = {r: collections.Counter() for r in built}
    try:
        for _ in range(args.rounds):
            for r, (model, opt) in built.items():
                dist.barrier()
                timer.reset()
                for _ in range(args.steps):
                    dist.barrier()
                    step(model, opt, x, y, autocast[r], timer=timer)
                    timer.steps += 1
                phases[r].update(timer.per_step_ms())
    finally:
        timer.close()
    return {r: {k: v / args.rounds for k, v in c.items()} for r, c in phases.items()}


def print_breakdown(phases: dict[str, dict[str, float]]) -> None:
    names = list(PHASES) + sorted({k for c in phases.values() for k in c} - set(PHASES))
    labels = {n: f"{n} (rest)" if n in PHASES else n for n in names}
    width = max(len(label) for label in labels.values()) + 2
    print("\nms per step on rank 0, exclusive (a phase: what no timer inside it covers)")
    print(f"{'':<{width}}" + "".join(f"{r:>12}" for r in phases))
    for name in names:
        row = "".join(f"{phases[r].get(name, 0.0):>12.1f}" for r in phases)
        print(f"{labels[name]:<{width}}{row}")
    print(f"{'total':<{width}}" + "".join(f"{sum(phases[r].values()):>12.1f}" for r in phases))


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help keeps the docstring's layout and shows every default."""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="ranks to start")
    p.add_argument("--runners", default=",".join(RUNNERS), help="runners to time, comma-separated")
    p.add_argument("--layers", type=int, default=8, help="GPT blocks")
    p.add_argument("--width", type=int, default=512, help="GPT embedding width")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--bucket-elems", type=int, default=2**21, help="zerokit buffer_max_size")
    p.add_argument("--rounds", type=int, default=3, help="rounds; each runs every runner once")
    p.add_argument(
        "--mixed-precision",
        choices=["bf16"],
        help="compute in bf16; None: fp32 throughout",
    )
    p.add_argument("--steps", type=int, default=3, help="timed steps per runner per round")
    p.add_argument("--model", choices=["gpt", "mlp"], default="gpt", help="what to train")
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="then time each phase of the step, per runner",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs, each in fresh processes; then each runner's ratio to ddp (and fsdp2) over "
        "the runs: median [min, max]",
    )
    args = p.parse_args()
    args.json = None
    if args.repeat == 1:
        spawn_local(worker, args.nproc, args)
        return
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        args.json = os.path.join(tmp, "medians.json")
        for run in range(args.repeat):
            print(f"\n-- run {run + 1} of {args.repeat}")
            spawn_local(worker, args.nproc, args)
            with open(args.json) as f:
                runs.append(json.load(f))
    print_over_runs(runs)


def print_over_runs(runs: list[dict[str, dict[str, float]]]) -> None:
    """Each runner's ratio to ddp and fsdp2, taken within each run (the runners of one run
    alternate, so they saw the same machine), then summarized over the runs."""
    print(f"\nover {len(runs)} runs: each run's ratio of medians, median [min, max] over runs")
    columns = [("step", "ddp"), ("step", "fsdp2"), ("cpu", "ddp")]
    names = {"step": "step", "cpu": "cpu s"}
    print(f"{'runner':<16}" + "".join(f"{names[k] + ' vs ' + b:>22}" for k, b in columns))
    for r in runs[0]["step"]:
        cells = []
        for kind, base in columns:
            if base not in runs[0][kind]:
                cells.append("")
                continue
            ratios = sorted(run[kind][r] / run[kind][base] for run in runs)
            mid = statistics.median(ratios)
            cells.append(f"{mid:.2f}x [{ratios[0]:.2f}, {ratios[-1]:.2f}]")
        print(f"{r:<16}" + "".join(f"{c:>22}" for c in cells))


if __name__ == "__main__":
    main()
