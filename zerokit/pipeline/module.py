"""``PipelineModule``: a model given as a list of layer descriptions, split by depth across the
stages of a pipeline; this rank builds and runs only its own stage. It is a schedule, not an
engine: ``forward_backward`` runs the micro-batches and ``finalize_grads``; clipping, loss
scaling and the step are the same public calls as without a pipeline.

>>> import torch, zerokit
>>> from torch import nn
>>> pipe = PipelineModule([LayerDesc(nn.Linear, 4, 8), nn.Tanh(), LayerDesc(nn.Linear, 8, 1)],
...                       loss_fn=nn.functional.mse_loss)  # one stage: no process group needed
>>> opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
>>> x, y = torch.randn(6, 4), torch.randn(6, 1)
>>> loss = pipe.forward_backward((x, y), schedule="1f1b", micro_batches=3)
>>> norm = zerokit.clip_grad_norm_(pipe, 1.0)  # the whole model's norm, over every stage
>>> opt.step(); opt.zero_grad()
>>> loss = pipe.train_batch((x, y), opt, schedule="1f1b", micro_batches=3)  # the same, composed
>>> loss.shape
torch.Size([])
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..clip import clip_grad_norm_
from ..core import is_stand_in, state_of
from ..grad_scope import GradScope
from ..layout import Layout, as_layout
from ..runtime.teardown import hand
from ..scaler import ShardedGradScaler, agree_found_inf
from ..tensor_parallel.layers import tp_group_of
from .describe import LayerDesc, SharedLayerDesc
from .finalize import finalize_grads
from .p2p import Mailbox
from .partition import partition as split_layers
from .schedules import execute
from .schedules import schedule as make_schedule


class PipelineStage(nn.Module):
    """One stage's layers, run in order. Layers are named by their index in the whole model
    (``layers.<i>``), shared ones by key (``shared.<key>``), so names do not depend on the
    split. This is the module to wrap with ``group_sharded_parallel``.

    ``group``: the pipeline's stages (None: the stage is the whole model); ``copies``: keys of
    the tied weights this stage holds a later copy of. Both only say what the stage's
    gradients are a part of (``grad_scope``), for clipping and loss scaling."""

    def __init__(
        self,
        items: Sequence[object],
        first_index: int,
        group: dist.ProcessGroup | None = None,
        copies: Sequence[str] = (),
    ):
        super().__init__()
        self.layers = nn.ModuleDict()
        self.shared = nn.ModuleDict()
        self._runs: list[tuple[str, str, Callable | None]] = []  # (where, name, forward_func)
        tied_attr = {}  # key -> the name of its tied parameter
        for offset, item in enumerate(items):
            name = str(first_index + offset)
            if isinstance(item, SharedLayerDesc):
                if item.key not in self.shared:
                    self.shared[item.key] = item.build()
                tied_attr[item.key] = item.shared_weight_attr
                self._runs.append(("shared", item.key, item.forward_func))
            elif isinstance(item, LayerDesc):
                self.layers[name] = item.build()
                self._runs.append(("layers", name, None))
            elif isinstance(item, nn.Module):
                self.layers[name] = item
                self._runs.append(("layers", name, None))
            elif callable(item):
                self._runs.append(("function", name, item))
            else:
                raise TypeError(
                    f"layer {name}: expected a LayerDesc, module or function, got {item!r}"
                )
        self._across = (group,) if group is not None else ()
        self._copies = {key: tied_attr[key] for key in copies}

    def forward(self, x):
        for where, name, func in self._runs:
            if where == "function":
                x = func(x)
            else:
                layer = getattr(self, where)[name]
                x = _run_as_forward(layer, func, x) if func is not None else layer(x)
        return x

    def grad_scope(self) -> GradScope:
        """This stage's gradients are a part of the pipeline's: norms and overflow flags are
        reduced over ``group`` too, and a later copy of a tied weight is not counted again."""
        left_out = frozenset(id(getattr(self.shared[k], a)) for k, a in self._copies.items())
        return GradScope(self, self._across, left_out)


def _run_as_forward(layer: nn.Module, func: Callable, x):
    """``func(layer, x)`` run as ``layer``'s forward (a tied head using the embedding's weight):
    the hooks around a forward fire, so at 'p_g_os' the layer's unit is gathered for it and
    again for its backward, as for a call of the layer itself."""
    layer.forward = functools.partial(func, layer)  # an instance attribute, for this call only
    try:
        return layer(x)
    finally:
        del layer.forward


class PipelineModule(nn.Module):
    """``layers`` (``LayerDesc``, ``SharedLayerDesc``, plain functions or modules) split into
    ``num_stages`` contiguous stages, by ``partition``: ``"parameters"`` (balanced parameter
    counts, counted on the meta device), ``"uniform"`` (layer counts) or boundaries
    ``[0, b1, ..., len(layers)]``. The stages are ``layout.pp_group`` (a ``zerokit.Layout`` or
    a DeviceMesh with a "pp" dim), else the whole world, one stage per rank.

    ``loss_fn(output, labels)`` runs on the last stage and must be a mean over the micro-batch.
    """

    def __init__(
        self,
        layers: Sequence[object],
        loss_fn: Callable,
        num_stages: int | None = None,
        layout: Layout | None = None,
        partition: str | Sequence[int] = "parameters",
    ):
        super().__init__()
        layers = list(layers)
        self.loss_fn = loss_fn
        self.layout = as_layout(layout, "PipelineModule") if layout is not None else None
        self.group, self.stage_id, self.num_stages = self._place(num_stages)
        self.bounds = split_layers(layers, self.num_stages, partition)
        start, end = self.bounds[self.stage_id], self.bounds[self.stage_id + 1]
        tied = self._tied_stages(layers)
        copies = [k for k, where in tied.items() if self.stage_id in where[1:]]
        across = self.group if self.num_stages > 1 else None
        self.stage = PipelineStage(layers[start:end], start, across, copies)
        self.mailbox = Mailbox(self.group, self.stage_id, self.num_stages)
        self.shared_groups = self._tie(layers, tied)
        self._tied = {  # key -> this stage's copy of the tied weight
            k: getattr(self.stage.shared[k], self._shared_attr(layers, k))
            for k in self.shared_groups
        }

    # -- building ------------------------------------------------------------------------------
    def _place(self, num_stages: int | None):
        layout = self.layout
        if layout is not None and layout.pp_degree > 1:
            if num_stages not in (None, layout.pp_degree):
                raise ValueError(
                    f"num_stages={num_stages} but the layout has pp_degree={layout.pp_degree}"
                )
            return layout.pp_group, layout.pp_rank, layout.pp_degree
        if num_stages in (None, 1):
            return None, 0, 1
        if not dist.is_initialized() or dist.get_world_size() != num_stages:
            raise ValueError(
                f"num_stages={num_stages} needs a process group of {num_stages} ranks, or a layout "
                f"from zerokit.init_hybrid_parallel(..., pp_degree={num_stages})"
            )
        return dist.group.WORLD, dist.get_rank(), num_stages

    def _stage_of(self, index: int) -> int:
        return next(s for s in range(self.num_stages) if index < self.bounds[s + 1])

    def _tied_stages(self, layers: list[object]) -> dict[str, list[int]]:
        """Each shared key on several stages -> those stages, in order (from the bounds)."""
        stages: dict[str, list[int]] = {}
        for i, item in enumerate(layers):
            if isinstance(item, SharedLayerDesc):
                s = self._stage_of(i)
                if s not in stages.setdefault(item.key, []):
                    stages[item.key].append(s)
        return {k: v for k, v in sorted(stages.items()) if len(v) > 1}

    def _tie(
        self, layers: list[object], tied: dict[str, list[int]]
    ) -> dict[str, tuple[dist.ProcessGroup, bool]]:
        """For each shared key on several stages: see ``tie_across_stages``."""
        if not tied:
            return {}
        # every rank built on meta (zerokit plan's dry run plays a rank on meta: no values)
        if any(p.is_meta for p in self.stage.parameters()) and not is_stand_in(self.group):
            raise ValueError(
                f"layers {sorted(tied)} are tied across pipeline stages, whose copies start "
                "equal by a broadcast, which a model on meta cannot do (no values yet); build "
                "this PipelineModule without torch.device('meta') / zerokit.empty_init()"
            )
        weights = {
            key: getattr(self.stage.shared[key], self._shared_attr(layers, key))
            for key, where in tied.items()
            if self.stage_id in where
        }
        return tie_across_stages(tied, weights, self.stage_id, self.num_stages)

    @staticmethod
    def _shared_attr(layers: list[object], key: str) -> str:
        return next(
            d.shared_weight_attr for d in layers if isinstance(d, SharedLayerDesc) and d.key == key
        )

    # -- running -------------------------------------------------------------------------------
    @property
    def is_first(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def forward(self, x):
        raise RuntimeError(
            "a PipelineModule runs through train_batch() or eval_batch(); "
            "self.stage(x) runs this rank's stage alone"
        )

    def grad_scope(self) -> GradScope:
        """This rank's gradients: its stage's, a part of the pipeline's (``zerokit.clip_grad_norm_``
        and ``ShardedGradScaler`` reduce over the stages through this)."""
        return self.stage.grad_scope()

    def forward_backward(
        self,
        batch: tuple[torch.Tensor, torch.Tensor],
        schedule: str = "1f1b",
        micro_batches: int = 1,
        scaler=None,
    ) -> torch.Tensor:
        """Forward and backward of every micro-batch of this rank's ``(inputs, labels)`` in the
        schedule's order, then ``finalize_grads`` (tied weights summed across stages, the
        sequence-parallel sum, the data-parallel reduction): the stage's gradients are then
        its part of the whole model's, ready for ``zerokit.clip_grad_norm_(pipe, ...)`` and
        ``optimizer.step()``. Returns the mean loss over the global batch (every data-parallel
        rank's), unscaled, on every rank. Collective over every rank of the layout.

        ``scaler`` (fp16): the last stage's loss is scaled for backward with ``scaler.scale``.
        A wrapped stage takes the ``zerokit.ShardedGradScaler`` ``group_sharded_parallel``
        returned (its ``unscale_`` agrees an overflow over the pipeline too); a stage not
        wrapped a ``torch.amp.GradScaler``, to which an overflow on any stage is shown in this
        stage's own gradients (see ``_show_overflow``). Then ``scaler.unscale_(opt)``,
        clip, ``scaler.step(opt)``, ``scaler.update()`` as without a pipeline."""
        state = state_of(self.stage)
        if state is None and self._data_size() > 1:
            raise RuntimeError(
                "the layout has data-parallel ranks: wrap the stage first, "
                "zerokit.group_sharded_parallel(pipe.stage, opt, level, shard_group=layout.shard_group)"
            )
        self._check_scaler(scaler, state)
        if scaler is not None and not self.is_last:  # a torch.amp.GradScaler makes its scale
            scaler.scale(torch.zeros((), device=self._device()))  # in its first scale() call
        inputs, labels = batch
        actions = make_schedule(schedule, self.num_stages, self.stage_id, micro_batches)
        # Under ZeRO every backward but the stage's last runs in no_sync(); with tied weights
        # all of them do, and finalize_grads reduces the stage after their copies are summed.
        deferred = state is not None and bool(self.shared_groups)
        xs, ys = inputs.tensor_split(micro_batches), labels.tensor_split(micro_batches)
        weights = [len(y) / len(labels) for y in ys]  # mean over the batch from micro-batch means
        held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        losses: list[torch.Tensor] = []

        def forward(i: int) -> None:
            x = xs[i] if self.is_first else self._receive_activation()
            out = self.stage(x)
            if self.is_last:
                out = self.loss_fn(out, ys[i]) * weights[i]
                losses.append(out.detach())
                if scaler is not None:
                    out = scaler.scale(out)
            else:
                self.mailbox.send(out, self.stage_id + 1)
            held[i] = (x, out)

        def backward(i: int, last: bool) -> None:
            x, out = held.pop(i)
            quiet = state is not None and (not last or deferred)
            with self.stage.no_sync() if quiet else contextlib.nullcontext():
                grad = None if self.is_last else self._receive(self.stage_id + 1)
                torch.autograd.backward(out, grad)
            if not self.is_first:
                grad_in = x.grad if x.grad is not None else torch.zeros_like(x)
                self.mailbox.send(grad_in, self.stage_id - 1)

        execute(actions, forward, backward)
        self.mailbox.finish()
        tied = [(self._tied[k], group) for k, (group, _) in self.shared_groups.items()]
        finalize_grads(self.stage, tied, deferred)
        if isinstance(scaler, torch.amp.GradScaler):
            self._show_overflow(scaler)
        return self._global_loss(losses)

    def train_batch(
        self,
        batch: tuple[torch.Tensor, torch.Tensor],
        optimizer: torch.optim.Optimizer,
        schedule: str = "1f1b",
        micro_batches: int = 1,
        clip_norm: float | None = None,
        scaler=None,
    ) -> torch.Tensor:
        """One whole step, composed of the public calls a loop of one's own would make:
        ``forward_backward``; with a ``scaler``, ``scaler.unscale_(optimizer)``; with
        ``clip_norm``, ``zerokit.clip_grad_norm_(self, clip_norm)`` (the whole model's norm);
        ``scaler.step(optimizer)`` and ``scaler.update()`` (every stage skips together on an
        overflow anywhere), else ``optimizer.step()``; ``optimizer.zero_grad()``. Returns
        ``forward_backward``'s loss."""
        loss = self.forward_backward(batch, schedule, micro_batches, scaler=scaler)
        if scaler is not None:
            scaler.unscale_(optimizer)  # clip the true gradients
        if clip_norm is not None:
            clip_grad_norm_(self, clip_norm)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad()
        return loss

    @torch.no_grad()
    def eval_batch(
        self, batch: tuple[torch.Tensor, torch.Tensor], micro_batches: int = 1
    ) -> torch.Tensor:
        """The mean loss over the global batch, on every rank; no gradients, no step. The stage
        runs in eval mode (dropout off) and is put back in the mode it was in."""
        inputs, labels = batch
        xs, ys = inputs.tensor_split(micro_batches), labels.tensor_split(micro_batches)
        losses = []
        was_training = self.stage.training
        self.stage.eval()
        try:
            for x, y in zip(xs, ys):
                out = self.stage(x if self.is_first else self.mailbox.recv(self.stage_id - 1))
                if self.is_last:
                    losses.append(self.loss_fn(out, y) * (len(y) / len(labels)))
                else:
                    self.mailbox.send(out, self.stage_id + 1)
            self.mailbox.finish()
        finally:
            self.stage.train(was_training)
        return self._global_loss(losses)

    # -- helpers -------------------------------------------------------------------------------
    def _device(self) -> torch.device:
        return next((p.device for p in self.stage.parameters()), torch.device("cpu"))

    def _receive(self, stage: int) -> torch.Tensor:
        """What ``stage`` sent, on this stage's device (transfers are on the CPU; a dry run's
        stage is on meta)."""
        return self.mailbox.recv(stage).to(self._device())

    def _receive_activation(self) -> torch.Tensor:
        x = self._receive(self.stage_id - 1)
        return x.requires_grad_() if x.is_floating_point() else x

    def _data_groups(self) -> list[dist.ProcessGroup]:
        """The ranks that split the batch inside this stage (ZeRO's group and its replicas)."""
        if self.layout is None:
            return []
        groups = (self.layout.shard_group, self.layout.replica_group)
        return [g for g in groups if g is not None and g.size() > 1]

    def _data_size(self) -> int:
        return math.prod(g.size() for g in self._data_groups())

    def _global_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        total = torch.stack(losses).sum() if losses else torch.zeros(())
        total = total.detach().float()
        if self.num_stages > 1:
            dist.broadcast(
                hand(total), dist.get_global_rank(self.group, self.num_stages - 1), group=self.group
            )
        for group in self._data_groups():
            dist.all_reduce(hand(total), group=group)
        return total / self._data_size()

    def _check_scaler(self, scaler, state) -> None:
        if scaler is None:
            return
        if state is not None and not isinstance(scaler, ShardedGradScaler):
            raise TypeError(
                "the stage is wrapped by group_sharded_parallel: pass the scaler it returned "
                f"(a zerokit.ShardedGradScaler), not {type(scaler).__name__}"
            )
        if state is None and not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(
                "a stage not wrapped by group_sharded_parallel takes a torch.amp.GradScaler; "
                f"got {type(scaler).__name__} (a ShardedGradScaler needs a wrapped stage)"
            )

    def _show_overflow(self, scaler: torch.amp.GradScaler) -> None:
        """Note: torch's ``GradScaler`` decides to skip from the gradients its ``unscale_``
        sees, and has no public way to be told that another rank overflowed. So an inf/nan in
        any stage's gradients (or any tp rank's) is agreed here and written into this stage's
        first gradient as a nan: every stage's ``unscale_`` then finds one, ``step`` skips and
        ``update`` backs off alike on every stage. The step is skipped, so that gradient is
        never applied; ``zero_grad`` clears it."""
        if not scaler.is_enabled():
            return
        grads = [p.grad for p in self.stage.parameters() if p.grad is not None]
        groups = [self.group] if self.num_stages > 1 else []
        tp_group = tp_group_of(self.stage)
        if tp_group is not None:
            groups.append(tp_group)
        if agree_found_inf(grads, groups, self._device()) and grads:
            grads[0].fill_(float("nan"))

    def checkpoint_names(self) -> dict[str, tuple[str, bool]]:
        """For ``zerokit.checkpoint``: each parameter and buffer of this stage, by its name in
        ``self.stage``, -> (its name in the whole model's checkpoint, whether this stage writes
        it).

        The whole model's names are those of a one-stage ``PipelineModule``'s stage, that is of
        ``PipelineStage(layers, 0)``: ``layers.<i>.<param>`` by the layer's index in the whole
        list and ``shared.<key>.<param>`` for a ``SharedLayerDesc``, so they do not depend on
        the split. A shared layer on several stages is one layer of the whole model: the first
        of those stages writes it, every stage holding it loads it."""
        copies = {f"shared.{k}." for k, (_, first) in self.shared_groups.items() if not first}
        named = [
            *self.stage.named_parameters(remove_duplicate=False),
            *self.stage.named_buffers(remove_duplicate=False),
        ]
        return {
            name: (name, not any(name.startswith(prefix) for prefix in copies)) for name, _ in named
        }


def tie_across_stages(
    tied: dict[str, list[int]], weights: dict[str, nn.Parameter], stage_id: int, num_stages: int
) -> dict[str, tuple[dist.ProcessGroup, bool]]:
    """``tied``: each key of a weight held by several stages -> those stages, in order;
    ``weights``: this stage's copies. For each key, the group of this pipeline position's ranks
    on those stages (every rank creates every such group, in the same order: collective over
    the world), and whether this rank holds the first copy. Starts the copies equal: a
    broadcast from the first stage. Used by ``PipelineModule`` and ``split_model``."""
    stage_size = dist.get_world_size() // num_stages
    position = dist.get_rank() % stage_size
    mine = {}
    for key, where in tied.items():
        for c in range(stage_size):
            ranks = [s * stage_size + c for s in where]
            group = dist.new_group(ranks)
            if c == position and stage_id in where:
                mine[key] = (group, stage_id == where[0])
                with torch.no_grad():
                    dist.broadcast(hand(weights[key].data), ranks[0], group=group)
    return mine
