"""One rank of an N-rank job, played in this process: zerokit's real wrapping and two real
training steps on a ``meta`` model, against stand-in process groups that record every
collective (``core.stand_in``). What ``zerokit plan`` reports is read from it: the memory
``zerokit.memory.measure`` counts after the second backward (the steady step: optimizer
state made by the first) and the collectives of that second step, from forward to
``optimizer.step()``.

Nothing is allocated for the model (meta storage has no bytes) and no other process runs; the
stand-in groups answer as if every rank held this rank's values (``core.stand_in``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..api import group_sharded_parallel
from ..config import ShardingConfig
from ..core import stand_in
from ..layout import init_hybrid_parallel
from ..memory import measure
from ..mixed_precision import MixedPrecision
from ..scaler import ShardedGradScaler, step_and_zero
from .plan_host_memory import host_memory_of
from .plan_moe import expert_dense_bytes, split_experts
from .plan_optimizers import OPTIMIZERS, as_list, step_flops
from .workload import Workload, as_workload, on_meta, tp_workload


@dataclass(frozen=True, kw_only=True)
class Job:
    """The job a rank belongs to (``zerokit.tools.plan.PlanConfig``'s degrees, resolved)."""

    world: int
    level: str
    tp: int
    degree: int
    """ZeRO's shard group size (hybrid: smaller than the data-parallel degree)."""
    seq: int
    rows: int
    """Rows of this rank's batch."""
    low: torch.dtype | None
    optimizer: str
    """A key of ``zerokit.tools.plan_optimizers.OPTIMIZERS``."""
    buffer_max_size: int
    segment_size: int
    pp: int = 1
    """Pipeline stages (``zerokit.tools.dry_run_pp`` plays a rank of one)."""
    whole_grads: bool = False
    """``ShardingConfig.whole_grads``: level 'os' all-reduces whole gradients."""
    over_replicas: bool = False
    """``ShardingConfig.shard_optimizer_over_replicas``: the optimizer state sharded over the
    replicas too."""
    ep: int = 1
    """Expert parallelism (``zerokit.tools.plan_moe``): the experts split over this many ranks."""
    moe_imbalance: float = 1.0
    """The routing assumed under ``ep``: max / mean tokens a rank receives."""


@dataclass(frozen=True)
class RankRun:
    """What rank ``rank`` held after the steady step's backward, and what it sent in it."""

    rank: int
    memory: dict[str, int]
    calls: list[tuple[str, stand_in.Call]]
    """(the group's role: "shard", "replicas", "tp", or a pipeline's: "send activations",
    "the loss, averaged", ... (``dry_run_pp``); the call), in the order issued."""
    flops: int = 0
    """The optimizer step's FLOPs on this rank (``zerokit.tools.plan_optimizers.FLOPS_RULE``)."""
    moe: dict | None = None
    """Under ``ep``: the experts' and the dense bytes (``plan_moe.expert_dense_bytes``)."""
    host: dict | None = None
    """The host memory of its checkpoint I/O (``plan_host_memory.host_memory_of``)."""


NO_VALUES = (
    "zerokit plan builds the model on tensors without values (the meta device, and fake "
    "tensors for the activations) and trains it there, so its forward must not read tensor "
    "values (.item(), a branch on a tensor) and the factory must not put parameters on an "
    "explicit device"
)


class DryRunError(ValueError):
    """The job could not be played: a process group is already initialised here, or the model
    does not run on ``meta`` (its forward reads values)."""


def run_rank(job: Job, rank: int, factory: Callable) -> RankRun:
    """Play rank ``rank`` of ``job``: build the model on meta, wrap it, train two steps.
    The process is left as it was found: no process group, the same excepthook and logger."""
    with stand_in_world(rank, job.world):
        try:
            return _play(job, rank, factory)
        except Exception as e:
            hint = f" {NO_VALUES}" if "meta" in str(e) else ""  # a value read, or a device
            raise DryRunError(
                f"playing rank {rank} of {job.world} failed: {type(e).__name__}: {e}.{hint}"
            ) from e


@contextlib.contextmanager
def stand_in_world(rank: int, world: int, backend: str = stand_in.BACKEND) -> Iterator[None]:
    """Within: this process is rank ``rank`` of ``world``, every process group (the world and
    those made inside, such as a layout's) a stand-in that records (``backend``: the core's,
    or a registered kind of it). After: no process group, and the process as it was found
    (``_left_as_found``)."""
    if dist.is_initialized():
        raise DryRunError(
            "zerokit plan plays each rank of its job in this process with stand-in process "
            "groups, so it needs a process without an initialised process group: call it "
            "before torch.distributed.init_process_group, or from a process of its own"
        )
    stand_in.register()
    with _left_as_found():
        try:
            dist.init_process_group(backend, store=dist.HashStore(), rank=rank, world_size=world)
            yield
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def _wrapped(job: Job, rank: int, factory: Callable):
    """The job's model on meta, wrapped as the real run wraps it: (roles of the groups by id,
    workload, model, optimizer, scaler or None, this rank's batch on meta)."""
    roles, kwargs, layout = job_groups(job, rank)
    work = _meta_workload(factory, job, layout)
    if job.ep > 1:  # the experts split, as the real run splits them before wrapping
        roles.update(split_experts(work.model, job.ep, job.moe_imbalance))
    opt = OPTIMIZERS[job.optimizer](work.model)
    model, opt, scaler = group_sharded_parallel(
        work.model, opt, job.level, buffer_max_size=job.buffer_max_size,
        segment_size=job.segment_size, mixed_precision=MixedPrecision(param_dtype=job.low),
        scaler=ShardedGradScaler() if job.low == torch.float16 else None,
        config=ShardingConfig(
            whole_grads=job.whole_grads, shard_optimizer_over_replicas=job.over_replicas
        ), **kwargs,
    )  # fmt: skip
    batch = tuple(t.to("meta") for t in work.make_batch(0, job.rows))
    return roles, work, model, opt, scaler, batch


def _play(job: Job, rank: int, factory: Callable) -> RankRun:
    roles, work, model, opt, scaler, (x, y) = _wrapped(job, rank, factory)
    for _step in range(2):  # the second step is the steady one
        for g in recording_groups():
            g.calls.clear()
        set_phase("forward")
        loss = work.loss_fn(model(x), y)
        set_phase("backward")
        (scaler.scale(loss) if scaler else loss).backward()
        held = measure(model, opt)
        moe = expert_dense_bytes(model, opt, held) if job.ep > 1 else None
        set_phase("step")
        with meta_scalars():
            step_and_zero(opt, scaler)
    calls = [(roles.get(id(g), "model"), c) for g in recording_groups() for c in g.calls]
    memory = {"params": held.params, "grads": held.grads, "optimizer": held.optimizer}
    host = host_memory_of(model, opt) if job.ep == 1 else None  # split experts: not saved
    return RankRun(rank, memory, calls, step_flops(as_list(opt)), moe, host)


#: how the micro-batches of an accumulated step are reduced: each one in full ("every"), the
#: cross-replica step deferred to the last ("defer": ``model.defer_replica_sync()``), nothing
#: but the last ("no_sync": ``model.no_sync()``)
ACCUMULATION_MODES = ("every", "defer", "no_sync")


@dataclass(frozen=True)
class AccumulatedStep:
    """What one rank sent in a steady step of several micro-batches, and held between them."""

    micro_batches: list[list[tuple[str, stand_in.Call]]]
    """Per micro-batch, forward and backward: (the group's role, the call), as issued."""
    step: list[tuple[str, stand_in.Call]]
    """The optimizer step's (after the last micro-batch)."""
    grads_between: int
    """Gradient bytes held after the first micro-batch (``measure``'s: zerokit's buffers and
    every ``.grad``)."""


def run_accumulation(job: Job, rank: int, factory: Callable, k: int, mode: str):
    """Play rank ``rank`` of ``job`` for two steps of ``k`` micro-batches each, reduced as
    ``mode`` says (``ACCUMULATION_MODES``); the second step's ``AccumulatedStep``."""
    with stand_in_world(rank, job.world):
        try:
            return _play_accumulation(job, rank, factory, k, mode)
        except Exception as e:
            raise DryRunError(
                f"playing rank {rank} of {job.world} ({k} micro-batches, {mode}) failed: "
                f"{type(e).__name__}: {e}"
            ) from e


def _play_accumulation(job: Job, rank: int, factory: Callable, k: int, mode: str):
    roles, work, model, opt, scaler, (x, y) = _wrapped(job, rank, factory)
    scopes = {"every": contextlib.nullcontext, "defer": model.defer_replica_sync}
    scope = scopes.get(mode, model.no_sync)
    for _step in range(2):  # the second step is the steady one
        micro, grads = [], 0
        for m in range(k):
            for g in recording_groups():
                g.calls.clear()
            with scope() if m < k - 1 else contextlib.nullcontext():
                set_phase("forward")
                loss = work.loss_fn(model(x), y)
                set_phase("backward")
                (scaler.scale(loss) if scaler else loss).backward()
            micro.append(_calls(roles))
            if m == 0:
                grads = measure(model, opt).grads  # .grad and zerokit's buffers
        for g in recording_groups():
            g.calls.clear()
        set_phase("step")
        with meta_scalars():
            step_and_zero(opt, scaler)
        step = _calls(roles)
    return AccumulatedStep(micro, step, grads)


def _calls(roles: dict[int, str]) -> list[tuple[str, stand_in.Call]]:
    return [(roles.get(id(g), "model"), c) for g in recording_groups() for c in g.calls]


def job_groups(job: Job, rank: int) -> tuple[dict[int, str], dict, object]:
    """The job's groups as the real run builds them: each one's role (by id), the keywords
    for ``group_sharded_parallel`` and the layout (None without tp, pp or hybrid sharding)."""
    dp = job.world // (job.tp * job.pp)
    layout = None
    if job.degree < dp and job.degree > 1:
        layout = init_hybrid_parallel(
            dp // job.degree, job.tp, sharding_degree=job.degree, pp_degree=job.pp
        )
        shard, replicas = layout.sharding_group, layout.dp_group
    else:
        if job.tp > 1 or job.pp > 1:
            layout = init_hybrid_parallel(dp, job.tp, pp_degree=job.pp)
        data = layout.dp_group if layout is not None else dist.group.WORLD
        # ZeRO over one rank (--sharding-degree 1): each rank alone, replicated over the rest
        shard, replicas = (data, None) if job.degree == dp else (dist.new_group([rank]), data)
    roles = {id(shard): "shard"}
    kwargs = {"group": shard}
    if replicas is not None:
        roles[id(replicas)] = "replicas"
        kwargs["dp_group"] = replicas
    if job.tp > 1:
        roles[id(layout.tp_group)] = "tp"
    return roles, kwargs, layout


def _meta_workload(factory: Callable, job: Job, layout) -> Workload:
    """The model on ``meta`` (the tp rank's, with a layout), as its factory builds it."""
    torch.manual_seed(0)
    with on_meta():
        plain = as_workload(factory() if job.tp == 1 else factory(layout=None), job.seq)
        if job.tp == 1:
            return plain
        return tp_workload(factory, layout, plain)


def recording_groups() -> list[stand_in.RecordingGroup]:
    """Every stand-in group this rank belongs to."""
    groups = dist.distributed_c10d._world.pg_map  # torch's registry of this process's groups
    return [g for g in groups if stand_in.is_stand_in(g)]


def set_phase(phase: str) -> None:
    for g in recording_groups():
        g.phase = phase


@contextlib.contextmanager
def meta_scalars() -> Iterator[None]:
    """Within: ``.item()`` of a meta tensor is 1.0. Some optimizers read scalars in their step
    (Adafactor: its step count and the parameter's norm, for the step size); on meta there are
    no values, and the step's shapes, state and collectives do not depend on them."""
    item = torch.Tensor.item

    def meta_item(t: torch.Tensor):
        return 1.0 if t.is_meta else item(t)

    torch.Tensor.item = meta_item
    try:
        yield
    finally:
        torch.Tensor.item = item


@contextlib.contextmanager
def _left_as_found() -> Iterator[None]:
    """Within: no wrap log line per played rank; after: the ``zerokit`` logger, the
    excepthook (``init_process_group`` prefixes it with the rank) and
    ``$TORCH_DIST_INIT_BARRIER`` (a store barrier would wait for ranks that never come) as
    they were."""
    log = logging.getLogger("zerokit")
    saved = (log.level, list(log.handlers), log.propagate, sys.excepthook)
    barrier = os.environ.pop("TORCH_DIST_INIT_BARRIER", None)
    log.setLevel(max(log.level, logging.WARNING))
    try:
        yield
    finally:
        level, log.handlers[:], log.propagate, sys.excepthook = saved
        log.setLevel(level)
        if barrier is not None:
            os.environ["TORCH_DIST_INIT_BARRIER"] = barrier
