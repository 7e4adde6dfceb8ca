"""Lightning Fabric: ``Fabric(strategy=ZeroKitFabricStrategy(level))``, or a name after the import.

    import zerokit.integrations.fabric  # registers the names below in Fabric's registry
    fabric = lightning.fabric.Fabric(accelerator="cpu", devices=2, strategy="zerokit_os_g")
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)  # wrapped with group_sharded_parallel

Names: ``"zerokit"`` (= ``"zerokit_p_g_os"``), ``"zerokit_os"``, ``"zerokit_os_g"``,
``"zerokit_p_g_os"`` (the Trainer's strategy, ``zerokit.integrations.lightning``, registers
the same names in the Trainer's registry, and imports this module, so its import registers
both). Lightning's Fabric DDP strategy for everything but the model (launcher, process group,
sampler, reductions); ``fabric.setup(model, optimizer)`` (or ``fabric.setup(model, muon,
adamw)``) wraps the model and its optimizers in place. Fabric's calls become zerokit's:

* ``fabric.backward(loss)`` -> ``loss.backward()`` (scaled for ``precision="16-mixed"``);
* ``fabric.clip_gradients(model, optimizer, max_norm=...)`` -> ``zerokit.clip_grad_norm_``,
  the norm one process computes; ``clip_val=...`` clamps the pieces each rank steps (exact);
* ``fabric.no_backward_sync(model)`` -> ``model.no_sync()``: nothing is reduced inside (under
  hybrid sharding with ``model.no_sync_defers_replica_sync = True``: reduce-scattered inside
  the host, only the cross-host reduction left to the last micro-batch);
* ``precision="bf16-mixed"``/``"16-mixed"`` -> ``MixedPrecision`` (fp32 master shards, no
  autocast), fp16 with zerokit's loss scaler;
* ``fabric.save(path, state)`` -> a zerokit sharded checkpoint directory holding the one
  model and optimizer in ``state``, the rest of ``state`` in its ``extra`` (plain values, or
  objects with ``state_dict()`` such as an LR scheduler); ``fabric.load(path, state)`` loads it
  back, at another level or world size too, and returns the saved entries ``state`` did not ask
  for.
"""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import MixedPrecision as FabricAMP
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from torch import nn

from .. import checkpoint as zk_checkpoint
from ..api import group_sharded_parallel
from ..clip import clip_grad_norm_
from ..config import ShardingConfig
from ..core import ShardedModule
from ..mixed_precision import MixedPrecision
from . import _lightning_common as common

__all__ = ["ZeroKitFabricPrecision", "ZeroKitFabricStrategy"]

WHO = "ZeroKitFabricStrategy"


