"""One rank of benchmarks/two_hosts.py, started by torchrun inside a host's network namespace.

Four modes, each checked on every rank against one process training on the whole global batch:

* ``traffic``: per level, full sharding over every rank (``group=WORLD``), then hybrid sharding
  (shard inside a host, replicate across hosts); counts the bytes that crossed this host's
  veth during the timed steps, minus an idle window of the same length.
* ``accumulation``: hybrid sharding, K micro-batches a step, reduced each in full, with the
  cross-host reduction deferred to the last (``defer_replica_sync()``), or under ``no_sync()``;
  the bytes across the veth per step, the step time and the gradient bytes held.
* ``optimizer``: per level, hybrid sharding without and with the optimizer state sharded over
  the replicas (``ShardingConfig.shard_optimizer_over_replicas``), the two alternating step by
  step: the optimizer-state bytes each rank holds, the bytes across the veth per step and the
  step time of each.
* ``train``: hybrid sharding with a checkpoint (model, optimizer, step, RNG) every ``--every``
  steps; resumes from the newest complete one; on torchrun's first attempt the ranks of host
  ``--kill-host`` SIGKILL themselves at step ``--kill-step``.

The global batch of a step is drawn from torch's default generator on every rank, so a resume
that did not restore the RNG state would train on other data and fail the check.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import signal
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import zerokit
import zerokit.memory
from zerokit.checkpoint import RNGState
from zerokit.models.gpt import GPT, GPTConfig, lm_loss

ATOL = 2e-5
DATA_SEED = 1234
# 0.85M parameters (3.4 MB in fp32): parameter traffic dwarfs control messages, and a step
# takes milliseconds.
CONFIG = GPTConfig(vocab_size=512, block_size=32, n_layer=4, n_head=4, n_embd=128)
BATCH, SEQ = 8, 16  # global batch of 8 sequences of 16 tokens


def make_model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    # eps=1e-6: see tests/models.py (float noise of analytically zero gradients)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-6)


def draw_batch(
    gen: torch.Generator | None = None, rows: int = BATCH
) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, CONFIG.vocab_size, (rows, SEQ + 1), generator=gen)  # [B, T+1]
    return tokens[:, :-1], tokens[:, 1:]


def reference(steps: int, rows: int = BATCH) -> dict[str, torch.Tensor]:
    """One process, the whole global batch, ``steps`` steps: what every layout must equal."""
    model, opt = make_model_and_optimizer()
    gen = torch.Generator().manual_seed(DATA_SEED)  # the same stream as the default generator
    for _ in range(steps):
        x, y = draw_batch(gen, rows)
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def max_diff(model: torch.nn.Module, ref: dict[str, torch.Tensor]) -> float:
    got = model.state_dict()  # collective at 'p_g_os'
    assert got.keys() == ref.keys()
    return max((got[k] - ref[k]).abs().max().item() for k in ref)


def train_step(model, opt, rank: int, world: int) -> None:
    x, y = draw_batch()  # every rank draws the whole global batch, keeps its slice
    per = BATCH // world
    lm_loss(model(x[rank * per : (rank + 1) * per]), y[rank * per : (rank + 1) * per]).backward()
    opt.step()
    opt.zero_grad()


def host_layout(sharding: int):
    """Hybrid groups (sharding inside a host, replicas across), after checking that torchrun
    numbered each host's ranks consecutively, which Paddle's order needs."""
    world = dist.get_world_size()
    hosts = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(hosts, torch.tensor([int(os.environ["ZK_HOST"])]))
    hosts = [int(h) for h in hosts]
    if any(hosts[r] != hosts[r - r % sharding] for r in range(world)):
        raise RuntimeError(f"a sharding group of {sharding} spans hosts: ranks on hosts {hosts}")
    layout = zerokit.init_hybrid_parallel(world // sharding, 1, sharding_degree=sharding)
    return layout.sharding_group, layout.dp_group, hosts


def veth_bytes() -> int:
    """rx + tx bytes of this namespace's veth: every byte between the two hosts, once."""
    name = os.environ["GLOO_SOCKET_IFNAME"]
    for line in Path("/proc/net/dev").read_text().splitlines():
        if line.strip().startswith(name + ":"):
            fields = line.split(":", 1)[1].split()
            return int(fields[0]) + int(fields[8])
    raise RuntimeError(f"{name} is not in /proc/net/dev: not inside its namespace?")


def crossed(window) -> tuple[int, float]:
    """Bytes across the veth while ``window()`` runs, and its seconds. Rank 0's count: the
    two ends of the veth count the same bytes."""
    dist.barrier()
    before, start = veth_bytes(), time.perf_counter()
    window()
    dist.barrier()
    seconds, count = time.perf_counter() - start, torch.tensor([veth_bytes() - before])
    dist.broadcast(count, src=0)
    return int(count), seconds


