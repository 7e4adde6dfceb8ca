"""A shard group: the parameters of one unit (a module), flattened into buckets, and their
life cycle through a step.

A group owns its buckets (flat parameters), its gradient buffers (full at 'os', this rank's
shard at 'os_g'/'p_g_os'), its staged gradients during backward, and two states:

    storage (per bucket):  SHARDED -> GATHERING -> GATHERED -> SHARDED   ('p_g_os' only)
    phase:                 IDLE -> FORWARD -> PRE_BACKWARD -> POST_BACKWARD -> IDLE

Verbs: ``unshard`` / ``wait_for_unshard`` / ``reshard`` (storage), ``pre_forward`` /
``post_forward`` / ``pre_backward`` / ``post_backward`` / ``finish_backward`` (phase).
``ShardState`` decides when each runs; the group checks that the transition is legal.
"""

from __future__ import annotations

import enum
import weakref

import torch
from torch import nn

from .collectives import Pending, all_reduce_
from .flat_param import FlatParamBucket, Storage
from .grad_placeholder import GradPlaceholder, is_placeholder
from .reduction import AllReduce, ReduceScatter
from .staging import StagingPool


class Phase(enum.Enum):
    IDLE = "idle"  # no step in flight for this group
    FORWARD = "forward"  # its forward ran; its backward has not started
    PRE_BACKWARD = "pre_backward"  # its backward is running: parameters gathered
    POST_BACKWARD = "post_backward"  # its gradients are on their way; parameters freed


class TransitionError(RuntimeError):
    """A shard group was asked to do something its state does not allow."""


