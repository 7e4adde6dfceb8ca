"""Bucketed gradient synchronisation during backward, shared by levels 'os' and 'os_g'.

Each trainable parameter gets a post-accumulate-grad hook. When every parameter of a bucket has
delivered its gradient, the bucket's collective is started asynchronously, so communication
overlaps the rest of backward. A callback queued on the autograd engine runs when backward
ends: it starts whatever buckets are left (parameters unused in this forward never fire their
hook), agrees across ranks on which parameters hold a gradient, waits for all the work and
publishes the reduced gradients to the optimizer's pieces.

Note: buckets are started strictly in one order (reverse registration order, which is roughly
the order backward produces them), never in arrival order. Every rank therefore issues the same
collectives in the same sequence even when a parameter is used on one rank and not on another.

Note: "holds a gradient" follows single-process semantics exactly. A parameter whose ``.grad``
would be None in single-process training of the global batch (unused on every rank since the
last ``zero_grad(set_to_none=True)``) keeps a None gradient on its pieces, so the optimizer
skips it (AdamW does not decay it). One small all-reduce (MAX of one byte per parameter) per
backward decides this.
"""

from __future__ import annotations

import enum

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.distributed import ProcessGroup

from .core.collectives import Pending, all_reduce_
from .core.flat_param import FlatParamBucket


class SyncState(enum.Enum):
    IDLE = "idle"  # no backward in flight: gradients are reduced (or empty)
    BACKWARD = "backward"  # a synchronised backward is delivering gradients


class BucketedGradSync:
    """Hooks, bucket readiness and launch order; subclasses say how a bucket is reduced."""

    #: most bucket collectives in flight at once (None: no bound); the oldest is finished
    #: before a new one starts
    max_in_flight: int | None = None

    def __init__(self, buckets: list[FlatParamBucket], group: ProcessGroup, sync_comm: bool):
        self.buckets = buckets
        self.group = group
        self.sync_comm = sync_comm
        self.sync_enabled = True  # False inside no_sync()
        self.state = SyncState.IDLE
        self._where = {
            id(p): (b, i) for b, bucket in enumerate(buckets) for i, p in enumerate(bucket.params)
        }
        # has_grad[b][i]: parameter i of bucket b holds a gradient (agreed across ranks)
        self.has_grad = [torch.zeros(len(b.params), dtype=torch.bool) for b in buckets]
        self._unsynced = False  # no_sync() gradients are waiting for a synchronised backward
        self._reset_backward()
        self._handles = [
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
            for bucket in buckets
            for p in bucket.params
        ]

    # -- what a level defines ---------------------------------------------------------------
    def _take_grad(self, b: int, i: int, param: nn.Parameter) -> bool:
        """Move ``param.grad`` into bucket ``b``'s reduction input; True if it contributed."""
        raise NotImplementedError

    def _start_reduce(self, b: int) -> Pending:
        raise NotImplementedError

    def _publish(self, b: int) -> None:
        """Expose the reduced gradients of bucket ``b`` (after ``has_grad`` is agreed)."""
        raise NotImplementedError

    def _zero(self, set_to_none: bool) -> None:
        raise NotImplementedError

    def grads_to_scale(self) -> list[torch.Tensor]:
        """Every gradient buffer a clip must scale so that all views of it stay consistent."""
        raise NotImplementedError

    # -- life cycle ---------------------------------------------------------------------------
    def _reset_backward(self) -> None:
        self._arrived = [set() for _ in self.buckets]
        self._contributed = [torch.zeros(len(b.params), dtype=torch.bool) for b in self.buckets]
        self._next_bucket = len(self.buckets) - 1
        self._in_flight: list[Pending] = []

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self.sync_enabled:
            self._unsynced = True
            return
        if self.state is SyncState.IDLE:
            self.state = SyncState.BACKWARD
            Variable._execution_engine.queue_callback(self._end_of_backward)
        b, i = self._where[id(param)]
        self._contributed[b][i] = self._take_grad(b, i, param)
        self._arrived[b].add(i)
        self._launch_ready_buckets(force=False)

    def _launch_ready_buckets(self, force: bool) -> None:
        while self._next_bucket >= 0:
            b = self._next_bucket
            missing = [i for i in range(len(self.buckets[b].params)) if i not in self._arrived[b]]
            if missing and not force:
                return
            for i in missing:  # unused in this forward, or accumulated under no_sync()
                self._contributed[b][i] = self._take_grad(b, i, self.buckets[b].params[i])
            if self.max_in_flight is not None:  # make room first, so its buffers are free
                while len(self._in_flight) >= self.max_in_flight:
                    self._in_flight.pop(0).finish()
            self._in_flight.append(self._start_reduce(b))
            self._next_bucket -= 1
            if self.sync_comm:
                self._in_flight.pop().finish()

    def _end_of_backward(self) -> None:
        self._launch_ready_buckets(force=True)
        # on the buckets' device: NCCL reduces CUDA tensors only
        device = self.buckets[0].data.device  # not shard_data's: offload keeps that on the CPU
        contributed = torch.cat(self._contributed).to(device=device, dtype=torch.uint8)
        all_reduce_(contributed, self.group, op=dist.ReduceOp.MAX)
        for pending in self._in_flight:
            pending.finish()
        contributed = contributed.cpu().bool().split([len(b.params) for b in self.buckets])
        for b in range(len(self.buckets)):
            self.has_grad[b] |= contributed[b]
            self._publish(b)
        self._reset_backward()
        self._unsynced = False
        self.state = SyncState.IDLE

    # -- what the optimizer and the user call -------------------------------------------------
    def check_ready_for_step(self) -> None:
        if self.state is not SyncState.IDLE:
            raise RuntimeError("optimizer.step() was called while a backward was still running")
        if self._unsynced:
            raise RuntimeError(
                "gradients accumulated under no_sync() were never reduced across ranks: run the "
                "last micro-batch's backward outside `with model.no_sync():` before step()"
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.check_ready_for_step()
        if set_to_none:
            for flags in self.has_grad:
                flags.zero_()
        self._zero(set_to_none)
        for bucket, flags in zip(self.buckets, self.has_grad):
            for piece, piece_grad in zip(bucket.pieces, bucket.param_pieces):
                if not flags[piece.slot]:
                    piece_grad.grad = None

    def owned_grad_pieces(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(parameter, gradient of this rank's piece of it): every element of the model once."""
        return [
            (bucket.params[piece.slot], view.grad)
            for bucket in self.buckets
            for piece, view in zip(bucket.pieces, bucket.param_pieces)
            if view.grad is not None
        ]

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