class ZeroKitFabricPrecision(Precision):
    """Fabric's precision plugin under ``ZeroKitFabricStrategy`` (the strategy converts
    ``Fabric(precision=...)`` to it): no autocast, since ``MixedPrecision`` casts at module
    boundaries; zerokit's scaler for ``"16-mixed"``."""

    def __init__(self, precision: str = "32-true", scaler: Any = None) -> None:
        self.scaler = common.check_precision(WHO, precision, scaler)
        self.precision = precision

    def backward(self, tensor: torch.Tensor, model, *args: Any, **kwargs: Any) -> None:
        if self.scaler is not None:  # as Fabric's AMP plugin (its pre_backward's result is unused)
            tensor = self.scaler.scale(tensor)
        tensor.backward(*args, **kwargs)

    def optimizer_step(self, optimizer, **kwargs: Any) -> Any:
        if self.scaler is None:
            return optimizer.step(**kwargs)
        result = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return result

    def unscale_gradients(self, optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None:
            self.scaler.load_state_dict(dict(state_dict))


def _to_zerokit_precision(plugin: Precision | None) -> ZeroKitFabricPrecision | None:
    if plugin is None or isinstance(plugin, ZeroKitFabricPrecision):
        return plugin
    if type(plugin) is Precision:
        return ZeroKitFabricPrecision("32-true")
    if type(plugin) is FabricAMP:
        return ZeroKitFabricPrecision(plugin.precision, plugin.scaler)
    raise common.refuse_precision(WHO, plugin)


class _NoSync(_BackwardSyncControl):
    def no_backward_sync(self, module: nn.Module, enabled: bool):
        if not enabled:
            return contextlib.nullcontext()
        if not isinstance(module, ShardedModule):
            raise TypeError(
                f"fabric.no_backward_sync needs a model set up with its optimizer under {WHO} "
                f"(fabric.setup(model, optimizer)); got an unwrapped {type(module).__name__}"
            )
        return module.no_sync()


class ZeroKitFabricStrategy(DDPStrategy):
    """ZeRO sharded data parallelism for ``lightning.fabric.Fabric``; see the module doc.

    Args: as ``zerokit.integrations.lightning.ZeroKitStrategy``'s (``level``,
    ``mixed_precision``, ``config``, ``process_group_backend``, ``timeout`` and the
    ``ShardingConfig`` fields as keyword arguments).
    """

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
        precision: Precision | None = None,
        start_method: str = "popen",
        **sharding: Any,
    ) -> None:
        level = common.check_options(WHO, level, mixed_precision, sharding)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self.level = level
        self.mixed_precision = mixed_precision
        self.config = common.sharding_config(config, sharding)
        self._backward_sync_control = _NoSync()

    @property
    def precision(self) -> ZeroKitFabricPrecision:
        if self._precision is None:
            self._precision = ZeroKitFabricPrecision()
        return self._precision

    @precision.setter
    def precision(self, plugin: Precision | None) -> None:
        self._precision = _to_zerokit_precision(plugin)

    def _configure_launcher(self) -> None:
        # called by Fabric(...) once its options are set: refuse what we cannot honour now
        common.refuse_checkpoint_io(WHO, "Fabric", self._checkpoint_io)
        super()._configure_launcher()

    # -- setup ---------------------------------------------------------------------------

    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list, scheduler=None):
        """Wrap ``module`` and its optimizers (one, or several over disjoint parameters: Muon
        beside AdamW) in place (an LR scheduler keeps working)."""
        plugin = self.precision
        module, optimizers, plugin.scaler = group_sharded_parallel(
            module,
            list(optimizers),
            self.level,
            scaler=plugin.scaler,
            mixed_precision=common.precision_policy(plugin.precision, self.mixed_precision, WHO),
            config=self.config,
        )
        return module, optimizers, scheduler

    def setup_module(self, module: nn.Module) -> nn.Module:
        """A model without an optimizer (evaluation): ``common.start_alike``."""
        common.start_alike(module)
        return module

    def setup_optimizer(self, optimizer):
        raise NotImplementedError(self._err_msg_joint_setup_required())

    def clip_gradients_norm(
        self, module, optimizer, max_norm, norm_type=2.0, error_if_nonfinite: bool = True
    ) -> torch.Tensor:
        if not isinstance(module, ShardedModule):
            return super().clip_gradients_norm(
                module, optimizer, max_norm, norm_type, error_if_nonfinite
            )
        self.precision.unscale_gradients(optimizer)
        norm = clip_grad_norm_(module, max_norm, norm_type)
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(
                f"the total norm of order {norm_type} of the gradients is {norm.item()}; pass "
                "error_if_nonfinite=False to fabric.clip_gradients to clip anyway"
            )
        return norm

    # clip_gradients_value: Fabric's clamps the optimizer's parameters' gradients, which for a
    # zerokit optimizer are this rank's pieces, reduced: elementwise, so exact as it is.

    # -- checkpoints: zerokit's sharded directory ----------------------------------------

    def save_checkpoint(self, path, state: dict, storage_options=None, filter=None) -> None:
        """Collective: every rank writes its shards of the model and optimizer in ``state``."""
        if storage_options is not None or filter is not None:
            raise TypeError(
                f"{WHO}: fabric.save(..., filter=...) and storage_options are not supported: "
                "zerokit writes its own sharded directory, of the whole model"
            )
        model, optimizer, rest = _split(state, "fabric.save")
        zk_checkpoint.save(self.broadcast(os.fspath(path)), model, optimizer, extra=rest)

    def load_checkpoint(self, path, state=None, strict: bool = True, weights_only=None) -> dict:
        """Collective: load into the model (and optimizer) in ``state``, and ``state``'s other
        entries from the checkpoint's extra; return the saved entries ``state`` did not name."""
        path = self.broadcast(os.fspath(path))
        if isinstance(state, nn.Module):
            state = {"model": state}
        if not isinstance(state, dict) or not state:
            raise TypeError(
                f"{WHO}: fabric.load(path, state) needs state={{'model': model, ...}} to load "
                "into (a zerokit checkpoint is shards, not a state dict); for one file, run "
                "`zerokit ckpt consolidate`"
            )
        model, optimizer, rest = _split(state, "fabric.load")
        saved = common.saved_extra_keys(path)
        missing = sorted(set(rest) - set(saved))
        if strict and missing:
            raise KeyError(f"fabric.load: {missing} are not in the checkpoint {path!r}")
        extra = {k: v for k, v in rest.items() if k in saved}
        extra.update({k: None for k in saved if k not in rest})
        zk_checkpoint.load(path, model, optimizer, strict=strict, extra=extra)
        for k in rest:
            if k in saved and not hasattr(rest[k], "load_state_dict"):
                state[k] = extra[k]  # a plain value: Fabric copies it back to the caller
        return {k: extra[k] for k in saved if k not in rest}

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        common.register(strategy_registry, cls)


def _split(state: dict, call: str) -> tuple[nn.Module, Any, dict]:
    """(the one model, its optimizer, the list of its optimizers in the state's order, or
    None, and everything else) of a Fabric state dict."""
    models = [v for v in state.values() if isinstance(v, nn.Module)]
    optimizers = [v for v in state.values() if isinstance(v, torch.optim.Optimizer)]
    if len(models) != 1:
        raise ValueError(
            f"{WHO}: {call} takes one model in its state (a zerokit checkpoint holds one "
            f"model and its optimizers); got {len(models)}"
        )
    rest = {k: v for k, v in state.items() if v is not models[0] and v not in optimizers}
    held = None if not optimizers else optimizers[0] if len(optimizers) == 1 else optimizers
    return models[0], held, rest


ZeroKitFabricStrategy.register_strategies(STRATEGY_REGISTRY)