def traffic(args, rank: int, world: int) -> dict:
    ref = reference(args.warmup + args.steps)
    sharding = int(os.environ["LOCAL_WORLD_SIZE"])
    hybrid_group, replicas, hosts = host_layout(sharding)
    if args.bug == "swap-groups":  # planted: shard across hosts, replicate inside
        hybrid_group, replicas = replicas, hybrid_group
    if args.bug == "no-replicas":  # planted: the hosts never average with each other
        replicas = None
    results = {
        "hosts": hosts,
        "params": sum(p.numel() for p in make_model_and_optimizer()[0].parameters()),
    }
    for level in args.levels:
        for name, group, dp_group in (("full", None, None), ("hybrid", hybrid_group, replicas)):
            model, opt = make_model_and_optimizer()
            model, opt, _ = zerokit.group_sharded_parallel(
                model, opt, level, group=group, dp_group=dp_group
            )
            torch.manual_seed(DATA_SEED)
            for _ in range(args.warmup):  # first steps allocate and connect
                train_step(model, opt, rank, world)
            moved, seconds = crossed(
                lambda m=model, o=opt: [train_step(m, o, rank, world) for _ in range(args.steps)]
            )
            idle, _ = crossed(lambda s=seconds: time.sleep(s))
            results[f"{level}/{name}"] = {
                "bytes_per_step": (moved - idle) / args.steps,
                "raw_bytes": moved,
                "idle_bytes": idle,
                "step_s": seconds / args.steps,
                "max_diff": max_diff(model, ref),
            }
            del model, opt
    return results


ACCUMULATION_MODES = ("every", "defer", "no_sync")


def accumulation(args, rank: int, world: int) -> dict:
    """Hybrid sharding, ``--accumulation`` K micro-batches a step, three ways: each
    micro-batch reduced in full (``every``), the cross-host reduction deferred to the last
    (``defer``: ``model.defer_replica_sync()``), nothing reduced but the last (``no_sync``).
    A step's global batch is K times the traffic check's, so each micro-batch is its size."""
    k, rows = args.accumulation, BATCH * args.accumulation
    ref = reference(args.warmup + args.steps, rows)
    group, replicas, hosts = host_layout(int(os.environ["LOCAL_WORLD_SIZE"]))
    results = {
        "hosts": hosts,
        "params": sum(p.numel() for p in make_model_and_optimizer()[0].parameters()),
    }
    for level in args.levels:
        for mode in ACCUMULATION_MODES:
            model, opt = make_model_and_optimizer()
            model, opt, _ = zerokit.group_sharded_parallel(
                model, opt, level, group=group, dp_group=replicas
            )
            if args.bug == "early-replicas" and mode == "defer":  # planted: defers nothing
                model.defer_replica_sync = contextlib.nullcontext
            held: list[int] = []
            torch.manual_seed(DATA_SEED)
            step = functools.partial(accumulated_step, model, opt, rank, world, k, mode, held)
            for _ in range(args.warmup):
                step()
            moved, seconds = crossed(lambda s=step: [s() for _ in range(args.steps)])
            idle, _ = crossed(lambda s=seconds: time.sleep(s))
            results[f"{level}/{mode}"] = {
                "bytes_per_step": (moved - idle) / args.steps,
                "step_s": seconds / args.steps,
                "grads_between_micro_batches": held[-1],
                "max_diff": max_diff(model, ref),
            }
            del model, opt
    return results


def accumulated_step(model, opt, rank, world, k, mode, held) -> None:
    """One optimizer step of ``k`` micro-batches of this rank's slice; ``held`` gets the
    gradient bytes held after the first micro-batch (``zerokit.memory.measure``'s)."""
    x, y = draw_batch(rows=BATCH * k)
    per = BATCH * k // world
    xs, ys = x[rank * per : (rank + 1) * per].chunk(k), y[rank * per : (rank + 1) * per].chunk(k)
    scope = {"defer": model.defer_replica_sync, "no_sync": model.no_sync}.get(
        mode, contextlib.nullcontext
    )
    for m in range(k):
        with scope() if m < k - 1 else contextlib.nullcontext():
            (lm_loss(model(xs[m]), ys[m]) / k).backward()
        if m == 0:
            held.append(zerokit.memory.measure(model, opt).grads)
    opt.step()
    opt.zero_grad()


