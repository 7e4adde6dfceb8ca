"""The Lightning runs tests/test_lightning.py compares: one LightningModule, two scenarios.

Run as a user runs Lightning (``python tests/lightning_run.py OUT --devices 2``: Lightning's
launcher starts the other ranks by running this script again), it trains with
``ZeroKitStrategy`` at every level, by its registered name, and rank 0 writes every result to
``OUT/results.pt``. The test imports ``run_*`` to train the same scenarios in one process
with Lightning's default strategy.

Scenarios, each over a global batch of ``GLOBAL_BATCH`` split by ``DistributedSampler``:
* ``clip_accum``: ``gradient_clip_val`` (binding) and ``accumulate_grad_batches=2``, 4 steps;
  records, at each backward, whether it would reduce (``require_backward_grad_sync``).
* ``resume``: 2 epochs of 2 steps with ``ModelCheckpoint`` each epoch; then a fresh Trainer
  and module resume from the epoch-0 checkpoint and train epoch 1.
* ``manual``: manual optimization (``manual_backward``, a binding ``clip_gradients``, the
  optimizer's and scheduler's steps called by the module), 2 epochs of 4 steps.
* ``--own-state-dict`` (alone): the LightningModule's own ``state_dict()`` in
  ``on_train_end`` and after ``fit``, 2 steps.
"""

from __future__ import annotations

import argparse
import os
import sys

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

GLOBAL_BATCH = 6  # divisible by 1, 2 and 3 ranks
CLIP = 0.05  # well under the gradient norm: the clip binds
LR = 0.04  # not Net's default: a checkpoint's hyperparameters are seen to be read


class Net(pl.LightningModule):
    def __init__(self, lr: float = 0.05):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)
        )
        self.gain = nn.Parameter(torch.ones(2))  # the LightningModule's own (root unit)
        self.syncs: list = []
        self.compute_dtypes: list = []

    def forward(self, x):
        return self.net(x) * self.gain

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.compute_dtypes.append(self.net[0].weight.dtype)
        return nn.functional.mse_loss(self(x).float(), y)

    def on_before_backward(self, loss):
        self.syncs.append(getattr(self.trainer.strategy.model, "require_backward_grad_sync", None))

    def train_dataloader(self):
        # the trainer's own sampler shuffles; this one splits each global batch in rank order
        world, rank = self.trainer.world_size, self.trainer.global_rank
        sampler = DistributedSampler(self.data, num_replicas=world, rank=rank, shuffle=False)
        return DataLoader(self.data, batch_size=GLOBAL_BATCH // world, sampler=sampler)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Manual(Net):
    """Manual optimization: the step's backward, clip and step called by the module."""

    def __init__(self, lr: float = 0.05):
        super().__init__(lr)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        opt.zero_grad()
        self.manual_backward(nn.functional.mse_loss(self(x), y))
        self.clip_gradients(opt, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
        opt.step()
        self.lr_schedulers().step()


class TwoOptimizers(Manual):
    """Muon for the hidden matrices beside AdamW for the rest (Lightning: manual optimization
    with the optimizers configure_optimizers returned)."""

    def configure_optimizers(self):
        matrices = [self.net[0].weight, self.net[2].weight]
        rest = [p for p in self.parameters() if all(p is not m for m in matrices)]
        return [
            torch.optim.Muon(matrices, lr=0.02, momentum=0.9),
            torch.optim.AdamW(rest, lr=self.hparams.lr, weight_decay=0.1),
        ]

    def training_step(self, batch, batch_idx):
        opts = self.optimizers()
        x, y = batch
        self.manual_backward(nn.functional.mse_loss(self(x), y))
        for opt in opts:
            opt.step()
            opt.zero_grad()


def data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 2, generator=g))


def fresh(batches: int) -> Net:
    """The module, seeded, training on ``batches`` global batches per epoch."""
    torch.manual_seed(0)
    model = Net(lr=LR)
    model.data = data(batches * GLOBAL_BATCH)
    return model


def trainer(strategy, devices: int, **kw) -> pl.Trainer:
    kw.setdefault("enable_checkpointing", False)
    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,  # Net.train_dataloader splits the global batches
        **kw,
    )


def params(t: pl.Trainer, model: Net) -> dict:
    full = getattr(t.strategy, "full_state_dict", model.state_dict)()  # collective at p_g_os
    return {k: v.detach().clone() for k, v in full.items()}


def run_clip_accum(strategy, devices: int, clip: float | None = CLIP) -> tuple[dict, list]:
    model = fresh(4)
    t = trainer(strategy, devices, max_epochs=2, gradient_clip_val=clip, accumulate_grad_batches=2)
    t.fit(model)
    return params(t, model), model.syncs


