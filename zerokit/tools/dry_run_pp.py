"""One rank of a pipeline job (``zerokit plan --pp``), played as ``dry_run`` plays a rank: the
model's layers (``models.gpt.gpt_layers``) as a ``PipelineModule`` on ``meta``, this rank's
stage wrapped by ``group_sharded_parallel`` over the stage's data-parallel ranks, and two
steps of ``forward_backward`` and ``optimizer.step()``, all against stand-in groups.

A point-to-point receive needs an answer the core's stand-in cannot give: the header saying
what comes (dtype and shape). ``PipelineStandIn`` gives it. Activations flow to later stages
and their gradients back, so a receive from an earlier stage is answered with the headers that
stage sent when it was played (the stages are played in order), and a receive from a later
stage with the headers this rank sent to it (a gradient is shaped as its activation).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import ClassVar

import torch
import torch.distributed as dist

from ..api import group_sharded_parallel
from ..core import stand_in
from ..memory import measure
from ..mixed_precision import MixedPrecision
from ..models.gpt import gpt_layers
from ..pipeline import PipelineModule
from ..scaler import step_and_zero
from .dry_run import (
    NO_VALUES,
    DryRunError,
    Job,
    RankRun,
    job_groups,
    meta_scalars,
    recording_groups,
    set_phase,
    stand_in_world,
)
from .plan_optimizers import OPTIMIZERS, as_list, step_flops
from .workload import as_workload, on_meta

BACKEND = "zerokit-plan-pipeline"
_ISSUED = itertools.count()  # the order of calls across groups
_HEADER = (torch.int64, 10)  # pipeline/p2p.py: dtype, ndim and up to 8 sizes, before a tensor


class PipelineStandIn(stand_in.RecordingGroup):
    """The core's stand-in, with point-to-point receives answered (see the module's doc) and
    each transfer told apart by its direction."""

    headers: ClassVar[dict[tuple[int, int], list[list[int]]]] = {}
    """(from stage, to stage) -> the headers sent, in order: what the played ranks post
    (``open_pipeline`` empties it for each job)."""

    def __init__(self, rank: int, size: int, name: str):
        super().__init__(rank, size, name)
        self.labels: dict[int, str] = {}  # index in ``calls`` -> what the call is for
        self.issued: list[int] = []  # each call's place among every group's calls
        self._received: dict[int, int] = {}  # source -> receives from it in this step
        self._posted: set[tuple[int, int]] = set()

    def start_step(self) -> None:
        """A new step: the record, and what this rank posted, start again."""
        self.calls.clear()
        self.labels.clear()
        self.issued.clear()
        self._received.clear()
        for key in self._posted:
            self.headers[key] = []

    def _record(self, op: str, tensors):
        self.issued.append(next(_ISSUED))
        return super()._record(op, tensors)

    def send(self, tensors, dst, tag=0):
        header = _is_header(tensors[0])
        if header:
            self._posted.add((self._rank, dst))
            self.headers.setdefault((self._rank, dst), []).append(tensors[0].tolist())
        what = "send activations" if dst > self._rank else "send gradients"
        return self._labelled(super().send(tensors, dst, tag), what, header)

    def recv(self, tensors, src, tag=0):
        # a transfer is a header then its tensor (a CPU tensor too, made from the header)
        k = self._received.get(src, 0)
        self._received[src] = k + 1
        header, k = k % 2 == 0, k // 2
        if header:
            posted = (src, self._rank) if src < self._rank else (self._rank, src)
            tensors[0].copy_(torch.tensor(self.headers[posted][k]))
        what = "receive activations" if src < self._rank else "receive gradients"
        return self._labelled(super().recv(tensors, src, tag), what, header)

    def allreduce(self, tensors, opts=None):
        work = super().allreduce(tensors, opts)
        if tensors[0].dim() == 0 and tensors[0].is_floating_point():
            # the pipeline's mean loss (the core reduces flat buckets and integer flags)
            self.labels[len(self.calls) - 1] = "the loss, averaged"
        return work

    def broadcast(self, tensors, opts=None):
        work = super().broadcast(tensors, opts)
        if tensors[0].dim() == 0:  # the only broadcast of a step: the loss, to every stage
            self.labels[len(self.calls) - 1] = "the loss, from the last stage"
        return work

    def _labelled(self, work, what: str, header: bool):
        self.labels[len(self.calls) - 1] = f"{what} (header)" if header else what
        return work


def _is_header(t: torch.Tensor) -> bool:
    """A header sent: the only real tensor a stage on meta sends."""
    return not t.is_meta and (t.dtype, t.numel()) == _HEADER


def _create(common, backend_options) -> PipelineStandIn:
    return PipelineStandIn(common.group_rank, common.group_size, common.group_id)


def open_pipeline() -> None:
    """Register the backend (once per process) and empty the posted headers: a new job."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
    PipelineStandIn.headers = {}


