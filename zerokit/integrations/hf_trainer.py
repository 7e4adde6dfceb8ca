"""zerokit inside Hugging Face's ``Trainer`` (and the trainers built on it: TRL's ``SFTTrainer``).

A ``run_clm.py``-style script changes three lines::

    from zerokit.integrations.hf_trainer import ZeroTrainer, ZeroTrainingArguments
    args = ZeroTrainingArguments(..., zerokit_level="os_g")   # was TrainingArguments(...)
    trainer = ZeroTrainer(model=model, args=args, ...)        # was Trainer(...)

``--zerokit_level`` and ``--zerokit_config FILE`` (a ``zerokit.load_config`` file: the
``ShardingConfig`` fields) come from the command line through ``HfArgumentParser`` as any other
``TrainingArguments`` field; ``ZeroTrainer(sharding=ShardingConfig(...))`` gives them in code.
A trainer class built on ``Trainer`` gets the same with ``zero_trainer_class(SFTTrainer)``.

How the Trainer's steps map:

* the optimizer (``optim=`` or ``optimizers=(opt, sched)``) is made by the Trainer, then
  ``create_optimizer`` shards it with the model (``group_sharded_parallel``) before
  ``accelerator.prepare``; the model is marked prepared so accelerate neither wraps it in DDP
  nor autocasts it (zerokit reduces the gradients and casts at module boundaries);
* ``gradient_accumulation_steps`` -> the model's ``no_sync()`` (accelerate's ``no_sync`` calls
  it): nothing is reduced until the last micro-batch (under hybrid sharding with
  ``model.no_sync_defers_replica_sync = True``: only the cross-host reduction waits);
* ``max_grad_norm`` -> ``zerokit.clip_grad_norm_`` over the sharded gradients;
* ``bf16=True`` -> ``MixedPrecision("bf16")`` with fp32 master shards and an fp32 loss;
* ``save_steps`` -> zerokit's sharded checkpoint (model and optimizer) in ``checkpoint-N/zerokit``
  beside the Trainer's scheduler, RNG and ``trainer_state.json``; ``resume_from_checkpoint``
  loads it at any world size and level, ``load_best_model_at_end`` the best one's model;
* ``save_model()`` -> a Hugging Face directory (``config.json`` + safetensors), consolidated
  by streaming the sharded checkpoint: no rank holds the whole model.
* experts split across ranks (``zerokit.moe.apply_expert_parallel`` on the model before it
  is handed in) -> sharded as ``group_sharded_parallel`` shards them, saved and exported as
  the whole model's; a whole-parameter ``optim`` stepping them is refused when ``train()``
  builds it.

Note: the Trainer has no public hook for clipping, for its checkpoint files or for keeping
accelerate from wrapping the model, so this module overrides private methods. It is tested
with the versions in ``TESTED``; others are refused at start-up rather than trained wrong.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
import transformers
from transformers import Trainer, TrainingArguments

from .. import checkpoint as zk_checkpoint
from ..api import group_sharded_parallel
from ..checkpoint.reading import CheckpointReader
from ..clip import clip_grad_norm_
from ..config import DEFAULT_LEVEL, ShardingConfig, load_config, merge_arguments
from ..mixed_precision import as_policy
from ..moe import expert_groups_of

WHO = "zerokit.integrations.hf_trainer"
# the versions whose private Trainer methods this module overrides, tested in CI
TESTED = {"transformers": ("5.24.",), "accelerate": ("1.15.",)}
SHARDED_DIR = "zerokit"  # checkpoint-N/zerokit: the sharded model and optimizer
SCHEDULER_NAME = "scheduler.pt"  # the Trainer's own file names
TRAINING_ARGS_NAME = "training_args.bin"
# optim= names whose optimizer reads whole parameters (transformers' Adafactor: factored second
# moments and the update's RMS): zerokit gives each such parameter to one rank whole
WHOLE_PARAMETER_OPTIMS = {"adafactor"}
EXPORT_SHARD_SIZE = 5 * 2**30  # save_model's safetensors files, as save_pretrained's default


@dataclass
class ZeroTrainingArguments(TrainingArguments):
    """``TrainingArguments`` with zerokit's two settings (``HfArgumentParser`` reads them as
    ``--zerokit_level`` and ``--zerokit_config``)."""

    zerokit_level: str | None = field(
        default=None,
        metadata={
            "help": "zerokit ZeRO level: 'os', 'os_g' or 'p_g_os' (default: the "
            f"--zerokit_config file's, else {DEFAULT_LEVEL!r})"
        },
    )
    zerokit_config: str | None = field(
        default=None,
        metadata={"help": "a zerokit config file (.toml/.json/.yaml) of ShardingConfig fields"},
    )


def check_versions() -> None:
    """Refuse a transformers or accelerate this module was not tested with."""
    import accelerate

    for module in (transformers, accelerate):
        name, version = module.__name__, module.__version__
        if not version.startswith(TESTED[name]):
            raise RuntimeError(
                f"{WHO} is tested with {name} {' / '.join(v + 'x' for v in TESTED[name])}, "
                f"found {name} {version}: it overrides private Trainer methods that may have "
                f"changed. Install a tested version (pip install 'zerokit[hf]')."
            )


def check_arguments(args: TrainingArguments, model: Any) -> None:
    """Refuse, on every rank before anything is built, what zerokit cannot honour."""
    refused = {
        "deepspeed": args.deepspeed,
        "fsdp": args.fsdp,
        "fsdp_config (fsdp_version)": (args.fsdp_config or {}).get("fsdp_version")
        if isinstance(args.fsdp_config, dict)
        else args.fsdp_config,
        "parallelism_config": getattr(args, "parallelism_config", None),
        "fp16": args.fp16,
        "torch_compile": args.torch_compile,
    }
    for name, value in refused.items():
        if value:
            raise ValueError(
                f"{WHO}: TrainingArguments({name}={value!r}) cannot go with zerokit, which "
                f"shards the model itself; remove {name} (bf16=True is zerokit's mixed precision)"
            )
    if getattr(model, "is_parallelizable", False) and getattr(model, "model_parallel", False):
        raise ValueError(f"{WHO}: a model split across devices (model_parallel) is not supported")
    if getattr(model, "hf_device_map", None) and len(set(model.hf_device_map.values())) > 1:
        raise ValueError(
            f"{WHO}: a model loaded with a device_map over several devices is not supported; "
            "load it on one device (device_map=None)"
        )
    if getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False):
        raise ValueError(f"{WHO}: a 4-bit or 8-bit quantized base (QLoRA) is not supported")


def sharding_of(args: TrainingArguments, sharding: ShardingConfig | None) -> ShardingConfig:
    """The ``ShardingConfig`` a run uses: ``sharding=``, else the arguments' file and level
    (a level given in both is compared, never dropped); ``bf16=True`` as zerokit's bf16
    policy with an fp32 loss."""
    file = getattr(args, "zerokit_config", None)
    level = getattr(args, "zerokit_level", None)
    if sharding is not None and (file or level is not None):
        raise ValueError(
            f"{WHO}: zerokit's settings are given twice, as ZeroTrainer(sharding=...) and as "
            "--zerokit_level/--zerokit_config; give them one way"
        )
    if sharding is None:
        sharding = load_config(file) if file else ShardingConfig()
        sharding = merge_arguments(sharding, source="--zerokit_level", level=level)
    if sharding.level is None:
        sharding = replace(sharding, level=DEFAULT_LEVEL)
    if str(getattr(args.optim, "value", args.optim)) in WHOLE_PARAMETER_OPTIMS:
        sharding = replace(sharding, whole_parameter_optimizer=True)
    if args.bf16:
        if sharding.mixed_precision is not None:
            raise ValueError(
                f"{WHO}: bf16=True and ShardingConfig(mixed_precision=...) both choose a "
                "precision; pass only one"
            )
        policy = replace(as_policy("bf16"), output_dtype=torch.float32)
        sharding = replace(sharding, mixed_precision=policy)
    return sharding


class ZeroTrainerMixin:
    """What ``ZeroTrainer`` adds to a ``Trainer`` class; see the module docstring."""

    def __init__(self, *args, sharding: ShardingConfig | None = None, **kwargs):
        check_versions()
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        model = kwargs.get("model", args[0] if args else None)
        if training_args is not None:  # None: the Trainer makes its defaults (checked below)
            check_arguments(training_args, model)
        super().__init__(*args, **kwargs)
        check_arguments(self.args, self.model)
        self.sharding = sharding_of(self.args, sharding)
        self._zero_sharded = False

    # ---- the model and optimizer, sharded together ----

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        if self._zero_sharded:
            return optimizer
        # the trainable names, for a PEFT adapter's save_model (read back from the shards)
        self._zero_trainable = [n for n, p in self.model.named_parameters() if p.requires_grad]
        sharded, self.optimizer, _ = group_sharded_parallel(
            self.model, optimizer, config=self.sharding
        )
        # accelerate's own "already prepared" mark: it then neither wraps the model in DDP
        # nor autocasts its forward (zerokit reduces and casts; the loss comes back in fp32)
        sharded._is_accelerate_prepared = True
        self.model = self.model_wrapped = sharded
        self._zero_sharded = True
        return self.optimizer

    def _clip_grad_norm(self, model):
        return clip_grad_norm_(self.model, self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:  # max_grad_norm=0: the norm is still logged, nothing clipped
            grad_norm = clip_grad_norm_(self.model, float("inf"))
        return grad_norm

    # ---- checkpoints: checkpoint-N/zerokit beside the Trainer's own files ----

    def _base_optimizer(self):
        return getattr(self.optimizer, "optimizer", self.optimizer)  # AcceleratedOptimizer's

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self._zero_sharded:  # nothing sharded yet (saved before training): as Trainer
            # rank 0 would write its own experts as all (an adapter holds none of them)
            if expert_groups_of(self.model) and not is_peft(self.model):
                raise ValueError(
                    f"{WHO}: save_model before training, with the experts split across ranks "
                    "(zerokit.moe): save after train(), or gather the whole model with "
                    "zerokit.moe.full_state_dict(model) on every rank and save that"
                )
            return super().save_model(output_dir, _internal_call)
        if _internal_call:  # a checkpoint-N: the resumable sharded state
            optimizer = None if self.args.save_only_model else self._base_optimizer()
            zk_checkpoint.save(os.path.join(output_dir, SHARDED_DIR), self.model, optimizer)
            return
        export_hf(self, output_dir)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # the optimizer is in checkpoint-N/zerokit (save_model above); the scheduler as Trainer
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        # called before the model is sharded: only checked here, loaded once sharded
        # (_load_optimizer_and_scheduler, which the Trainer calls after accelerator.prepare)
        if not os.path.isdir(os.path.join(resume_from_checkpoint, SHARDED_DIR)):
            raise ValueError(
                f"{WHO}: {resume_from_checkpoint} holds no zerokit checkpoint ({SHARDED_DIR}/); "
                "resume from a checkpoint a ZeroTrainer saved, or start from the model's weights"
            )

    def _load_best_model(self) -> None:
        # load_best_model_at_end: the best checkpoint-N's sharded model (not its optimizer)
        zk_checkpoint.load(os.path.join(self.state.best_model_checkpoint, SHARDED_DIR), self.model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, SHARDED_DIR)
        with CheckpointReader(path) as reader:
            has_optimizer = reader.index.get("optimizer") is not None
        zk_checkpoint.load(path, self.model, self._base_optimizer() if has_optimizer else None)
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))


def export_hf(trainer: Trainer, output_dir: str) -> None:
    """``save_model``: the sharded model written, then streamed into a Hugging Face directory
    (``config.json`` + safetensors) by rank 0, with the tokenizer and the training arguments.
    Collective."""
    staging = os.path.join(
        os.path.dirname(os.path.abspath(output_dir)),
        f".{os.path.basename(os.path.abspath(output_dir))}.zerokit-staging",
    )
    zk_checkpoint.save(staging, trainer.model)
    failure = None
    if trainer.args.should_save:
        try:
            _write_export(trainer, staging, output_dir)
        except Exception as error:  # every rank must hear of it, not wait for ever
            failure = error
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    failures = [None]
    if dist.is_initialized():  # every rank returns once the directory is whole, or fails
        failures = [None] * dist.get_world_size()
        dist.all_gather_object(failures, None if failure is None else repr(failure))
    if failure is not None:
        raise failure
    failed = [(rank, why) for rank, why in enumerate(failures) if why is not None]
    if failed:
        rank, why = failed[0]
        raise RuntimeError(f"{WHO}: save_model failed on rank {rank}: {why}")


def _write_export(trainer: Trainer, staging: str, output_dir: str) -> None:
    """The saving rank's part of ``export_hf``: the directory from the staged shards."""
    os.makedirs(output_dir, exist_ok=True)
    if is_peft(trainer.model):
        export_adapter(trainer.model, staging, trainer._zero_trainable, output_dir)
    else:
        zk_checkpoint.consolidate(staging, output_dir, max_shard_size=EXPORT_SHARD_SIZE)
    if trainer.processing_class is not None:
        trainer.processing_class.save_pretrained(output_dir)
    torch.save(trainer.args, os.path.join(output_dir, TRAINING_ARGS_NAME))


