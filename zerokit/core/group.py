"""A unit group: the parameters of one unit (a module), flattened into buckets, and their
life cycle through a step.

A group owns its buckets (flat parameters), its gradients (a ``FullGradients`` or
``ShardedGradients``, chosen once by ``core/build.py``: it never asks which), this backward's
bookkeeping (which parameters delivered, which contributed), and two states:

    storage (per bucket):  SHARDED -> GATHERING -> GATHERED -> SHARDED   ('p_g_os' only)
    phase:                 IDLE -> FORWARD -> PRE_BACKWARD -> POST_BACKWARD -> IDLE

Verbs: ``unshard`` / ``wait_for_unshard`` / ``reshard`` (storage), ``pre_forward`` /
``post_forward`` / ``pre_backward`` / ``post_backward`` / ``finish_backward`` (phase).
``ShardState`` decides when each runs; the group checks that the transition is legal.
"""

from __future__ import annotations

import enum

import torch
from torch import nn

from .collectives import Pending, all_reduce_
from .flat_param import FlatParamBucket, Storage
from .grad_placeholder import GradPlaceholder, is_placeholder
from .gradients import FullGradients, ShardedGradients


class Phase(enum.Enum):
    IDLE = "idle"  # no step in flight for this group
    FORWARD = "forward"  # its forward ran; its backward has not started
    PRE_BACKWARD = "pre_backward"  # its backward is running: parameters gathered
    POST_BACKWARD = "post_backward"  # its gradients are on their way; parameters freed


class TransitionError(RuntimeError):
    """A unit group was asked to do something its state does not allow."""


class NotGatheredError(RuntimeError):
    """A module ran while the unit holding its parameters was not gathered (level 'p_g_os'),
    where its parameters are empty: raised before the module reads them."""


# why a unit is not gathered, by its phase (PRE_BACKWARD: it is gathered)
_NOT_GATHERED_BECAUSE = {
    Phase.IDLE: "has not run since the last step",
    Phase.FORWARD: "ran and was freed at the end of its forward",
    Phase.POST_BACKWARD: "is done with this backward: its gradients were reduced and it was freed",
}


