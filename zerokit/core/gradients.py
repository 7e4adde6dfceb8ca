"""Where one unit group's gradients live between backward and step: full or sharded.

* ``FullGradients`` (level 'os' with ``whole_grads=True``): a full-size gradient per bucket,
  averaged in place by an all-reduce. ``param.grad`` is a view of it where that is the very
  memory the optimizer steps from (so autograd accumulates straight into the bucket and
  torch's clip on it is exact).
* ``ScatteredGradients`` ('os' by default, the ZeRO paper's stage 1): the same full-size
  gradient per bucket, but reduce-scattered: only this rank's chunk of it is averaged.
* ``ShardedGradients`` ('os_g', 'p_g_os'): only this rank's shard of each bucket's gradient
  persists. During backward the parameters' gradients are staged into a full-size buffer from
  the ``StagingPool``, which the reduce-scatter reads (and, hybrid, then all-reduces the shard
  across replicas: ``ReduceScatterThenAllReduce``); the staging goes back to the pool.

``core/build.py`` picks one class per model, once; a ``UnitGroup`` holds one instance and
never asks which. Each owns its buffers, makes ``param.grad`` what it should be after a
backward (``publish``) and says which buffers hold a parameter's gradient (``parts``), for a
``GradPlaceholder`` where torch cannot read one tensor.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from .collectives import Pending
from .flat_param import FlatParamBucket
from .grad_placeholder import GradPlaceholder
from .reduction import AllReduce, ReduceScatter
from .staging import StagingPool


def clear_own_grads(params, set_to_none: bool) -> None:
    """Parameters in no bucket (rank-local) keep their own ``.grad``: cleared as torch's
    ``zero_grad`` clears it."""
    for param in params:
        if param.grad is None:
            continue
        if set_to_none:
            param.grad = None
        else:
            param.grad.detach_().zero_()


class _Gradients:
    """What both ways share: the buckets, the reduce dtype and the pieces' gradients."""

    #: why ``param.grad`` is a placeholder where it is one (``GradPlaceholder``'s errors)
    placeholder_reason = ""

    def __init__(self, buckets: list[FlatParamBucket], reduce_dtype: torch.dtype | None):
        self.buckets = buckets
        self._reduce_dtype = reduce_dtype
        # Persistent gradient per bucket (full, or this rank's shard); None until the first
        # reduction after zero_grad(set_to_none=True), which frees it (torch's contract).
        self.grads: list[torch.Tensor | None] = [None] * len(buckets)
        self._placeholders: dict[tuple[int, int], GradPlaceholder] = {}

    def _dtype(self, b: int) -> torch.dtype:
        return self._reduce_dtype or self.buckets[b].data.dtype

    def staging_requests(self) -> list[tuple[int, torch.dtype]]:
        """What one reduction of every bucket asks the staging pool for: (elements, dtype)."""
        return []

    def publish(self, b: int, flags: list[bool], owner) -> None:
        """Reductions are done: ``param.grad`` and the pieces' ``.grad`` as the step reads
        them (``flags[i]``: parameter ``i`` holds a gradient on some rank)."""
        bucket = self.buckets[b]
        for i, param in enumerate(bucket.params):
            if not flags[i]:
                param.grad = None
                continue
            grad = self._param_grad(b, i)
            param.grad = grad if grad is not None else self._placeholder(b, i, owner)
        shard = self._pieces_source(b)
        views = bucket.piece_views(shard) if shard is not None else [None] * len(bucket.pieces)
        for piece, piece_param, view in zip(bucket.pieces, bucket.param_pieces, views):
            piece_param.grad = view if view is not None and flags[piece.slot] else None

    def _placeholder(self, b: int, i: int, owner) -> GradPlaceholder:
        """Made once per parameter and published again at every step (it reads its parts when
        used), not rebuilt per parameter per step."""
        made = self._placeholders.get((b, i))
        if made is None or made._owner is not owner:
            made = self._placeholders[(b, i)] = self._new_placeholder(b, i, owner)
        return made

    def _new_placeholder(self, b: int, i: int, owner) -> GradPlaceholder:
        ref = weakref.ref(self)  # param -> .grad -> self -> param would be a cycle

        def parts() -> list[torch.Tensor]:
            holder = ref()
            return [] if holder is None else holder.parts(b, i)

        param = self.buckets[b].params[i]
        return GradPlaceholder(param, parts, owner, self.placeholder_reason)

    def _piece_grads(self, b: int, i: int) -> list[torch.Tensor]:
        bucket = self.buckets[b]
        return [
            view.grad
            for piece, view in zip(bucket.pieces, bucket.param_pieces)
            if piece.slot == i and view.grad is not None
        ]

    def zero(self, set_to_none: bool) -> None:
        if set_to_none:
            self.grads = [None] * len(self.buckets)  # freed: torch's contract lowers memory
            return
        for grad in self.buffers():
            grad.zero_()

    def buffers(self) -> list[torch.Tensor]:
        """Every gradient buffer a clip or unscale must scale so all views stay consistent."""
        return [g for g in self.grads if g is not None]

    def zero_slots(self, b: int, slots: set[int]) -> None:
        """Zero, in place, where parameters ``slots`` of bucket ``b`` hold their gradient."""
        bucket = self.buckets[b]
        for piece, view in zip(bucket.pieces, bucket.param_pieces):
            if piece.slot in slots and view.grad is not None:
                view.grad.zero_()