def is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def export_adapter(model, staging: str, trainable: list[str], output_dir: str) -> None:
    """A PEFT model's ``save_model``: only its trained tensors (the adapter, small) are read
    back whole from the shards and written by PEFT's own ``save_pretrained``
    (``adapter_config.json`` + ``adapter_model.safetensors``)."""
    with CheckpointReader(staging) as reader:
        adapter = {name: reader.read_full(name) for name in trainable}
    model.save_pretrained(output_dir, state_dict=adapter)


def zero_trainer_class(base: type[Trainer]) -> type[Trainer]:
    """``base`` (``Trainer`` or a class built on it, TRL's ``SFTTrainer``) under zerokit."""
    return type(f"Zero{base.__name__}", (ZeroTrainerMixin, base), {"__module__": __name__})


class ZeroTrainer(ZeroTrainerMixin, Trainer):
    """``transformers.Trainer`` training under zerokit; see the module docstring.

    Args: as ``Trainer``'s, and ``sharding``: a ``zerokit.ShardingConfig`` (its ``level`` and
    the other fields); None reads ``args.zerokit_level`` / ``args.zerokit_config`` of
    ``ZeroTrainingArguments`` (level ``zerokit.config.DEFAULT_LEVEL`` by default, as
    Lightning's ``"zerokit"`` strategy).
    """