def optimizer_state(args, rank: int, world: int) -> dict:
    """Hybrid sharding without and with ``shard_optimizer_over_replicas``, per level. The two
    runs alternate step by step (warm-up, then one timed step of each in turn), so a busy
    machine slows both alike; each run's veth bytes are counted over its own steps."""
    from zerokit.memory import measure

    ref = ref_with_batches(args)
    group, replicas, _ = host_layout(int(os.environ["LOCAL_WORLD_SIZE"]))
    configs = {
        "off": zerokit.ShardingConfig(),
        "on": zerokit.ShardingConfig(shard_optimizer_over_replicas=True),
    }
    results: dict = {}
    for level in args.levels:
        runs = {}
        for name, config in configs.items():
            model, opt = make_model_and_optimizer()
            runs[name] = zerokit.group_sharded_parallel(
                model, opt, level, group=group, dp_group=replicas, config=config
            )[:2]
        totals = {name: [0, 0.0] for name in runs}  # bytes, seconds
        for step in range(args.warmup + args.steps):
            for name, (model, opt) in runs.items():
                torch.manual_seed(DATA_SEED + step)  # the same batch for both runs
                if step < args.warmup:
                    train_step(model, opt, rank, world)
                    continue
                moved, seconds = crossed(lambda m=model, o=opt: train_step(m, o, rank, world))
                totals[name][0] += moved
                totals[name][1] += seconds
        idle, _ = crossed(lambda s=totals["off"][1] / args.steps: time.sleep(s))
        for name, (model, opt) in runs.items():
            results[f"{level}/{name}"] = {
                "bytes_per_step": totals[name][0] / args.steps - idle,
                "step_s": totals[name][1] / args.steps,
                "optimizer_bytes": measure(model, opt).optimizer,
                "max_diff": max_diff(model, ref),
            }
        del runs
    return results


def ref_with_batches(args) -> dict[str, torch.Tensor]:
    """One process on the batches ``optimizer_state`` draws (seeded per step)."""
    model, opt = make_model_and_optimizer()
    for step in range(args.warmup + args.steps):
        torch.manual_seed(DATA_SEED + step)
        x, y = draw_batch()
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def newest_checkpoint(directory: Path) -> Path | None:
    """The newest complete checkpoint: saves are atomic, so a ``step_N`` directory is one."""
    done = sorted(p for p in directory.glob("step_*") if p.is_dir() and p.name[5:].isdigit())
    return done[-1] if done else None


def train(args, rank: int, world: int) -> dict:
    group, replicas, _ = host_layout(int(os.environ["LOCAL_WORLD_SIZE"]))
    if args.bug == "swap-groups":
        group, replicas = replicas, group
    model, opt = make_model_and_optimizer()
    model, opt, _ = zerokit.group_sharded_parallel(
        model, opt, args.levels[0], group=group, dp_group=replicas
    )
    # Every generator seeded alike on every rank: the RNG state is then one value, stored once,
    # and restorable at another world size (per-rank states load at the saving world size only).
    torch.manual_seed(DATA_SEED)
    random.seed(DATA_SEED)
    np.random.seed(DATA_SEED)
    ckpt_dir = Path(args.ckpt_dir)
    resume = Path(args.resume_from) if args.resume_from else newest_checkpoint(ckpt_dir)
    start = 0
    if resume is not None:
        extra = {"step": 0, "rng": RNGState()}
        if args.bug == "no-rng":  # planted: the RNG state is not restored
            extra = {"step": 0}
        zerokit.checkpoint.load(resume, model, opt, extra=extra)
        start = extra["step"]
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    for step in range(start, args.steps):
        if attempt == 0 and step == args.kill_step and os.environ["ZK_HOST"] == args.kill_host:
            os.kill(os.getpid(), signal.SIGKILL)  # this host dies: no cleanup, no goodbye
        train_step(model, opt, rank, world)
        if (step + 1) % args.every == 0 and step + 1 < args.steps:
            extra = {"step": step + 1, "rng": RNGState()}
            zerokit.checkpoint.save(ckpt_dir / f"step_{step + 1:05d}", model, opt, extra=extra)
    return {
        "attempt": attempt,
        "resumed_from": str(resume) if resume else None,
        "start_step": start,
        "max_diff": max_diff(model, reference(args.steps)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("traffic", "train", "accumulation", "optimizer"))
    p.add_argument("--out", required=True, help="directory for each rank's result JSON")
    p.add_argument("--levels", default="os_g,p_g_os", help="comma-separated zerokit levels")
    p.add_argument("--steps", type=int, default=4, help="timed steps, or steps in all (train)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before (traffic)")
    p.add_argument("--ckpt-dir", default="", help="checkpoints (train)")
    p.add_argument("--every", type=int, default=3, help="steps between checkpoints (train)")
    p.add_argument("--resume-from", default="", help="this checkpoint, not the newest (train)")
    p.add_argument("--kill-step", type=int, default=-1, help="first attempt dies here (train)")
    p.add_argument("--kill-host", default="1", help="the host whose ranks die (train)")
    p.add_argument(
        "--accumulation", type=int, default=4, help="micro-batches a step (accumulation)"
    )
    p.add_argument(
        "--bug", default="", help="plant a bug: swap-groups | no-replicas | no-rng | early-replicas"
    )
    args = p.parse_args()
    args.levels = args.levels.split(",")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        modes = {"traffic": traffic, "train": train, "accumulation": accumulation,
                 "optimizer": optimizer_state}  # fmt: skip
        result = modes[args.mode](args, rank, world)
        result.update(rank=rank, world=world, host=int(os.environ["ZK_HOST"]))
        Path(args.out, f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
