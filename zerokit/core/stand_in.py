"""A process group with no other ranks behind it, for ``zerokit plan``'s dry run.

One process plays one rank of an N-rank job: ``RecordingGroup`` is registered with
``torch.distributed`` as the backend ``"zerokit-plan"``, so ``init_process_group`` and
``new_group`` build it like any backend, and zerokit's real wrapping and step run against it
with the model on ``meta`` (no bytes). Each collective is recorded (op, group size, bytes of
the logical collective) and completes at once; its result is what it would be if every rank
held this rank's values: an all-gather fills every chunk with this rank's, any reduction and a
broadcast leave the tensor as it is (so a broadcast's receiver keeps its own values: an object
broadcast from another rank cannot be played). Only small control values are real (the order
digest, the has-gradient flags, agreement payloads): those answers let every check pass as on
a job whose ranks agree.

The core asks ``is_stand_in(group)`` where a dry run differs: ``core.agreement`` skips its
store meetings (every rank is this process); ``communication_device`` (the collectives' and
the state's) is the CPU, where control values live (the model is on meta); and
``group_sharded_parallel`` leaves a meta model on meta (no values to make).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.futures import Future

BACKEND = "zerokit-plan"


@dataclass(frozen=True)
class Call:
    """One collective as a rank issues it; ``bytes`` is the logical collective's tensor (an
    all-reduce's, a reduce-scatter's input, an all-gather's output, a point-to-point's)."""

    op: str
    group_size: int
    bytes: int
    phase: str
    dtype: torch.dtype


class _Done(dist.Work):
    """A finished collective: nothing to wait for."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def get_future(self) -> Future:
        future = Future()
        future.set_result(None)
        return future


class RecordingGroup(dist.ProcessGroup):
    """Rank ``rank`` of a group of ``size`` stand-in ranks; ``calls`` is its record, each
    call tagged with ``phase`` as the caller set it."""

    def __init__(self, rank: int, size: int, name: str):
        super().__init__(rank, size)
        self._rank, self._size, self._name = rank, size, name
        self.calls: list[Call] = []
        self.phase = ""

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    @property
    def group_name(self) -> str:  # the core keys its store records by it
        return self._name

    def getBackendName(self) -> str:
        return BACKEND

    def _record(self, op: str, tensors) -> _Done:
        nbytes = sum(t.nbytes for t in tensors)
        self.calls.append(Call(op, self._size, nbytes, self.phase, tensors[0].dtype))
        return _Done()

    def allreduce(self, tensors, opts=None):
        return self._record("all_reduce", tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors, opts=None):
        return self._record("broadcast", tensors)

    def reduce(self, tensors, opts=None):
        return self._record("reduce", tensors)

    def allgather(self, outputs, inputs, opts=None):
        for parts, mine in zip(outputs, inputs):
            if not mine.is_meta:  # a control value: every rank sent this rank's
                for part in parts:
                    part.copy_(mine)
        return self._record("all_gather", [p for parts in outputs for p in parts])

    def all_gather_single(self, output, input, opts=None):
        if not input.is_meta:
            output.view(self._size, -1).copy_(input.view(1, -1))
        return self._record("all_gather", [output])

    _allgather_base = all_gather_single

    def reduce_scatter_single(self, output, input, opts=None):
        if not input.is_meta:
            output.copy_(input.view(self._size, -1)[self._rank])
        return self._record("reduce_scatter", [input])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(self, outputs, input_lists, opts=None):
        for out, parts in zip(outputs, input_lists):
            if not out.is_meta:
                out.copy_(parts[self._rank])
        return self._record("reduce_scatter", [p for parts in input_lists for p in parts])

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self._record("all_to_all", [input])

    def alltoall(self, outputs, inputs, opts=None):
        for out in outputs:  # every rank sends this rank its chunk: this rank's own
            if not out.is_meta:
                out.copy_(inputs[self._rank])
        return self._record("all_to_all", inputs)

    def gather(self, output_lists, inputs, opts=None):
        for parts, mine in zip(output_lists, inputs):
            for part in parts:
                if not part.is_meta:
                    part.copy_(mine)
        return self._record("gather", inputs)

    def scatter(self, outputs, input_lists, opts=None):
        for out, parts in zip(outputs, input_lists):
            if parts and not out.is_meta:
                out.copy_(parts[self._rank])
        return self._record("scatter", outputs)

    def send(self, tensors, dst, tag=0):
        return self._record("send", tensors)

    def recv(self, tensors, src, tag=0):
        return self._record("recv", tensors)

    def barrier(self, opts=None):
        return _Done()


def is_stand_in(group) -> bool:
    """Is ``group`` a dry run's stand-in (no other ranks behind it)?"""
    return isinstance(group, RecordingGroup)


def _create(common, backend_options) -> RecordingGroup:
    return RecordingGroup(common.group_rank, common.group_size, common.group_id)


def register() -> None:
    """Make ``"zerokit-plan"`` a ``torch.distributed`` backend (once per process)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
