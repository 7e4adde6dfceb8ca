"""PyTorch Lightning: ``Trainer(strategy=ZeroKitStrategy(level))``, or a name after the import.

    import zerokit.integrations.lightning  # registers the names below
    trainer = lightning.pytorch.Trainer(devices=2, strategy="zerokit_p_g_os")

Names: ``"zerokit"`` (= ``"zerokit_p_g_os"``), ``"zerokit_os"``, ``"zerokit_os_g"``,
``"zerokit_p_g_os"`` (Fabric's strategy, ``ZeroKitFabricStrategy`` in ``fabric.py``, is
re-exported here and registered under the same names in Fabric's registry). The strategy is
Lightning's DDP strategy for everything but the model (its launcher, so a plain ``python train.py`` starts the ranks, or torchrun does; its process
group, ``DistributedSampler``, barrier and reductions). After ``configure_optimizers`` it wraps
the LightningModule and its optimizer with ``group_sharded_parallel`` (in place: LR schedulers
keep the optimizer they were built on). Lightning's options become zerokit's:

* ``gradient_clip_val`` (norm) -> ``zerokit.clip_grad_norm_``, the norm one process computes;
  by value, each rank clamps the gradient pieces it steps (elementwise, so exact);
* ``precision="bf16-mixed"`` / ``"16-mixed"`` -> ``MixedPrecision(param_dtype=...)``: fp32
  master shards, compute in the low dtype, the loss returned in fp32 (no autocast); fp16 adds
  zerokit's loss scaler, whose overflow check every rank agrees on;
* ``accumulate_grad_batches`` -> ``no_sync()`` on the accumulating micro-batches (nothing is
  reduced there; under hybrid sharding with ``no_sync_defers_replica_sync = True`` on
  ``trainer.strategy.model``, only the cross-host reduction waits for the last);
* ``trainer.save_checkpoint(path)`` (and ``ModelCheckpoint``) -> a zerokit sharded checkpoint
  directory, Lightning's own state (epoch, step, loops, callbacks, schedulers, hparams) in its
  ``extra``; ``fit(ckpt_path=path)`` resumes from it, at another level or world size too;
  ``zerokit ckpt consolidate path --lightning one.ckpt`` makes it Lightning's one file, for
  ``load_from_checkpoint`` on one process (``zerokit/checkpoint/lightning_file.py``);
* the LightningModule's own ``state_dict()`` (in ``on_train_end``, after ``fit``) -> the
  wrapped root's, gathered at ``'p_g_os'`` (collective, as ``full_state_dict()``), never the
  empty tensors its parameters are between steps.

Refused, by name, at ``Trainer(...)``: ``sync_batchnorm=True``, precisions other than
``32-true``/``16-mixed``/``bf16-mixed`` (``"16-true"``, ``"bf16-true"``, ``"64-true"``, ...), a
``CheckpointIO`` plugin (``plugins=[AsyncCheckpointIO()]``); at ``fit``: a one-file
``ckpt_path`` (another strategy's; several optimizers, Muon beside AdamW, are taken); at ``save_checkpoint``:
``storage_options``.

Lightning finds no third-party strategy by itself: its registry holds its own classes, filled
when ``lightning.pytorch.strategies`` is imported (entry points are read for callbacks only,
``lightning.pytorch.callbacks_factory``, and after the strategy is chosen). So the names exist
once this module is imported; it registers them in Fabric's registry too.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Generator, Mapping
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import MixedPrecision as LightningAMP
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from .. import checkpoint as zk_checkpoint
from ..api import group_sharded_parallel
from ..checkpoint.holdings import OPTIM_PREFIX
from ..checkpoint.lightning_file import EXTRA_PREFIX
from ..checkpoint.reading import CheckpointReader
from ..clip import clip_grad_norm_
from ..config import ShardingConfig
from ..core import state_of
from ..mixed_precision import MixedPrecision
from ..moe import expert_groups_of
from ..moe import full_state_dict as moe_full_state_dict
from . import _lightning_common as common
from .fabric import ZeroKitFabricStrategy

__all__ = ["ZeroKitFabricStrategy", "ZeroKitPrecision", "ZeroKitStrategy"]


class _Root(nn.Module):
    """The module zerokit wraps: it runs the LightningModule's step methods in its forward.

    Note: zerokit's root hooks must fire exactly once around each step. Lightning calls
    ``training_step``, not ``forward``, and ``training_step`` calls ``self(x)`` (the hooks
    would fire inside the step) or ``self.net(x)`` (never). So, as DDP's wrapper does, this
    module's forward is the LightningModule's and Lightning's forward redirection routes each
    step through it. It shares the LightningModule's parameter, buffer and child dicts instead
    of holding it as a child, so its names, and the checkpoint's, are the LightningModule's.
    """

    def __init__(self, module: LightningModule):
        super().__init__()
        object.__setattr__(self, "module", module)  # not a child: its children are ours
        for shared in ("_parameters", "_buffers", "_non_persistent_buffers_set", "_modules"):
            object.__setattr__(self, shared, getattr(module, shared))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


class ZeroKitPrecision(Precision):
    """Lightning's precision plugin under ``ZeroKitStrategy`` (the strategy converts
    ``Trainer(precision=...)`` to it): no autocast, since ``MixedPrecision`` casts at module
    boundaries; zerokit's scaler for ``"16-mixed"``; zerokit's clipping."""

    def __init__(self, precision: str = "32-true", scaler: Any = None) -> None:
        self.scaler = common.check_precision("ZeroKitStrategy", precision, scaler)
        self.precision = precision
        self.model: nn.Module | None = None  # the wrapped root: clipping needs the model

    def pre_backward(self, tensor: torch.Tensor, module: LightningModule) -> torch.Tensor:
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    def optimizer_step(
        self, optimizer, model: LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        # The closure (forward and backward) runs before the step, as in Lightning's AMP
        # plugin: a zerokit optimizer checks, when stepped, that the gradients were reduced.
        result = closure()
        skip = result is None and model.automatic_optimization  # training_step returned None
        if self.scaler is not None and not skip:
            self.scaler.unscale_(optimizer)  # before clipping, in _after_closure
        self._after_closure(model, optimizer)
        if skip:
            return result
        if self.scaler is None:
            optimizer.step(**kwargs)
        else:
            self.scaler.step(optimizer, **kwargs)
            self.scaler.update()
        return result

    def clip_grad_by_norm(self, optimizer, clip_val: float) -> None:
        if self.model is None:  # not wrapped (nothing to shard): Lightning's own
            return super().clip_grad_by_norm(optimizer, clip_val)
        clip_grad_norm_(self.model, clip_val)
        return None

    # clip_grad_by_value: Lightning's clamps the optimizer's parameters' gradients, which for a
    # zerokit optimizer are this rank's pieces, reduced: elementwise, so exact as it is.

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if self.scaler is not None:
            self.scaler.load_state_dict(dict(state_dict))


def _to_zerokit_precision(plugin: Precision) -> ZeroKitPrecision:
    if isinstance(plugin, ZeroKitPrecision):
        return plugin
    if type(plugin) is Precision:
        return ZeroKitPrecision("32-true")
    if type(plugin) is LightningAMP:
        return ZeroKitPrecision(plugin.precision, plugin.scaler)
    raise common.refuse_precision("ZeroKitStrategy", plugin)


class ZeroKitStrategy(DDPStrategy):
    """ZeRO sharded data parallelism for ``lightning.pytorch.Trainer``; see the module doc.

    Args:
        level: ``'os'``, ``'os_g'`` or ``'p_g_os'`` (or 1, 2, 3); None: ``config``'s level,
            else zerokit's default (a level given here and in ``config`` must agree).
        mixed_precision: a ``zerokit.MixedPrecision`` policy, with ``precision="32-true"``
            (the Trainer's ``"bf16-mixed"``/``"16-mixed"`` choose one themselves).
        config: a ``zerokit.ShardingConfig``.
        process_group_backend, timeout: as for Lightning's ``DDPStrategy``.
        **sharding: any other ``ShardingConfig`` field (``buffer_max_size``, ``offload``,
            ``step_in_backward``, ...), filling ``config``.
    """

    strategy_name = "zerokit"

    def __init__(
        self,
        level: str | int | None = None,
        mixed_precision: MixedPrecision | None = None,
        config: ShardingConfig | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        *,
        accelerator=None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment=None,
        checkpoint_io=None,
        precision_plugin: Precision | None = None,
        start_method: str = "popen",
        **sharding: Any,
    ) -> None:
        level = common.check_options("ZeroKitStrategy", level, mixed_precision, sharding)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self.level = level
        self.mixed_precision = mixed_precision
        self.config = common.sharding_config(config, sharding)
        self._root: _Root | None = None  # set once the LightningModule is wrapped

    # -- what Lightning configures -------------------------------------------------------

    @property
    def precision_plugin(self) -> ZeroKitPrecision:
        if self._precision_plugin is None:
            self._precision_plugin = ZeroKitPrecision()
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = None if plugin is None else _to_zerokit_precision(plugin)

    def _configure_launcher(self) -> None:
        # called by Trainer(...) once its options are set: refuse what we cannot honour now
        if self._layer_sync is not None:
            raise ValueError(
                "ZeroKitStrategy cannot honour Trainer(sync_batchnorm=True): zerokit is not "
                "tested with nn.SyncBatchNorm (torch runs it on GPUs only); remove "
                "sync_batchnorm=True (each rank then normalizes over its own micro-batch, as "
                "DDP without it)"
            )
        common.refuse_checkpoint_io("ZeroKitStrategy", "Trainer", self._checkpoint_io)
        super()._configure_launcher()

    # -- setup and teardown --------------------------------------------------------------

    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        fitting = trainer.state.fn == TrainerFn.FITTING
        if self._root is not None and self._root.module is module:  # trained by an earlier fit
            if fitting:
                raise RuntimeError(
                    "this LightningModule was already trained with ZeroKitStrategy; call fit "
                    "on a new instance (resume with fit(model, ckpt_path=...))"
                )
            self.model = self._root
        elif fitting:
            self.model_to_device()
            self.setup_optimizers(trainer)
            self.model = self._wrap(module)
        else:  # evaluation only: nothing to shard; every rank starts from rank 0's weights
            self.model_to_device()
            common.start_alike(module)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _wrap(self, module: LightningModule) -> _Root:
        plugin = self.precision_plugin
        policy = common.precision_policy(plugin.precision, self.mixed_precision, "ZeroKitStrategy")
        root = _Root(module)
        _, optimizers, scaler = group_sharded_parallel(
            root,
            list(self.optimizers),  # configure_optimizers' one or several (Muon beside AdamW)
            self.level,
            scaler=plugin.scaler,
            mixed_precision=policy,
            config=self.config,
        )
        plugin.model, plugin.scaler = root, scaler
        # the user's module holds the root's parameters under its names: its own state_dict()
        # gathers them as the root's does (at 'p_g_os' they are empty between steps)
        state_of(root).state_dict_hooks.share(module)
        self.optimizers = optimizers  # converted in place: rebuild Lightning's view of them
        self._root = root
        return root

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning's accumulating micro-batches: gradients stay local, nothing is reduced."""
        if self._root is not None and self.model is self._root:
            with self._root.no_sync():
                yield None
        else:
            yield None

    def teardown(self) -> None:
        # as Lightning's FSDP strategy: the model stays where it is. Moving a wrapped model
        # (Strategy.teardown moves it to the CPU) would cut its parameters off the flat buffers.
        if self._root is None:
            return super().teardown()
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()
        return None

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The LightningModule's whole state dict, under its own names, experts split across
        ranks gathered (``zerokit.moe.full_state_dict``). Collective at level 'p_g_os' or with
        split experts: every rank calls it."""
        module = self._root if self._root is not None else self.lightning_module
        assert module is not None
        return moe_full_state_dict(module) if expert_groups_of(module) else module.state_dict()

    # -- checkpoints: zerokit's sharded directory, Lightning's state in its extra ---------

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # load into the wrapped model and optimizer

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores it, sharded

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # save_checkpoint writes each rank's shards itself (no full copy anywhere)

    def optimizer_state(self, optimizer) -> dict[str, torch.Tensor]:
        return {}  # as the model: written as shards by save_checkpoint

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # load_checkpoint loaded it

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # load_checkpoint loaded it

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None
    ) -> None:
        """Collective: every rank writes its shards to the directory ``filepath``."""
        if storage_options is not None:
            raise TypeError(
                "ZeroKitStrategy.save_checkpoint(..., storage_options=...) is not supported: "
                "zerokit writes its own sharded directory, not through a CheckpointIO"
            )
        path = self.broadcast(os.fspath(filepath))
        optimizer = None
        if self._root is not None and "optimizer_states" in checkpoint:  # not weights_only
            optimizer = self._saved_optimizers()
        rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        zk_checkpoint.save(
            path,
            self._root if self._root is not None else self.lightning_module,
            optimizer,
            extra={EXTRA_PREFIX + k: v for k, v in rest.items()},
        )

    def _saved_optimizers(self):
        """What a checkpoint holds: the one optimizer, or the list of them in order."""
        return self.optimizers[0] if len(self.optimizers) == 1 else list(self.optimizers)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Collective: load the shards into the wrapped model (and optimizer, when fitting) and
        return Lightning's state for it to restore the rest."""
        path = self.broadcast(os.fspath(checkpoint_path))
        if os.path.isfile(path):
            raise ValueError(
                f"ZeroKitStrategy resumes from the checkpoint directories it saves; {path} is a "
                "file (Lightning's one-file format, written by another strategy or by `zerokit "
                "ckpt consolidate --lightning`): take its weights with "
                "YourModule.load_from_checkpoint(path) and fit without ckpt_path"
            )
        module = self.lightning_module
        assert module is not None
        with CheckpointReader(path) as reader:
            saved = reader.index
        keys = [k for k in saved.get("extra", {}) if k.startswith(EXTRA_PREFIX)]
        has_optimizer = any(n.startswith(OPTIM_PREFIX + ".") for n in saved["tensors"])
        optimizer = None
        fitting = module.trainer.state.fn == TrainerFn.FITTING
        if self._root is not None and fitting and has_optimizer:
            optimizer = self._saved_optimizers()
        extra: dict[str, Any] = dict.fromkeys(keys)
        zk_checkpoint.load(
            path,
            self._root if self._root is not None else module,
            optimizer,
            strict=module.strict_loading,
            extra=extra,
        )
        return {k[len(EXTRA_PREFIX) :]: v for k, v in extra.items()}

    # -- registry ------------------------------------------------------------------------

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        common.register(strategy_registry, cls)


ZeroKitStrategy.register_strategies(StrategyRegistry)
