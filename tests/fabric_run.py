"""The Fabric loops tests/test_fabric.py compares with one process.

Run as a user runs Fabric (``python tests/fabric_run.py OUT --devices 2``: ``fabric.launch()``
starts the other ranks by running this script again), it trains with ``ZeroKitFabricStrategy``
at every level, by its registered name, and rank 0 writes every result to ``OUT/results.pt``.
The test imports ``train_one_process`` for the reference: the same loop in plain PyTorch.

The loop: ``STEPS`` optimizer steps, each of ``MICRO`` micro-batches of ``GLOBAL_BATCH`` rows
(each rank takes its contiguous share); every micro-batch but the last under
``fabric.no_backward_sync``; a binding ``fabric.clip_gradients(max_norm=CLIP)``; AdamW and a
StepLR scheduler. After ``SAVE_AT`` steps ``fabric.save``; then a fresh model, at the next
level, ``fabric.load``s it and trains the remaining steps.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn

GLOBAL_BATCH = 6  # divisible by 1, 2 and 3 ranks
MICRO = 2
STEPS = 4
SAVE_AT = 2
CLIP = 0.05  # well under the gradient norm: the clip binds
LEVELS = ("os", "os_g", "p_g_os")


def fresh(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)
    return model, opt, sched


def two_optimizers(model: nn.Module) -> list[torch.optim.Optimizer]:
    """Adafactor (whole parameters: each owned by one rank) for the matrices, AdamW else."""
    matrices = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    return [torch.optim.Adafactor(matrices, lr=0.05), torch.optim.AdamW(rest, lr=0.05)]


def batch(step: int, micro: int, rank: int = 0, world: int = 1):
    """This rank's rows of micro-batch ``micro`` of step ``step`` (the global batch, at 1 rank)."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    x, y = torch.randn(GLOBAL_BATCH, 4, generator=g), torch.randn(GLOBAL_BATCH, 2, generator=g)
    share = GLOBAL_BATCH // world
    return x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]


def loss_of(model, x, y):
    return nn.functional.mse_loss(model(x), y) / MICRO


def train_one_process(two: bool = False) -> tuple[dict, list]:
    """The reference: plain PyTorch on the global batches; (params, the norm of each step).
    ``two``: ``two_optimizers`` instead of AdamW and its scheduler."""
    model, opt, sched = fresh()
    opts = two_optimizers(model) if two else [opt]
    norms = []
    for step in range(STEPS):
        for micro in range(MICRO):
            loss_of(model, *batch(step, micro)).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
        for o in opts:
            o.step()
            o.zero_grad()
        if not two:
            sched.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def train_steps(fabric, model, opt, sched, steps, record: dict) -> None:
    for step in steps:
        for micro in range(MICRO):
            x, y = batch(step, micro, fabric.global_rank, fabric.world_size)
            with fabric.no_backward_sync(model, enabled=micro < MICRO - 1):
                record["syncs"].append(model.require_backward_grad_sync)
                fabric.backward(loss_of(model, x, y))
        record["norms"].append(fabric.clip_gradients(model, opt, max_norm=CLIP))
        opt.step()
        sched.step()
        opt.zero_grad()


def params(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}  # collective


def run_level(level: str, resume_level: str, devices: int, ckpt: str) -> dict:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=devices, strategy=f"zerokit_{level}")
    fabric.launch()  # the first call starts the other ranks; later ones find them running
    model, opt, sched = fresh()
    model, opt = fabric.setup(model, opt)
    record: dict = {"syncs": [], "norms": []}
    train_steps(fabric, model, opt, sched, range(SAVE_AT), record)
    fabric.save(ckpt, {"model": model, "optimizer": opt, "scheduler": sched, "step": SAVE_AT})
    train_steps(fabric, model, opt, sched, range(SAVE_AT, STEPS), record)
    record["params"] = params(model)

    # a fresh model at another level resumes from the checkpoint
    fabric = Fabric(accelerator="cpu", devices=devices, strategy=f"zerokit_{resume_level}")
    fabric.launch()
    model, opt, sched = fresh(seed=123)  # resuming must not depend on its weights
    model, opt = fabric.setup(model, opt)
    state = {"model": model, "optimizer": opt, "scheduler": sched, "step": None}
    record["remainder"] = fabric.load(ckpt, state)
    record["step"] = state["step"]
    resumed: dict = {"syncs": [], "norms": []}
    train_steps(fabric, model, opt, sched, range(state["step"], STEPS), resumed)
    record["resumed"] = params(model)
    return record


def run_two_optimizers(devices: int) -> dict:
    """``fabric.setup(model, adafactor, adamw)`` at 'p_g_os': the params after every step."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=devices, strategy="zerokit_p_g_os")
    fabric.launch()
    model, _, _ = fresh()
    model, *opts = fabric.setup(model, *two_optimizers(model))
    for step in range(STEPS):
        for micro in range(MICRO):
            x, y = batch(step, micro, fabric.global_rank, fabric.world_size)
            with fabric.no_backward_sync(model, enabled=micro < MICRO - 1):
                fabric.backward(loss_of(model, x, y))
        fabric.clip_gradients(model, opts[0], max_norm=CLIP)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return params(model)


def main() -> None:
    import zerokit.integrations.fabric  # noqa: F401  (registers the strategy names)

    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()
    results = {}
    for i, level in enumerate(LEVELS):
        ckpt = os.path.join(args.out, f"ckpt-{level}")
        results[level] = run_level(level, LEVELS[(i + 1) % len(LEVELS)], args.devices, ckpt)
    results["two_optimizers"] = run_two_optimizers(args.devices)
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        torch.save(results, os.path.join(args.out, "results.pt"))
    print("fabric_run done", file=sys.stderr)


if __name__ == "__main__":
    main()