class UnitGroup:
    def __init__(
        self,
        name: str,
        buckets: list[FlatParamBucket],
        gradients: FullGradients | ShardedGradients,
        *,
        keep_whole: bool = False,
        tp_group=None,
    ):
        self.name = name
        self.buckets = buckets
        self.gradients = gradients
        self.keep_whole = keep_whole  # an exclude_layer: gathered once, never freed
        self.phase = Phase.IDLE
        n = len(buckets)
        # has_grad[b][i]: parameter i of bucket b holds a gradient (agreed across ranks).
        # Python lists, not tensors: read and written once per parameter in every backward,
        # where indexing a tensor costs microseconds each (made a tensor once per step to agree)
        self.has_grad = self._no_flags()
        self.contributed = self._no_flags()
        self._arrived = [0] * n
        self._missing_total = sum(len(b.params) for b in buckets)
        self.post_backward_signalled = False  # its inputs' gradients are done (module units)
        self.forward_calls = 0  # calls of its module since the last backward
        self.before_gather = None  # debug mode: a check that every rank gathers it now
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

    @property
    def gathered(self) -> bool:
        """Are its full parameters usable now (always, where parameters are not sharded)?"""
        return all(b.storage is Storage.GATHERED for b in self.buckets if b.shards_params)

    def not_gathered(self, module_name: str, module: nn.Module) -> NotGatheredError:
        """The error for ``module`` (holding parameters of this unit) running while it is not
        gathered: outside the unit's own forward, where its parameters are empty."""
        prefix = f"{module_name}." if module_name else ""
        names = [prefix + n for n, _ in module.named_parameters(recurse=False)]
        why = _NOT_GATHERED_BECAUSE.get(self.phase, "is not gathered")
        return NotGatheredError(
            f"module {module_name!r} ({type(module).__name__}) ran while unit {self.name!r}, "
            f"which holds its parameters ({', '.join(names)}), is not gathered: the unit "
            f"{why}. At level 'p_g_os' a unit's parameters exist only while the unit's own "
            f"module runs (its forward, its backward) and are empty between uses, so "
            f"{module_name!r} must be called from inside {self.name!r}'s forward. Call it "
            f"there; or make it a unit of its own (e.g. ShardingConfig(wrap="
            f"({type(module).__name__},))); or use level 'os_g'"
        )

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

    def post_forward(self, keep_gathered: bool = False) -> None:
        """``keep_gathered``: its backward comes next, so freeing it would only gather it again."""
        if self.phase not in (Phase.FORWARD, Phase.PRE_BACKWARD):  # recomputation: PRE_BACKWARD
            raise TransitionError(
                f"unit {self.name!r}: post_forward in phase {self.phase.value} (its pre_forward "
                "never ran, or its gradients were already reduced)"
            )
        if not keep_gathered:
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
            if param.grad is not None:
                self.gradients.add(b, i, param)
                self.contributed[b][i] = True
            return
        if self._missing_total == 1:  # the last: no node reads the full parameters again
            self.reshard()  # before staging it, or the peak holds both (FSDP2 frees first too)
        self.contributed[b][i] = self._take_grad(b, i, param)
        self._arrived[b] += 1
        self._missing_total -= 1

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
            pending.append(self.gradients.start_reduce(b))
        self.phase = Phase.POST_BACKWARD
        self.reshard()
        return pending

    def _no_flags(self) -> list[list[bool]]:
        return [[False] * len(b.params) for b in self.buckets]

    def finish_backward(self, contributed: list[list[bool]]) -> None:
        """Reductions are done and ``contributed`` is agreed: expose gradients, reset."""
        for b in range(len(self.buckets)):
            self.has_grad[b] = [h or c for h, c in zip(self.has_grad[b], contributed[b])]
            self.gradients.publish(b, self.has_grad[b], self.owner)
        self.reset()

    def reset(self) -> None:
        """Back to IDLE and sharded, forgetting this backward's bookkeeping (not gradients)."""
        self.contributed = self._no_flags()
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
        return self.gradients.take(b, i, param, accumulated=self.has_grad[b][i])

    def release_stepped(self) -> None:
        """step_in_backward: the group's gradients were applied; free them. A parameter that
        had one keeps a placeholder that refuses a later clip (the update already happened)."""
        had = self.has_grad
        self.zero_grad(set_to_none=True)
        why = "step_in_backward already applied this gradient during backward and freed it"
        for bucket, flags in zip(self.buckets, had):
            for param, flag in zip(bucket.params, flags):
                if flag:
                    param.grad = GradPlaceholder(param, lambda: None, self.owner, why)

    # -- between steps -------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool) -> None:
        if set_to_none:
            self.has_grad = self._no_flags()
            for bucket in self.buckets:
                for param in bucket.params:
                    param.grad = None
                for piece_param in bucket.param_pieces:
                    piece_param.grad = None
        self.gradients.zero(set_to_none)

    def zero_grad_of(self, param_ids: set[int], set_to_none: bool) -> None:
        """Zero the gradients of the parameters in ``param_ids`` only: one optimizer of
        several zeroes its own; the buffers stay, the others' gradients in them too."""
        for b, bucket in enumerate(self.buckets):
            slots = {i for i, p in enumerate(bucket.params) if id(p) in param_ids}
            if not slots:
                continue
            self.gradients.zero_slots(b, slots)
            if set_to_none:
                for i in slots:
                    self.has_grad[b][i] = False
                    bucket.params[i].grad = None
                for piece, view in zip(bucket.pieces, bucket.param_pieces):
                    if piece.slot in slots:
                        view.grad = None

    def grads_to_scale(self) -> list[torch.Tensor]:
        """Every gradient buffer a clip or unscale must scale so all views stay consistent."""
        return self.gradients.buffers()

    def owned_grad_pieces(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(parameter, gradient of this rank's piece of it)."""
        return [
            (bucket.params[piece.slot], view.grad)
            for bucket in self.buckets
            for piece, view in zip(bucket.pieces, bucket.param_pieces)
            if view.grad is not None
        ]