class ShardGroup:
    def __init__(
        self,
        name: str,
        buckets: list[FlatParamBucket],
        reduction: AllReduce | ReduceScatter,
        staging: StagingPool,
        *,
        reduce_dtype: torch.dtype | None = None,
        keep_whole: bool = False,
        tp_group=None,
    ):
        self.name = name
        self.buckets = buckets
        self.reduction = reduction
        self.keep_whole = keep_whole  # 'p_g_os' exclude_layer: gathered once, never freed
        self._staging = staging
        self._reduce_dtype = reduce_dtype
        self.phase = Phase.IDLE
        n = len(buckets)
        # Persistent gradient per bucket: full ('os') or this rank's shard; None until the first
        # reduction after zero_grad(set_to_none=True), which frees it (torch's contract).
        self.grads: list[torch.Tensor | None] = [None] * n
        # 'os' under mixed precision: fp32 copies of the shard for the fp32 master pieces
        self._piece_grads: list[torch.Tensor | None] = [None] * n
        self._staged: list[torch.Tensor | None] = [None] * n  # during backward only
        # has_grad[b][i]: parameter i of bucket b holds a gradient (agreed across ranks)
        self.has_grad = [torch.zeros(len(b.params), dtype=torch.bool) for b in buckets]
        self.contributed = [torch.zeros(len(b.params), dtype=torch.bool) for b in buckets]
        self._arrived = [0] * n
        self._missing_total = sum(len(b.params) for b in buckets)
        self.post_backward_signalled = False  # its inputs' gradients are done (module units)
        self.forward_calls = 0  # calls of its module since the last backward
        self.before_gather = None  # 'p_g_os': ShardState's check that every rank gathers it
        self.owner = lambda: None  # a weak reference to the ShardState (global gradient norms)
        # Sequence parallelism: parameters replicated across the tp group whose gradient is a
        # partial sum on each tp rank (Megatron marks them ``param.sequence_parallel = True``);
        # each one's new gradient is summed over ``tp_group`` once, as it is taken.
        self._tp_group = tp_group
        self._tp_summed = (
            {
                (b, i)
                for b, bucket in enumerate(buckets)
                for i, p in enumerate(bucket.params)
                if getattr(p, "sequence_parallel", False) is True
            }
            if tp_group is not None and tp_group.size() > 1
            else set()
        )

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for b in self.buckets for p in b.params]

    # -- storage ---------------------------------------------------------------------------------
    def unshard(self) -> None:
        if not any(b.storage is Storage.SHARDED for b in self.buckets):
            return  # gathered, or on its way
        if self.before_gather is not None:
            self.before_gather(self)
        for bucket in self.buckets:
            bucket.start_unshard()

    def wait_for_unshard(self) -> None:
        self.unshard()
        for bucket in self.buckets:
            bucket.wait_for_unshard()

    def reshard(self) -> None:
        if not self.keep_whole:
            for bucket in self.buckets:
                bucket.reshard()

    def gathered_numel(self) -> int:
        return sum(b.gathered_numel for b in self.buckets if b.shards_params)

    # -- forward -------------------------------------------------------------------------------
    def pre_forward(self) -> None:
        if self.phase is Phase.POST_BACKWARD:
            raise TransitionError(
                f"unit {self.name!r} ran forward after its gradients were reduced in this "
                "backward; a module may not run again once its backward is done"
            )
        self.wait_for_unshard()
        if self.phase is Phase.IDLE:
            self.phase = Phase.FORWARD
        self.forward_calls += 1

    def post_forward(self) -> None:
        if self.phase not in (Phase.FORWARD, Phase.PRE_BACKWARD):  # recomputation: PRE_BACKWARD
            raise TransitionError(
                f"unit {self.name!r}: post_forward in phase {self.phase.value} (its pre_forward "
                "never ran, or its gradients were already reduced)"
            )
        self.reshard()

    # -- backward ------------------------------------------------------------------------------
    def pre_backward(self) -> None:
        if self.phase is Phase.POST_BACKWARD:
            raise TransitionError(f"unit {self.name!r}: backward reached it after its reduction")
        self.wait_for_unshard()
        self.phase = Phase.PRE_BACKWARD

    def pause_backward(self) -> None:
        """Under ``no_sync()``: one backward through the unit is over and nothing is reduced;
        free its parameters. The next backward through it gathers them again."""
        if self.phase is not Phase.PRE_BACKWARD:
            return  # never gathered for this backward (its pre-backward hook did not fire)
        self.reshard()
        self.phase = Phase.FORWARD

    def accumulate(self, b: int, i: int, param: nn.Parameter) -> None:
        """A parameter's gradient is complete for this backward: take it into bucket ``b``.

        A parameter used inside a reentrant checkpoint and outside it delivers twice (the
        nested backward's accumulation, then the outer one's): the second adds to the first.
        """
        if self.phase is Phase.POST_BACKWARD:
            raise TransitionError(
                f"a gradient of unit {self.name!r} arrived after the unit was reduced in this "
                "backward; a parameter must not be used again after its unit's backward is over"
            )
        if param.grad is not None and param.grad.layout != torch.strided:
            raise RuntimeError(
                f"unit {self.name!r}: a parameter got a sparse gradient, which zerokit cannot "
                "reduce or shard; use dense gradients (e.g. nn.Embedding(sparse=False))"
            )
        if (b, i) in self._tp_summed and param.grad is not None:
            all_reduce_(param.grad, self._tp_group)  # a fresh tensor: never the bucket's slot
        if self._is_taken(b, i):
            self.contributed[b][i] |= self._add_grad(b, i, param)
            return
        self.contributed[b][i] = self._take_grad(b, i, param)
        self._arrived[b] += 1
        self._missing_total -= 1

    def _add_grad(self, b: int, i: int, param: nn.Parameter) -> bool:
        if param.grad is None:
            return False
        target = self._full_grad(b) if self.reduction.keeps_full_grad else self._staged_buffer(b)
        slot = self.buckets[b].slot_view(target, i)
        if param.grad.data_ptr() != slot.data_ptr():  # else autograd added into the slot itself
            slot.add_(param.grad)
        alias = self.reduction.keeps_full_grad and self._aliases_param(b, i)
        param.grad = slot if alias else None
        return True

    @property
    def ready(self) -> bool:
        """Every parameter has its gradient, or the module's backward is known to be over."""
        return self._missing_total == 0 or self.post_backward_signalled

    def post_backward(self) -> list[Pending]:
        """Start reducing every bucket (parameters that never got a gradient contribute zeros or
        what ``no_sync()`` accumulated), then free the full parameters."""
        if self.phase is Phase.POST_BACKWARD:
            raise TransitionError(f"unit {self.name!r} was reduced twice in one backward")
        pending = []
        for b, bucket in enumerate(self.buckets):
            if self._arrived[b] < len(bucket.params):
                for i, param in enumerate(bucket.params):
                    if not self._is_taken(b, i):
                        if is_placeholder(param.grad):  # the last backward's: nothing new
                            param.grad = None
                        # what no_sync() accumulated was never taken by accumulate(): a marked
                        # sequence-parallel gradient is still a partial sum per tp rank
                        if (b, i) in self._tp_summed and param.grad is not None:
                            all_reduce_(param.grad, self._tp_group)
                        self.contributed[b][i] = self._take_grad(b, i, param)
            pending.append(self._start_reduce(b))
        self.phase = Phase.POST_BACKWARD
        self.reshard()
        return pending

    def finish_backward(self, contributed: list[torch.Tensor]) -> None:
        """Reductions are done and ``contributed`` is agreed: expose gradients, reset."""
        for b, bucket in enumerate(self.buckets):
            self.has_grad[b] |= contributed[b]
            self._publish(b, bucket)
        self.reset()

    def reset(self) -> None:
        """Back to IDLE and sharded, forgetting this backward's bookkeeping (not gradients)."""
        for flags in self.contributed:
            flags.zero_()
        self._arrived = [0] * len(self.buckets)
        self._missing_total = sum(len(b.params) for b in self.buckets)
        self._taken = None
        self.post_backward_signalled = False
        self.forward_calls = 0
        self.phase = Phase.IDLE
        self.reshard()

    # -- gradients -----------------------------------------------------------------------------
    _taken: set | None = None  # (b, i) taken this backward, only tracked when needed

    def _is_taken(self, b: int, i: int) -> bool:
        return self._taken is not None and (b, i) in self._taken

    def _take_grad(self, b: int, i: int, param: nn.Parameter) -> bool:
        if self._taken is None:
            self._taken = set()
        self._taken.add((b, i))
        if self.reduction.keeps_full_grad:
            return self._take_into_full(b, i, param)
        slot = self.buckets[b].slot_view(self._staged_buffer(b), i)
        if param.grad is None:
            slot.zero_()
            return False
        slot.copy_(param.grad)
        param.grad = None  # release the full-size gradient autograd made
        return True

    def _full_grad(self, b: int) -> torch.Tensor:
        if self.grads[b] is None:
            bucket = self.buckets[b]
            dtype = self._reduce_dtype or bucket.data.dtype
            self.grads[b] = torch.zeros(
                bucket.layout.padded_numel, dtype=dtype, device=bucket.data.device
            )
        return self.grads[b]

    def _aliases_param(self, b: int, i: int) -> bool:
        """'os': can ``param.grad`` be a view of the full gradient, the very memory the
        optimizer steps from? Not under mixed precision or offload (the gradient or the masters
        are in another dtype or device), nor under tensor parallelism (a gradient is a slice,
        so torch's clip would count only this rank's): then it is a ``GradPlaceholder``."""
        bucket = self.buckets[b]
        dtype = self._reduce_dtype or bucket.data.dtype
        return (
            (dtype, bucket.data.device) == (bucket.shard_data.dtype, bucket.shard_data.device)
            and dtype == bucket.data.dtype
            and (self._tp_group is None or self._tp_group.size() == 1)
        )

    def _take_into_full(self, b: int, i: int, param: nn.Parameter) -> bool:
        slot = self.buckets[b].slot_view(self._full_grad(b), i)
        grad = param.grad
        accumulated = bool(self.has_grad[b][i])  # the slot holds reduced gradients since zero_grad
        alias = self._aliases_param(b, i)
        if grad is None:
            if not (accumulated and not alias):
                slot.zero_()
            return False
        if grad.data_ptr() == slot.data_ptr():  # autograd accumulated into the bucket itself
            return True
        if accumulated and not alias:
            slot.add_(grad)  # mixed precision: the slot cannot be param.grad, so add here
        else:
            slot.copy_(grad)
        param.grad = slot if alias else None  # later backwards accumulate into the bucket
        return True

    def _staged_buffer(self, b: int) -> torch.Tensor:
        if self._staged[b] is None:
            bucket = self.buckets[b]
            dtype = self._reduce_dtype or bucket.data.dtype
            full = self._staging.acquire(bucket.layout.padded_numel, dtype)
            full[bucket.layout.numel :].zero_()  # padding
            self._staged[b] = full
        return self._staged[b]

    def _shard_grad(self, b: int) -> torch.Tensor:
        if self.grads[b] is None:  # in the masters' dtype and device (fp32, offload: the CPU)
            self.grads[b] = torch.zeros_like(self.buckets[b].shard_data)
        return self.grads[b]

    def _start_reduce(self, b: int) -> Pending:
        if self.reduction.keeps_full_grad:
            return self.reduction.start(self._full_grad(b))
        full, self._staged[b] = self._staged_buffer(b), None
        pending = self.reduction.start(full, self._shard_grad(b))
        return pending.then(lambda: self._staging.release(full))

    def _publish(self, b: int, bucket: FlatParamBucket) -> None:
        flags = self.has_grad[b]
        grad = self.grads[b]
        shard = self._piece_grad_shard(b) if self.reduction.keeps_full_grad else grad
        for i, param in enumerate(bucket.params):
            if not flags[i]:
                param.grad = None
            elif self._torch_reads_grad(b, i):
                param.grad = bucket.slot_view(grad, i)
            else:
                param.grad = self._placeholder(b, i)
        if shard is None:
            for piece_param in bucket.param_pieces:
                piece_param.grad = None
            return
        for piece, piece_param, view in zip(
            bucket.pieces, bucket.param_pieces, bucket.piece_views(shard)
        ):
            piece_param.grad = view if flags[piece.slot] else None

    def _torch_reads_grad(self, b: int, i: int) -> bool:
        """Is ``param.grad`` what one process would hold, and what the optimizer steps from?
        Then torch's clip on it is exact."""
        return self.reduction.keeps_full_grad and self._aliases_param(b, i)

    def _placeholder(self, b: int, i: int) -> GradPlaceholder:
        """``param.grad`` of parameter ``i`` of bucket ``b`` where torch cannot read it; it
        scales, in place, every buffer holding this rank's part of that gradient."""
        ref = weakref.ref(self)  # param -> .grad -> group -> param would be a cycle

        def parts() -> list[torch.Tensor]:
            group = ref()
            return [] if group is None else group._grad_parts(b, i)

        if self.reduction.keeps_full_grad:
            why = (
                "this rank holds a tensor-parallel slice of the gradient"
                if self._tp_group is not None and self._tp_group.size() > 1
                else "the gradient the optimizer steps from is in another dtype or device than "
                "the parameter (mixed precision or offload)"
            )
        else:
            why = "at levels 'os_g' and 'p_g_os' each rank holds only its shard of the gradient"
        return GradPlaceholder(self.buckets[b].params[i], parts, self.owner, why)

    def _grad_parts(self, b: int, i: int) -> list[torch.Tensor]:
        bucket, parts = self.buckets[b], []
        if self.reduction.keeps_full_grad and self.grads[b] is not None:
            parts.append(bucket.slot_view(self.grads[b], i))
        if not self.reduction.keeps_full_grad or self._piece_grads[b] is not None:
            parts += [  # separate memory only: at 'os' the pieces may view the slot itself
                view.grad
                for piece, view in zip(bucket.pieces, bucket.param_pieces)
                if piece.slot == i and view.grad is not None
            ]
        return parts

    def release_stepped(self) -> None:
        """step_in_backward: the group's gradients were applied; free them. A parameter that
        had one keeps a placeholder that refuses a later clip (the update already happened)."""
        had = [flags.clone() for flags in self.has_grad]
        self.zero_grad(set_to_none=True)
        why = "step_in_backward already applied this gradient during backward and freed it"
        for bucket, flags in zip(self.buckets, had):
            for param, flag in zip(bucket.params, flags):
                if flag:
                    param.grad = GradPlaceholder(param, lambda: None, self.owner, why)

    def _piece_grad_shard(self, b: int) -> torch.Tensor | None:
        """'os': the pieces' gradients, a view of the full gradient's shard (or, when the masters
        differ in dtype or device, a copy in theirs)."""
        grad, bucket = self.grads[b], self.buckets[b]
        if grad is None:
            return None
        shard = bucket.shard(grad)
        if (shard.dtype, shard.device) == (bucket.shard_data.dtype, bucket.shard_data.device):
            return shard
        if self._piece_grads[b] is None:
            self._piece_grads[b] = torch.zeros_like(bucket.shard_data)
        self._piece_grads[b].copy_(shard)
        return self._piece_grads[b]

    # -- between steps -------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool) -> None:
        if set_to_none:
            for flags in self.has_grad:
                flags.zero_()
            for bucket in self.buckets:
                for param in bucket.params:
                    param.grad = None
                for piece_param in bucket.param_pieces:
                    piece_param.grad = None
            self.grads = [None] * len(self.buckets)  # freed: torch's contract lowers memory
            self._piece_grads = [None] * len(self.buckets)
            return
        for grad in self.grads + self._piece_grads:
            if grad is not None:
                grad.zero_()

    def grads_to_scale(self) -> list[torch.Tensor]:
        """Every gradient buffer a clip or unscale must scale so all views stay consistent."""
        return [g for g in self.grads + self._piece_grads if g is not None]

    def owned_grad_pieces(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(parameter, gradient of this rank's piece of it)."""
        return [
            (bucket.params[piece.slot], view.grad)
            for bucket in self.buckets
            for piece, view in zip(bucket.pieces, bucket.param_pieces)
            if view.grad is not None
        ]