class FullGradients(_Gradients):
    """Level 'os': every rank keeps each bucket's full averaged gradient."""

    def __init__(
        self,
        buckets: list[FlatParamBucket],
        reduction: AllReduce,
        staging: StagingPool,  # unused: the full gradient is the reduction's buffer
        *,
        reduce_dtype: torch.dtype | None = None,
        tp_group=None,
        defer_staging: bool = False,  # unused: nothing is staged
    ):
        super().__init__(buckets, reduce_dtype)
        self._reduction = reduction
        self._tp_group = tp_group
        # under mixed precision or offload: copies of the shard for the fp32 master pieces
        self._master_grads: list[torch.Tensor | None] = [None] * len(buckets)
        self.placeholder_reason = (
            "this rank holds a tensor-parallel slice of the gradient"
            if tp_group is not None and tp_group.size() > 1
            else "the gradient the optimizer steps from is in another dtype or device than "
            "the parameter (mixed precision or offload)"
        )

    def _full(self, b: int) -> torch.Tensor:
        if self.grads[b] is None:
            # unfilled but the padding: every slot is written (a gradient, or zeros for a
            # parameter without one: take) before the bucket is reduced
            bucket = self.buckets[b]
            layout = bucket.layout
            full = torch.empty(layout.padded_numel, dtype=self._dtype(b), device=bucket.data.device)
            full[layout.numel :].zero_()
            self.grads[b] = full
        return self.grads[b]

    def _aliases_param(self, b: int) -> bool:
        """Can ``param.grad`` be a view of the full gradient, the very memory the optimizer
        steps from? Not under mixed precision or offload (the gradient or the masters are in
        another dtype or device), nor under tensor parallelism (a gradient is a slice, so
        torch's clip would count only this rank's): then it is a ``GradPlaceholder``."""
        bucket, dtype = self.buckets[b], self._dtype(b)
        return (
            (dtype, bucket.data.device) == (bucket.shard_data.dtype, bucket.shard_data.device)
            and dtype == bucket.data.dtype
            and (self._tp_group is None or self._tp_group.size() == 1)
        )

    def take(self, b: int, i: int, param: nn.Parameter, accumulated: bool) -> bool:
        """Parameter ``i``'s gradient of this backward into the full gradient; ``accumulated``:
        the slot holds reduced gradients since ``zero_grad``. Did it have one?"""
        slot = self.buckets[b].slot_view(self._full(b), i)
        grad, alias = param.grad, self._aliases_param(b)
        if grad is None:
            if not (accumulated and not alias):
                slot.zero_()
            return False
        if same_memory(grad, slot):  # autograd accumulated into the bucket itself
            return True
        if accumulated and not alias:
            slot.add_(grad)  # mixed precision: the slot cannot be param.grad, so add here
        else:
            slot.copy_(grad)
        param.grad = slot if alias else None  # later backwards accumulate into the bucket
        return True

    def add(self, b: int, i: int, param: nn.Parameter) -> None:
        """A second delivery in one backward (a reentrant checkpoint): add it."""
        slot = self.buckets[b].slot_view(self._full(b), i)
        if not same_memory(param.grad, slot):  # else autograd added into the slot
            slot.add_(param.grad)
        param.grad = slot if self._aliases_param(b) else None

    def start_reduce(self, b: int) -> Pending:
        return self._reduction.start(self._full(b), self.buckets[b].ranges)

    def _param_grad(self, b: int, i: int) -> torch.Tensor | None:
        if self._aliases_param(b):  # what one process holds, and what the step reads
            return self.buckets[b].slot_view(self.grads[b], i)
        return None

    def _pieces_source(self, b: int) -> torch.Tensor | None:
        """The pieces' gradients: a view of the full gradient's shard (or, when the masters
        differ in dtype or device, a copy in theirs)."""
        grad, bucket = self.grads[b], self.buckets[b]
        if grad is None:
            return None
        shard = bucket.shard(grad)
        if (shard.dtype, shard.device) == (bucket.shard_data.dtype, bucket.shard_data.device):
            return shard
        if self._master_grads[b] is None:
            self._master_grads[b] = torch.empty_like(bucket.shard_data)  # written whole below
        self._master_grads[b].copy_(shard)
        return self._master_grads[b]

    def parts(self, b: int, i: int) -> list[torch.Tensor]:
        parts = [] if self.grads[b] is None else [self.buckets[b].slot_view(self.grads[b], i)]
        if self._master_grads[b] is not None:  # else the pieces view the slot itself
            parts += self._piece_grads(b, i)
        return parts

    def zero(self, set_to_none: bool) -> None:
        super().zero(set_to_none)
        if set_to_none:
            self._master_grads = [None] * len(self.buckets)

    def zero_slots(self, b: int, slots: set[int]) -> None:
        super().zero_slots(b, slots)
        if self.grads[b] is not None:  # the full gradient, which the pieces may not view
            for i in slots:
                self.buckets[b].slot_view(self.grads[b], i).zero_()

    def buffers(self) -> list[torch.Tensor]:
        return super().buffers() + [g for g in self._master_grads if g is not None]