def run_stage_rank(
    job: Job, rank: int, factory: Callable, schedule: str, micro_batches: int
) -> RankRun:
    """Play rank ``rank`` of the pipeline ``job`` (every stage before its own played first,
    after ``open_pipeline``): build the pipeline on meta, wrap the stage, train two steps."""
    with stand_in_world(rank, job.world, BACKEND):
        try:
            return _play(job, rank, factory, schedule, micro_batches)
        except Exception as e:
            hint = f" {NO_VALUES}" if "meta" in str(e) else ""
            raise DryRunError(
                f"playing rank {rank} of {job.world} failed: {type(e).__name__}: {e}.{hint}"
            ) from e


def _play(job: Job, rank: int, factory: Callable, schedule: str, micro_batches: int) -> RankRun:
    roles, kwargs, layout = job_groups(job, rank)
    torch.manual_seed(0)
    with on_meta():
        work = as_workload(factory(), job.seq)
        pipe = PipelineModule(gpt_layers(work.model.cfg), work.loss_fn, layout=layout)
    for group, _ in pipe.shared_groups.values():
        roles[id(group)] = "sum tied weights' gradients"
    opt = OPTIMIZERS[job.optimizer](pipe.stage)
    _, opt, _ = group_sharded_parallel(
        pipe.stage, opt, job.level, buffer_max_size=job.buffer_max_size,
        segment_size=job.segment_size, mixed_precision=MixedPrecision(param_dtype=job.low),
        **kwargs,
    )  # fmt: skip
    _mark_phases(pipe)
    x, y = (t.to("meta") for t in work.make_batch(0, job.rows))
    for _step in range(2):  # the second step is the steady one
        for g in recording_groups():
            g.start_step()
        pipe.forward_backward((x, y), schedule, micro_batches)
        held = measure(pipe.stage, opt)
        set_phase("step")
        with meta_scalars():
            step_and_zero(opt, None)
    issued = [
        (g.issued[i], g.labels.get(i) or roles.get(id(g), "model"), c)
        for g in recording_groups()
        for i, c in enumerate(g.calls)
    ]
    calls = [(role, c) for _, role, c in sorted(issued, key=lambda t: t[0])]  # as issued
    memory = {"params": held.params, "grads": held.grads, "optimizer": held.optimizer}
    return RankRun(rank, memory, calls, step_flops(as_list(opt)))


def _mark_phases(pipe: PipelineModule) -> None:
    """The recorded phase follows the stage: "forward" from each forward's start (a hook put
    before zerokit's), "backward" from the first step of the stage's backward (a marker put
    on the output after zerokit's hooks, so its backward runs before theirs). Call it after
    wrapping."""

    def forward(module, args):
        set_phase("forward")

    def mark_output(module, args, output):
        if isinstance(output, torch.Tensor) and output.requires_grad:
            return _BackwardStarts.apply(output)
        return output

    pipe.stage.register_forward_pre_hook(forward, prepend=True)
    pipe.stage.register_forward_hook(mark_output)


class _BackwardStarts(torch.autograd.Function):
    """The identity; its backward marks the phase "backward"."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        set_phase("backward")
        return grad