def run_resume(strategy, devices: int, ckpt_dir: str, resume_strategy=None) -> tuple[dict, dict]:
    """(params after 2 unbroken epochs, params resumed from the epoch-0 checkpoint)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    model = fresh(2)
    keep = ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, every_n_epochs=1)
    t = trainer(strategy, devices, max_epochs=2, callbacks=[keep], enable_checkpointing=True)
    t.fit(model)
    unbroken = params(t, model)
    torch.manual_seed(123)  # resuming must not depend on the fresh module's weights
    model = Net(lr=LR)
    model.data = data(2 * GLOBAL_BATCH)
    t = trainer(resume_strategy or strategy, devices, max_epochs=2)
    t.fit(model, ckpt_path=os.path.join(ckpt_dir, "epoch=0-step=2.ckpt"))
    return unbroken, params(t, model)


def run_manual(strategy, devices: int) -> dict:
    torch.manual_seed(0)
    model = Manual(lr=LR)
    model.data = data(4 * GLOBAL_BATCH)
    t = trainer(strategy, devices, max_epochs=2)
    t.fit(model)
    return params(t, model)


def run_two_optimizers(strategy, devices: int, ckpt_dir: str) -> tuple[dict, dict]:
    """2 epochs of 2 steps with Muon and AdamW, a checkpoint each epoch; then a fresh Trainer
    resumes from epoch 0's. (params unbroken, params resumed)."""
    from test_optimizers import newton_schulz_in_fp32  # 2e-5 holds (see there)

    results = []
    with newton_schulz_in_fp32():
        for resume in (None, os.path.join(ckpt_dir, "epoch=0-step=4.ckpt")):
            results.append(_fit_two(strategy, devices, ckpt_dir, resume))
    return results[0], results[1]


def _fit_two(strategy, devices: int, ckpt_dir: str, resume: str | None) -> dict:
    from lightning.pytorch.callbacks import ModelCheckpoint

    torch.manual_seed(0 if resume is None else 123)
    model = TwoOptimizers(lr=LR)
    model.data = data(2 * GLOBAL_BATCH)
    keep = ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, every_n_epochs=1)
    t = trainer(strategy, devices, max_epochs=2, callbacks=[keep], enable_checkpointing=True)
    t.fit(model, ckpt_path=resume)
    return params(t, model)


def run_short(strategy, devices: int, precision: str) -> tuple[dict, list]:
    """2 steps at ``precision``; (params, the dtypes the weights had in training_step)."""
    model = fresh(2)
    t = trainer(strategy, devices, max_steps=2, precision=precision)
    t.fit(model)
    return params(t, model), sorted({str(d) for d in model.compute_dtypes})


class Saving(Net):
    """Keeps its own ``state_dict()`` at the end of training, as a user's hook does."""

    def on_train_end(self):
        self.at_end = {k: v.detach().clone() for k, v in self.state_dict().items()}


def run_own_state_dict(strategy, devices: int) -> tuple[dict, dict]:
    """2 steps; the LightningModule's own ``state_dict()`` in ``on_train_end`` and after
    ``fit`` (collective at 'p_g_os': every rank calls it)."""
    torch.manual_seed(0)
    model = Saving(lr=LR)
    model.data = data(2 * GLOBAL_BATCH)
    trainer(strategy, devices, max_steps=2).fit(model)
    return model.at_end, {k: v.detach().clone() for k, v in model.state_dict().items()}


def main() -> None:
    import zerokit.integrations.lightning  # noqa: F401  (registers the strategy names)

    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--levels", default="os,os_g,p_g_os")
    parser.add_argument("--own-state-dict", action="store_true", help="only run_own_state_dict")
    args = parser.parse_args()
    results: dict = {}
    if args.own_state_dict:
        for level in args.levels.split(","):
            results[level] = run_own_state_dict(f"zerokit_{level}", args.devices)
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:
            torch.save(results, os.path.join(args.out, "results.pt"))
        return
    levels = args.levels.split(",")
    for level in levels:
        name = f"zerokit_{level}"
        results[("clip_accum", level)] = run_clip_accum(name, args.devices)
        ckpts = os.path.join(args.out, f"ckpt-{level}")
        results[("resume", level)] = run_resume(name, args.devices, ckpts)
    # a checkpoint of one level resumed at another
    other = f"zerokit_{levels[-1]}"
    ckpts = os.path.join(args.out, "ckpt-cross")
    results["cross"] = run_resume(
        f"zerokit_{levels[0]}", args.devices, ckpts, resume_strategy=other
    )[1]
    results["bf16"] = run_short(other, args.devices, "bf16-mixed")
    results["manual"] = run_manual(other, args.devices)
    results["two_optimizers"] = run_two_optimizers(
        other, args.devices, os.path.join(args.out, "ckpt-two")
    )
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        torch.save(results, os.path.join(args.out, "results.pt"))
    print("lightning_run done", file=sys.stderr)


if __name__ == "__main__":
    main()
