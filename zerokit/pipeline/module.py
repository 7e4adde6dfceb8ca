"""``PipelineModule``: a model given as a list of layer descriptions, split by depth across the
stages of a pipeline; this rank builds and runs only its own stage.

>>> import torch
>>> from torch import nn
>>> pipe = PipelineModule([LayerDesc(nn.Linear, 4, 8), nn.Tanh(), LayerDesc(nn.Linear, 8, 1)],
...                       loss_fn=nn.functional.mse_loss)  # one stage: no process group needed
>>> opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
>>> x, y = torch.randn(6, 4), torch.randn(6, 1)
>>> loss = pipe.train_batch((x, y), opt, schedule="1f1b", micro_batches=3)
>>> loss.shape
torch.Size([])
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..core.collectives import all_reduce_
from ..core.state import state_of
from ..core.teardown import hand
from ..layout import Layout, as_layout
from ..tensor_parallel.gather_batch import distributed_params
from ..tensor_parallel.layers import (
    allreduce_sequence_parallel_grads,
    tp_group_of,
)
from .describe import LayerDesc, SharedLayerDesc
from .p2p import Mailbox
from .partition import partition as split_layers
from .schedules import execute
from .schedules import schedule as make_schedule


class PipelineStage(nn.Module):
    """One stage's layers, run in order. Layers are named by their index in the whole model
    (``layers.<i>``), shared ones by key (``shared.<key>``), so names do not depend on the
    split. This is the module to wrap with ``group_sharded_parallel``."""

    def __init__(self, items: Sequence[object], first_index: int):
        super().__init__()
        self.layers = nn.ModuleDict()
        self.shared = nn.ModuleDict()
        self._runs: list[tuple[str, str, Callable | None]] = []  # (where, name, forward_func)
        for offset, item in enumerate(items):
            name = str(first_index + offset)
            if isinstance(item, SharedLayerDesc):
                if item.key not in self.shared:
                    self.shared[item.key] = item.build()
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

    def forward(self, x):
        for where, name, func in self._runs:
            if where == "function":
                x = func(x)
            else:
                layer = getattr(self, where)[name]
                x = func(layer, x) if func is not None else layer(x)
        return x


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
        self.stage = PipelineStage(layers[start:end], start)
        self.mailbox = Mailbox(self.group, self.stage_id, self.num_stages)
        self.shared_groups = self._tie(layers)
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

    def _tie(self, layers: list[object]) -> dict[str, tuple[dist.ProcessGroup, bool]]:
        """For each shared key on several stages, the group of this pipeline position's ranks
        on those stages (every rank creates every such group, in order), and whether this rank
        holds the first copy. Starts the copies equal: broadcast from the first stage."""
        stages: dict[str, list[int]] = {}
        for i, item in enumerate(layers):
            if isinstance(item, SharedLayerDesc):
                s = self._stage_of(i)
                if s not in stages.setdefault(item.key, []):
                    stages[item.key].append(s)
        tied = {k: v for k, v in sorted(stages.items()) if len(v) > 1}
        if not tied:
            return {}
        stage_size = dist.get_world_size() // self.num_stages
        position = dist.get_rank() % stage_size
        mine = {}
        for key, where in tied.items():
            for c in range(stage_size):
                ranks = [s * stage_size + c for s in where]
                group = dist.new_group(ranks)
                if c == position and self.stage_id in where:
                    mine[key] = (group, self.stage_id == where[0])
                    weight = getattr(self.stage.shared[key], self._shared_attr(layers, key))
                    with torch.no_grad():
                        dist.broadcast(hand(weight.data), ranks[0], group=group)
        return mine

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

    def train_batch(
        self,
        batch: tuple[torch.Tensor, torch.Tensor],
        optimizer: torch.optim.Optimizer,
        schedule: str = "1f1b",
        micro_batches: int = 1,
        clip_norm: float | None = None,
        scaler=None,
    ) -> torch.Tensor:
        """One whole step on this rank's ``(inputs, labels)``: forward and backward of every
        micro-batch in the schedule's order, tied gradients summed across stages, optional
        clipping to a global norm ``clip_norm``, ``optimizer.step()``, ``optimizer.zero_grad()``.
        Returns the mean loss over the global batch (every data-parallel rank's), on every rank.
        Collective over every rank of the layout.

        Tensor-parallel layers inside a stage: the norm counts each element once (replicated
        parameters on tp rank 0), and a stage not wrapped by ZeRO has its ``sequence_parallel``
        marked gradients summed over the tp group (ZeRO does that for a wrapped one).

        ``scaler`` (fp16): the one ``group_sharded_parallel`` returned for a wrapped stage (a
        ``zerokit.ShardedGradScaler``), or a ``torch.amp.GradScaler`` for a stage not wrapped.
        The last stage's loss is scaled for backward, the gradients unscaled before clipping,
        and whether any is inf/nan is agreed over the pipeline too: every stage skips the step
        together, and the scaler is updated. The returned loss is unscaled."""
        state = state_of(self.stage)
        if state is None and self._data_size() > 1:
            raise RuntimeError(
                "the layout has data-parallel ranks: wrap the stage first, "
                "zerokit.group_sharded_parallel(pipe.stage, opt, level, group=layout.dp_group)"
            )
        self._check_scaler(scaler, state)
        if scaler is not None and not self.is_last:  # a torch.amp.GradScaler makes its scale
            scaler.scale(torch.zeros((), device=self._device()))  # in its first scale() call
        inputs, labels = batch
        actions = make_schedule(schedule, self.num_stages, self.stage_id, micro_batches)
        # Under ZeRO every backward but the stage's last runs in no_sync(); with tied weights
        # all of them do, and the stage is reduced after their copies' gradients are summed.
        reduce_after = state is not None and bool(self.shared_groups)
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
            quiet = state is not None and (not last or reduce_after)
            with self.stage.no_sync() if quiet else contextlib.nullcontext():
                grad = None if self.is_last else self.mailbox.recv(self.stage_id + 1)
                torch.autograd.backward(out, grad)
            if not self.is_first:
                grad_in = x.grad if x.grad is not None else torch.zeros_like(x)
                self.mailbox.send(grad_in, self.stage_id - 1)

        execute(actions, forward, backward)
        self.mailbox.finish()
        if state is None:  # a wrapped stage's marked gradients are summed over tp by ZeRO
            allreduce_sequence_parallel_grads(self.stage)
        self._sum_tied_grads(state)
        if reduce_after:
            self.stage.reduce_gradients()
        if scaler is not None:
            self._unscale(scaler, optimizer, state)
        if clip_norm is not None:
            self._clip(clip_norm, state)
        if scaler is not None:
            scaler.step(optimizer)  # skipped on every rank when any rank found inf/nan
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad()
        return self._global_loss(losses)

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

    def _receive_activation(self) -> torch.Tensor:
        x = self.mailbox.recv(self.stage_id - 1)
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

    def _sum_tied_grads(self, state) -> None:
        """Note: the copies of a tied weight are separate parameters on separate stages, each
        given the gradient of its own uses; one process's gradient is their sum."""
        if not self.shared_groups:
            return
        # Under ZeRO the gradients are still autograd's full tensors (every backward ran in
        # no_sync()); the stage reduces them across its data-parallel ranks afterwards.
        buckets = state.buckets if state is not None else []
        shapes = {id(p): s.shape for b in buckets for p, s in zip(b.params, b.layout.slots)}
        for key, (group, _) in self.shared_groups.items():
            weight = self._tied[key]
            if weight.grad is None:  # full shape even where ZeRO left the parameter empty
                shape = shapes.get(id(weight), weight.shape)
                weight.grad = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
            dist.all_reduce(hand(weight.grad), group=group)

    def _check_scaler(self, scaler, state) -> None:
        if scaler is None:
            return
        if state is not None and not hasattr(scaler, "_found_inf"):
            raise TypeError(
                "the stage is wrapped by group_sharded_parallel: pass the scaler it returned "
                "(a zerokit.ShardedGradScaler), not "
                f"{type(scaler).__name__}"
            )
        if state is None and not hasattr(scaler, "_per_optimizer_states"):
            raise TypeError(
                "a stage not wrapped by group_sharded_parallel takes a torch.amp.GradScaler; "
                f"got {type(scaler).__name__} (a ShardedGradScaler needs a wrapped stage)"
            )

    def _unscale(self, scaler, optimizer, state) -> None:
        """``scaler.unscale_(optimizer)``, then the found-inf flag agreed over the pipeline (and
        for a stage not wrapped, its tp group), written back where ``scaler.step`` reads it."""
        if not scaler.is_enabled():
            return
        scaler.unscale_(optimizer)  # a wrapped stage's: agreed over its ZeRO, replica, tp groups
        groups = [self.group] if self.num_stages > 1 else []
        if state is not None:
            found = torch.tensor(float(scaler._found_inf[id(optimizer)]))
        else:  # torch.amp.GradScaler: this rank's flags, one per device
            flags = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
            found = torch.zeros(())
            for flag in flags.values():
                found = torch.maximum(found, flag.detach().float().cpu())
            tp_group = tp_group_of(self.stage)
            if tp_group is not None:
                groups.append(tp_group)
        for group in groups:
            all_reduce_(found, group, op=dist.ReduceOp.MAX)
        if state is not None:
            scaler._found_inf[id(optimizer)] = bool(found.item())
        else:
            for flag in flags.values():
                flag.fill_(found.item())

    def _clip(self, max_norm: float, state) -> None:
        """Clip to the norm of the whole model's gradient: each stage's norm as
        ``zerokit.clip_grad_norm_`` counts it (every element once: ZeRO's owned pieces, a
        replicated parameter of a tensor-parallel stage on tp rank 0 only, summed over the ZeRO
        and tp groups), squared and summed over the pipeline; a tied weight is counted on its
        first stage only (a later copy's square, counted the same way, is taken out)."""
        skip = {id(self._tied[k]) for k, (_, first) in self.shared_groups.items() if not first}
        tp_group = state.tp_group if state is not None else tp_group_of(self.stage)
        if state is None and tp_group is None:  # a plain stage
            grads = [p.grad for p in self.stage.parameters() if p.grad is not None]
            square = torch.zeros((), dtype=torch.float64, device=self._device())
            for p in self.stage.parameters():
                if p.grad is not None and id(p) not in skip:
                    square += p.grad.double().pow(2).sum()
            to_scale = grads
        else:
            from ..clip import clip_grad_norm_, counted_grads

            # max_norm=inf: the norm, every gradient scaled by 1
            square = clip_grad_norm_(self.stage, float("inf")).double() ** 2
            owned, groups, to_scale = counted_grads(self.stage, state, tp_group)
            if state is not None:  # rank-local parameters: clip_grad_norm_ counted them too
                to_scale += [
                    d.param.grad
                    for d in distributed_params(self.stage).values()
                    if d.param.grad is not None
                ]
            copy = torch.zeros((), dtype=torch.float64, device=square.device)
            for param, grad in owned:
                if id(param) in skip:
                    copy += grad.double().pow(2).sum().to(square.device)
            if skip:  # over the groups the norm was summed over: the same sum on every rank
                for group in groups:
                    all_reduce_(copy, group)
            square = square - copy
        if self.num_stages > 1:
            all_reduce_(square, self.group)
        coef = (max_norm / (square.clamp(min=0).sqrt() + 1e-6)).clamp(max=1.0)
        for g in to_scale:
            g.mul_(coef.to(device=g.device, dtype=g.dtype))

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