class ScatteredGradients(FullGradients):
    """Level 'os' (the default, ``whole_grads=False``): the ZeRO paper's stage 1. Each bucket
    keeps its full-size gradient, which backward fills with this rank's local gradients; a
    reduce-scatter ('os_g''s reduction) then averages only this rank's chunk of it (the other
    chunks keep the local, unreduced values: nothing reads them). With the all-gather of the
    updated shards a step sends 2Ψ(N-1)/N, DDP's bytes; ``FullGradients`` (``whole_grads=True``)
    all-reduces, 3Ψ(N-1)/N, so that ``param.grad`` is whole on every rank.

    ``param.grad`` is a ``GradPlaceholder`` (no rank holds a whole averaged gradient), as at
    'os_g'; the pieces' gradients view the averaged chunk (or a copy in the masters' dtype).

    Note: a backward after a reduction without ``zero_grad`` (accumulating without
    ``no_sync``) overwrites the buffer, the averaged chunk too: its first write keeps the chunk
    aside (a staging buffer), which is added back once the next reduction is done.
    """

    def __init__(self, buckets, reduction: ReduceScatter, staging: StagingPool, **options):
        super().__init__(buckets, reduction, staging, **options)
        self._staging = staging
        self.placeholder_reason = (
            "at level 'os' each rank averages only its shard of the gradient (a reduce-scatter,"
            " DDP's bytes); pass whole_grads=True to keep the whole gradient on every rank"
        )
        self._scratch = [  # decided once: gloo's receive buffer per bucket (0: none)
            reduction.scratch_numel(b.layout.padded_numel, b.data.device, b.ranges) for b in buckets
        ]
        self._reduced = [True] * len(buckets)  # the buffer was reduced since its last write
        self._averaged = [False] * len(buckets)  # its chunk holds an average since zero_grad
        self._kept: list[torch.Tensor | None] = [None] * len(buckets)

    def staging_requests(self) -> list[tuple[int, torch.dtype]]:
        return [(n, self._dtype(k)) for k, n in enumerate(self._scratch) if n]

    def _aliases_param(self, b: int) -> bool:
        return False  # param.grad is never the buffer, which holds unreduced chunks

    def take(self, b: int, i: int, param: nn.Parameter, accumulated: bool) -> bool:
        """Parameter ``i``'s gradient of this backward into the buffer (overwriting the last
        reduction's input; what steps accumulated is in the chunk, kept aside). Did it have one?"""
        self._keep_average(b)
        slot = self.buckets[b].slot_view(self._full(b), i)
        grad, param.grad = param.grad, None
        if grad is None:
            slot.zero_()
            return False
        slot.copy_(grad)
        return True

    def _keep_average(self, b: int) -> None:
        if not self._reduced[b]:
            return
        self._reduced[b] = False
        if self._averaged[b]:
            chunk = self.buckets[b].shard(self.grads[b])
            self._kept[b] = self._staging.acquire(chunk.numel(), chunk.dtype).copy_(chunk)

    def start_reduce(self, b: int) -> Pending:
        self._keep_average(b)  # a bucket no parameter of reached this backward
        bucket, full = self.buckets[b], self._full(b)
        chunk, kept, self._kept[b] = bucket.shard(full), self._kept[b], None
        scratch = (
            self._staging.acquire(self._scratch[b], self._dtype(b)) if self._scratch[b] else None
        )
        # the kept chunk is added before any replica all-reduce, so a deferred replica
        # reduction (core/replica_sync.py) averages what the earlier micro-batches accumulated
        # too (with the state sharded over replicas: after their reduce-scatter, see there)
        pending = self._reduction.start(
            full,
            chunk,
            bucket.ranges,
            scratch,
            accumulate=False,
            then=lambda: self._add_kept(chunk, kept, scratch),
            replica_ranges=bucket.replica_ranges,
        )
        self._reduced[b] = self._averaged[b] = True
        return pending

    def _add_kept(self, chunk: torch.Tensor, kept, scratch) -> None:
        if kept is not None:
            chunk.add_(kept)
            self._staging.release(kept)
        if scratch is not None:
            self._staging.release(scratch)

    def parts(self, b: int, i: int) -> list[torch.Tensor]:
        return self._piece_grads(b, i)  # the averaged pieces only: the rest is unreduced

    def zero(self, set_to_none: bool) -> None:
        super().zero(set_to_none)
        self._averaged = [False] * len(self.buckets)  # zeros (or freed): nothing to keep


