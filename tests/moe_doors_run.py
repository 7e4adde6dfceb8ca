"""A tiny Mixtral with its experts split across ranks (``zerokit.moe``), trained through the
doors users come in by, for tests/test_moe_doors.py: Hugging Face's ``Trainer``
(``ZeroTrainer``), Lightning's ``Trainer`` (``ZeroKitStrategy``) and Fabric. Each runs on
forked ranks (``run_distributed``, the process group already up, so Lightning and accelerate
launch nothing); each reference is the same door on one process with the whole model.

The user's way in, at every door: split the experts with ``apply_expert_parallel(model,
init_expert_groups(ep))`` once the process group exists, before the optimizer is built.
"""

from __future__ import annotations

import os

import hf_trainer_run as R
import torch
from moe_models import VOCAB, batches, tiny_moe

from zerokit.moe import apply_expert_parallel, init_expert_groups

SEQ = 16
CLIP = 0.3  # under the first steps' gradient norms: the clip binds


def _rank_env(rank: int, world: int) -> None:
    """What a launcher sets: accelerate and Lightning read the rank from it."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), NODE_RANK="0",
        LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500",
    )  # fmt: skip


def dense_apart(model, rank: int):
    """Every rank but 0 given other dense weights (its experts kept): an evaluation setup must
    start every rank from rank 0's dense weights, and each from its own experts."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if rank and ".experts." not in name:
                p.add_(0.5)
    return model


def split(model, ep: int | None):
    """The user's step: the experts split over ``ep`` ranks (None: the whole model)."""
    if ep:
        apply_expert_parallel(model, init_expert_groups(ep))
    return model


# ---- Hugging Face Trainer ----


def tokens(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def hf_train(world: int, opts: dict, out: str) -> None:
    """``hf_trainer_run``'s Trainer settings (accumulation 2, clipping, warmup, eval loop) on
    the tiny Mixtral; rank 0 writes ``out/logs.json`` and ``save_model``'s ``out/model``."""
    from accelerate.state import AcceleratorState
    from transformers import Trainer

    from zerokit.integrations.hf_trainer import ZeroTrainer

    AcceleratorState._reset_state(reset_partial_state=True)  # forked: the parent's singletons
    args = R.training_arguments(opts, world, out)  # the process group is up from here
    model = split(tiny_moe("mixtral", aux=opts.get("aux", False)), opts.get("ep"))
    cls = ZeroTrainer if opts.get("level") else Trainer
    trainer = cls(model=model, args=args, train_dataset=tokens(48, 1), eval_dataset=tokens(12, 2))
    trainer.train(resume_from_checkpoint=opts.get("resume"))
    trainer.save_model(os.path.join(out, "model"))
    R.write_logs(trainer, out)


def hf_rank(rank: int, world: int, opts: dict, out: str) -> None:
    _rank_env(rank, world)
    hf_train(world, opts, out)


def hf_reference(out: str, opts: dict | None = None) -> None:
    """The plain Trainer on one process, the whole model, in this process; ``opts``: the
    model's and the Trainer's (``aux``, ``extra``), not zerokit's."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        os.environ.pop(name, None)
    try:
        hf_train(1, {k: v for k, v in (opts or {}).items() if k in ("aux", "extra")}, out)
    finally:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)


# ---- Lightning Fabric and Lightning's Trainer: the tests' MoE loop (moe_models) ----

STEPS = 3
SAVE_AT = 2  # Fabric: saved after 2 steps, resumed for the third


def launch_fabric(rank: int, world: int, level: str = "p_g_os"):
    from lightning.fabric import Fabric

    import zerokit.integrations.fabric  # noqa: F401  (registers the strategy names)

    _rank_env(rank, world)
    fabric = Fabric(accelerator="cpu", devices=world, strategy=f"zerokit_{level}")
    fabric.launch()  # the ranks and their process group exist: nothing is started
    return fabric


def fabric_rank(rank: int, world: int, level: str, ckpt: str, resume_level: str) -> dict:
    """``fabric.setup(model, opt)`` on the split model, ``fabric.backward``, a binding
    ``fabric.clip_gradients``, ``fabric.save`` after ``SAVE_AT`` steps; then a fresh split
    model, at ``resume_level``, ``fabric.load``s it and trains the rest. Returns the losses,
    the clip norms, the model and the resumed model."""
    fabric = launch_fabric(rank, world, level)
    model, opt = _fabric_setup(fabric, seed=0)
    record: dict = {"losses": [], "norms": []}
    for step, batch in enumerate(batches(STEPS, 2 * world)):
        if step == SAVE_AT:
            fabric.save(ckpt, {"model": model, "optimizer": opt})
        _fabric_step(fabric, model, opt, batch.chunk(world)[rank], record)
    fabric = launch_fabric(rank, world, resume_level)
    resumed, opt = _fabric_setup(fabric, seed=123)  # resuming must not depend on its weights
    fabric.load(ckpt, {"model": resumed, "optimizer": opt})
    for batch in batches(STEPS, 2 * world)[SAVE_AT:]:
        _fabric_step(fabric, resumed, opt, batch.chunk(world)[rank], {"losses": [], "norms": []})
    return {**record, "model": model.module, "resumed": resumed.module}


def _fabric_setup(fabric, seed: int):
    model = split(tiny_moe("mixtral", seed=seed), 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return fabric.setup(model, opt)


def _fabric_step(fabric, model, opt, mine: torch.Tensor, record: dict) -> None:
    loss = model(input_ids=mine, labels=mine).loss
    fabric.backward(loss)
    record["norms"].append(fabric.clip_gradients(model, opt, max_norm=CLIP).item())
    opt.step()
    opt.zero_grad()
    record["losses"].append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())


def fabric_eval(rank: int, world: int) -> float:
    """``fabric.setup(model)`` (no optimizer: evaluation) on the split model; the global
    batch's mean loss."""
    fabric = launch_fabric(rank, world)
    model = fabric.setup(split(dense_apart(tiny_moe("mixtral"), rank), 2))
    mine = batches(1, 2 * world)[0].chunk(world)[rank]
    with torch.no_grad():
        loss = model(input_ids=mine, labels=mine).loss
    return fabric.all_reduce(loss, reduce_op="mean").item()


def reference(world: int, epochs: int = 1) -> dict:
    """One process, the whole model, the global batches (``epochs`` times), the same clip."""
    model = tiny_moe("mixtral")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses, norms = [], []
    for batch in batches(STEPS, 2 * world) * epochs:
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "model": model}


def lightning_rank(rank: int, world: int, level: str, validate: bool = False) -> dict:
    """``Trainer(strategy=ZeroKitStrategy(level))`` on ``MoEModule``, its experts split in
    ``configure_model``: ``fit`` with a binding ``gradient_clip_val`` (the losses, the norms
    before the clip, the model, ``strategy.full_state_dict()``), or ``validate`` alone (the
    losses)."""
    _rank_env(rank, world)
    module, trainer = moe_module(world), _lightning_trainer(world, level, max_steps=STEPS)
    if validate:
        dense_apart(module.model, rank)
        trainer.validate(module, verbose=False)
        return {"losses": module.val_losses}
    trainer.fit(module)
    whole = trainer.strategy.full_state_dict()
    return {"losses": module.losses, "norms": module.norms, "model": module.model, "whole": whole}


def lightning_resumed(rank: int, world: int, ckpt: str) -> dict:
    """An epoch (``STEPS`` steps) at 'p_g_os', ``trainer.save_checkpoint``; a fresh module
    resumes from it at 'os_g' for a second epoch. Returns its losses and model."""
    _rank_env(rank, world)
    trainer = _lightning_trainer(world, "p_g_os", max_epochs=1)
    trainer.fit(moe_module(world))
    trainer.save_checkpoint(ckpt)
    module = moe_module(world, seed=123)  # resuming must not depend on its weights
    _lightning_trainer(world, "os_g", max_epochs=2).fit(module, ckpt_path=ckpt)
    return {"losses": module.losses, "model": module.model}


def _lightning_trainer(world: int, level: str, **limits):
    import lightning.pytorch as pl

    from zerokit.integrations.lightning import ZeroKitStrategy

    return pl.Trainer(
        accelerator="cpu", devices=world, strategy=ZeroKitStrategy(level), gradient_clip_val=CLIP,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, **limits,
    )  # fmt: skip


def _moe_module_class():
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, DistributedSampler

    from zerokit.moe import ExpertParallelExperts

    class MoEModule(pl.LightningModule):
        """The tiny Mixtral, split over ep = 2 ranks once Lightning's process group exists
        (``configure_model``, called again by each fit/validate: split once)."""

        def __init__(self, world: int, seed: int):
            super().__init__()
            self.model = tiny_moe("mixtral", seed=seed)
            self.rows = torch.cat(batches(STEPS, 2 * world))  # global batches, one after another
            self.losses, self.norms, self.val_losses = [], [], []

        def configure_model(self):
            if not any(isinstance(m, ExpertParallelExperts) for m in self.model.modules()):
                split(self.model, 2)

        def training_step(self, batch, batch_idx, losses=None):
            loss = self.model(input_ids=batch, labels=batch).loss
            (self.losses if losses is None else losses).append(
                self.all_gather(loss.detach()).mean().item()
            )
            return loss

        def validation_step(self, batch, batch_idx):
            self.training_step(batch, batch_idx, self.val_losses)

        def on_before_optimizer_step(self, optimizer):
            from zerokit import clip_grad_norm_  # the norm before the clip (inf: no change)

            self.norms.append(clip_grad_norm_(self.trainer.strategy.model, float("inf")).item())

        def train_dataloader(self):
            world, rank = self.trainer.world_size, self.trainer.global_rank
            sampler = DistributedSampler(self.rows, num_replicas=world, rank=rank, shuffle=False)
            return DataLoader(self.rows, batch_size=2, sampler=sampler)

        val_dataloader = train_dataloader

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)

    return MoEModule


def moe_module(world: int, seed: int = 0):
    """A ``MoEModule`` (its class made here: lightning is imported only by its tests)."""
    return _moe_module_class()(world, seed)


def hf_refusals(rank: int, world: int, out: str) -> None:
    """What ZeroTrainer cannot do with split experts, refused on every rank, by name."""
    import pytest
    from accelerate.state import AcceleratorState

    from zerokit.integrations.hf_trainer import ZeroTrainer, ZeroTrainingArguments

    _rank_env(rank, world)
    AcceleratorState._reset_state(reset_partial_state=True)
    base = {"output_dir": out, "use_cpu": True, "report_to": [], "zerokit_level": "os_g"}
    args = ZeroTrainingArguments(**base, optim="adafactor")
    trainer = ZeroTrainer(model=split(tiny_moe("mixtral"), 2), args=args)
    with pytest.raises(ValueError, match=r"Adafactor reads each parameter whole.*E / ep experts"):
        trainer.create_optimizer()  # as train() does first: the optimizer the Trainer chose
    trainer = ZeroTrainer(model=split(tiny_moe("mixtral"), 2), args=ZeroTrainingArguments(**base))
    with pytest.raises(ValueError, match="save_model before training, with the experts split"):
        trainer.save_model()