class ShardedGradients(_Gradients):
    """Levels 'os_g', 'p_g_os': every rank keeps only its shard of each bucket's average."""

    placeholder_reason = (
        "at levels 'os_g' and 'p_g_os' each rank holds only its shard of the gradient"
    )

    def __init__(
        self,
        buckets: list[FlatParamBucket],
        reduction: ReduceScatter,
        staging: StagingPool,
        *,
        reduce_dtype: torch.dtype | None = None,
        tp_group=None,  # unused: placeholders stand for every sharded gradient alike
        defer_staging: bool = False,
    ):
        super().__init__(buckets, reduce_dtype)
        self._reduction = reduction
        self._staging = staging
        self._staged: list[torch.Tensor | None] = [None] * len(buckets)  # during backward only
        # Note: the root unit's gradients arrive over the whole backward (its head's first, its
        # embedding's last): staged at the first, its whole buffer would be held all the while.
        # Deferred, autograd's gradients are held here as they came, staged when the unit is
        # reduced (after its parameters were freed: group.accumulate).
        self._defer = defer_staging
        self._deferred: list[dict[int, torch.Tensor | None]] = [{} for _ in buckets]
        # decided once, here: the receive buffer each bucket's reduction borrows (0: none)
        self._scratch = [
            reduction.scratch_numel(b.layout.padded_numel, b.data.device, b.ranges) for b in buckets
        ]

    def staging_requests(self) -> list[tuple[int, torch.dtype]]:
        staged = [(b.layout.padded_numel, self._dtype(k)) for k, b in enumerate(self.buckets)]
        scratch = [(n, self._dtype(k)) for k, n in enumerate(self._scratch) if n]
        return staged + scratch

    def _staged_buffer(self, b: int) -> torch.Tensor:
        if self._staged[b] is None:
            layout = self.buckets[b].layout
            full = self._staging.acquire(layout.padded_numel, self._dtype(b))
            full[layout.numel :].zero_()  # padding
            self._staged[b] = full
        return self._staged[b]

    def take(self, b: int, i: int, param: nn.Parameter, accumulated: bool) -> bool:
        """Stage parameter ``i``'s gradient and release autograd's. Did it have one? (What
        earlier steps accumulated is in the shard, which the reduction adds to.)"""
        grad, param.grad = param.grad, None  # autograd's full-size gradient, released here
        if self._defer:
            self._deferred[b][i] = grad
        else:
            self._stage(b, i, grad)
        return grad is not None

    def _stage(self, b: int, i: int, grad: torch.Tensor | None) -> None:
        slot = self.buckets[b].slot_view(self._staged_buffer(b), i)
        if grad is None:
            slot.zero_()
        else:
            slot.copy_(grad)

    def add(self, b: int, i: int, param: nn.Parameter) -> None:
        """A second delivery in one backward (a reentrant checkpoint): add it."""
        grad, param.grad = param.grad, None
        if not self._defer:
            self.buckets[b].slot_view(self._staged_buffer(b), i).add_(grad)
        else:
            held = self._deferred[b].get(i)
            self._deferred[b][i] = grad if held is None else held + grad

    def start_reduce(self, b: int) -> Pending:
        deferred, self._deferred[b] = self._deferred[b], {}
        while deferred:  # each released as soon as it is staged
            i, grad = deferred.popitem()
            self._stage(b, i, grad)
            del grad
        full, self._staged[b] = self._staged_buffer(b), None
        # None since zero_grad(set_to_none=True): nothing to add to, so the reduction writes
        # every element of a shard allocated unfilled (no memset, no read of zeros). In the
        # masters' dtype and device (fp32; offload: the CPU)
        fresh = self.grads[b] is None
        if fresh:
            self.grads[b] = torch.empty_like(self.buckets[b].shard_data)
        scratch = (
            self._staging.acquire(self._scratch[b], self._dtype(b)) if self._scratch[b] else None
        )
        pending = self._reduction.start(
            full, self.grads[b], self.buckets[b].ranges, scratch, accumulate=not fresh,
            replica_ranges=self.buckets[b].replica_ranges,
        )  # fmt: skip
        return pending.then(lambda: self._release(full, scratch))

    def _release(self, full: torch.Tensor, scratch: torch.Tensor | None) -> None:
        self._staging.release(full)
        if scratch is not None:
            self._staging.release(scratch)

    def _param_grad(self, b: int, i: int) -> None:
        return None  # no tensor of the parameter's shape holds its gradient

    def _pieces_source(self, b: int) -> torch.Tensor | None:
        return self.grads[b]

    def parts(self, b: int, i: int) -> list[torch.Tensor]:
        return self._piece_grads(b, i)


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Do ``a`` and ``b`` start at the same element of the same storage? (Not by address:
    every meta storage, as in ``zerokit plan``'s dry run, is at address 0.)"""
    return (
        a.untyped_storage()._cdata == b.untyped_storage()._cdata
        and a.storage_offset() == b.storage_offset()
    )
