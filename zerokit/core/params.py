"""How a model's parameters are held between uses: whole on every rank (``WholeParams``, levels
'os' and 'os_g') or sharded and gathered unit by unit (``ShardedParams``, 'p_g_os').

``core/build.py`` picks one per model, once; ``ShardState`` holds it and calls the same methods
at every level, so all of stage 3's behaviour lives in ``ShardedParams``: prefetching the next
unit, the meeting before a forward under ``no_grad``, refusing a rank-dependent unit order,
freeing a unit paused under ``no_sync()``, refreshing the units kept whole after a step, and
gathering every unit for ``state_dict``/``load_state_dict``. With whole parameters the only
work is spreading each rank's updated shard to all after a step.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.distributed as dist

from .agreement import meet
from .collectives import Pending, all_reduce_
from .group import Phase, UnitGroup

_FORWARD = "the model's forward"
_NO_GRAD_FORWARD = "the model's forward under torch.no_grad()"
_NO_GRAD_HINT = (
    ". At level 'p_g_os' every forward gathers the parameters from every rank: run evaluation "
    "(e.g. an estimate_loss() under no_grad) on every rank, and average or print on rank 0"
)
_ORDER_CHANGED = "the model's forward, whose units ran in another order than the last step's"
_ORDER_HINT = (
    ". The ranks named ran the units in the order agreed before; this one did not. At level "
    "'p_g_os' every gather is a collective: run the same modules in the same order on every "
    "rank (a branch that depends on the rank or its data mixes parameters between units), or "
    "use level 'os' / 'os_g'"
)
_COLLECTIVE_STATE_DICT = (
    ". At level 'p_g_os' state_dict() and load_state_dict() gather every unit's parameters: "
    "they are collective, every rank must call them. To save from one rank, call "
    "zerokit.checkpoint.save(path, model, optimizer) on every rank (zerokit.checkpoint."
    "consolidate makes one file of it), or call model.state_dict() on every rank and save "
    "it on rank 0 only"
)


class WholeParams:
    """Levels 'os', 'os_g': every rank holds every full parameter; nothing is gathered ahead
    or freed. After a step each rank's updated shard is all-gathered into the buckets."""

    # the order vote may be read when backward launches its first reduction: nothing that
    # runs before then depends on it
    order_vote_can_wait = True

    def __init__(self, groups, *, sync_comm: bool = False, debug_agreement: bool = False):
        pass  # nothing is gathered, so nothing to agree on or to hold back

    def after_wrap(self, state) -> None:
        pass  # every rank starts from rank 0's parameters already

    def start_refresh(self, buckets) -> list[Pending]:
        """Start spreading every rank's updated shard of ``buckets`` to all."""
        return [bucket.start_gather_updated() for bucket in buckets]

    def refresh(self, state, buckets, started: list[Pending] | None = None) -> None:
        """The shards of ``buckets`` changed (a step, a load): spread every rank's to all, or
        finish the spreading ``start_refresh`` began (``started``)."""
        for work in self.start_refresh(buckets) if started is None else started:
            work.finish()

    def after_group_step(self, buckets) -> None:
        self.refresh(None, buckets)

    def begin_forward(self, state) -> None:
        state.presence.mark(_FORWARD)

    def root_forward(self, state) -> None:
        pass

    def unit_forward(self, state, group: UnitGroup) -> None:
        pass

    def unit_backward(self, state, group: UnitGroup) -> None:
        pass

    def unit_paused(self, group: UnitGroup) -> None:
        pass  # under no_sync(): nothing to free

    def order_check_needed(self, state, groups) -> bool:
        """Every forward: a rank-dependent order is allowed here (reductions then use the
        registration order), so a rank whose order did not change cannot know that another's
        did; every rank checks."""
        return True

    def order_differs(self) -> None:
        pass  # reductions fall back to the registration order; no gather is at stake

    def keeps_for_backward(self, state, group: UnitGroup) -> bool:
        return False  # nothing is freed after a forward

    def forward_done(self, state, graph: bool) -> None:
        pass

    def backward_done(self) -> None:
        pass

    def before_io(self, state, call: str, groups=None) -> None:
        pass  # state_dict() reads the full parameters, which every rank holds

    def after_save(self, state, state_dict) -> None:
        pass

    def after_load(self, state) -> None:
        pass


class ShardedParams:
    """Level 'p_g_os' (stage 3): a unit's full parameters exist only while it runs (forward,
    backward, recomputation); the next unit in the last forward's order is gathered ahead.

    ``sync_comm``: nothing is gathered ahead. ``debug_agreement``: before every gather the
    ranks check (one blocking all-reduce) that they gather the same unit; off, a rank that
    gathers alone is caught by the bounded wait (``CollectiveTimeout`` naming the call)."""

    # the order vote is read at the end of the forward: backward's first gathers follow
    # the agreed order, and a disagreement is refused before any of them
    order_vote_can_wait = False

    def __init__(
        self, groups: list[UnitGroup], *, sync_comm: bool = False, debug_agreement: bool = False
    ):
        self._groups = groups
        self._sync_comm = sync_comm
        self._prefetched: UnitGroup | None = None  # gathered ahead of its use
        self._kept: UnitGroup | None = None  # the last unit, not freed after its forward
        self._was_sharded: list[UnitGroup] = []  # state_dict(): the units to free again
        if debug_agreement:
            check = functools.partial(_check_same_gather, weakref.ref(self))  # no cycle
            for g in groups:
                g.before_gather = check

    # -- after a step, a load, the wrap --------------------------------------------------------
    def after_wrap(self, state) -> None:
        self.refresh(state, state.buckets)  # gathers the units kept whole

    def start_refresh(self, buckets) -> list[Pending]:
        # the next use gathers the updated shards; only the replicas' sub-shards are spread
        # now (optimizer state sharded over replicas: each stepped its own)
        return [b.start_gather_replicas() for b in buckets if b.replica_group is not None]

    def refresh(self, state, buckets, started: list[Pending] | None = None) -> None:
        """Drop stale gathered copies of ``buckets``; units kept whole gather again."""
        for work in self.start_refresh(buckets) if started is None else started:
            work.finish()
        changed = {id(b) for b in buckets}
        for g in state.groups:
            touched = [bucket for bucket in g.buckets if id(bucket) in changed]
            for bucket in touched:
                bucket.reshard()
            if g.keep_whole and touched:
                g.wait_for_unshard()

    def after_group_step(self, buckets) -> None:
        for work in self.start_refresh(buckets):  # the next use gathers the updated shards
            work.finish()

    # -- forward and backward ------------------------------------------------------------------
    def begin_forward(self, state) -> None:
        if torch.is_grad_enabled():
            state.presence.mark(_FORWARD)
            return
        # evaluation: a forward that gathers outside the training steps. If one rank runs it
        # alone (on rank 0 only), it waits here, named, instead of pairing its gathers with
        # the other ranks' next training forward
        state.presence.mark(_NO_GRAD_FORWARD)
        meet(_NO_GRAD_FORWARD, state.process_group, _NO_GRAD_HINT)

    def root_forward(self, state) -> None:
        """The model's forward starts: gather the first unit (after the root) ahead."""
        order, root = state.prefetch_order, state.root_group
        first = next((state.groups[k] for k in order), None)
        if first is root and len(order) > 1:
            first = state.groups[order[1]]
        if first is not root:
            self._prefetch(first)

    def unit_forward(self, state, group: UnitGroup) -> None:
        self._prefetch(_neighbour(state, group, +1, state.prefetch_order), using=group)

    def unit_backward(self, state, group: UnitGroup) -> None:
        previous = _neighbour(state, group, -1, state.forward_order)
        if previous is not None and previous.phase is Phase.POST_BACKWARD:
            previous = None
        self._prefetch(previous, using=group)

    def unit_paused(self, group: UnitGroup) -> None:
        """no_sync(): nothing is reduced, but this backward no longer reads the unit's
        parameters. Free them, as a synchronised backward does; another call's or graph's
        backward gathers them again (a pipeline keeps several graphs in flight)."""
        group.pause_backward()

    def order_check_needed(self, state, groups) -> bool:
        """Only when this rank's order differs from the last agreed one (or none was agreed
        yet): after the first step a forward issues no collective beyond its gathers.

        Note: every rank holds the same agreed order (it is set only from an agreement's
        result), so every rank whose order did not change skips, and those whose order
        changed check. If all changed (an order that depends on the input, the same on every
        rank), all check and agree on the new one. If only some changed, the gathers already
        differed between the ranks, which this level refuses: the ranks that changed first
        meet in the store (no collective), so they wait there, named, and raise
        ``CollectiveTimeout`` naming the ranks that kept the agreed order; those ranks'
        next collective (their backward's) times out naming this check."""
        if state.forward_order == state.agreed_order:
            return False
        if state.agreed_order is not None:
            state.presence.mark(_ORDER_CHANGED)
            for group in groups:
                meet(_ORDER_CHANGED, group, _ORDER_HINT)
        return True

    def order_differs(self) -> None:
        raise RuntimeError(
            "ranks ran the model's units in different orders in this forward (a branch that "
            "depends on the rank or its data): at level 'p_g_os' every gather is a "
            "collective, so parameters would be mixed between units. Run the same modules "
            "in the same order on every rank, or use level 'os' / 'os_g'."
        )

    def keeps_for_backward(self, state, group: UnitGroup) -> bool:
        """The last unit of the forward stays gathered: its backward is the first to run and
        would gather it again at once (torchtitan's last block, FSDP2's root). No more is held
        than while it ran; not under ``sync_comm`` (one unit at a time) or without grad."""
        if self._sync_comm or not torch.is_grad_enabled():
            return False
        if _last_unit(state, state.prefetch_order) is not group:
            return False
        self._kept = group
        return True

    def forward_done(self, state, graph: bool) -> None:
        """The model's forward is over: free a unit gathered ahead that never ran, and the
        kept last unit if no backward follows or this forward ended with another unit."""
        self._prefetch(None)
        kept, self._kept = self._kept, None
        if kept is None or kept.phase is not Phase.FORWARD:
            return
        if not graph or _last_unit(state, state.forward_order) is not kept:
            kept.reshard()

    def backward_done(self) -> None:
        self._prefetched = None  # every unit was freed by its reduction

    def _prefetch(self, group: UnitGroup | None, using: UnitGroup | None = None) -> None:
        """Gather ``group`` ahead of its use; free the previous guess if it was wrong (the
        order changed since it was recorded) and nothing is using it now. Under ``sync_comm``
        nothing is gathered ahead: each unit is gathered when it runs, so one unit (besides the
        root) is gathered at a time, the least memory, paid for with no overlap."""
        if self._sync_comm:
            group = None
        guess, self._prefetched = self._prefetched, group
        if guess is not None and guess is not using and guess is not group:
            if guess.phase in (Phase.IDLE, Phase.FORWARD):
                guess.reshard()
        if group is not None:
            group.unshard()

    # -- state_dict / load_state_dict ----------------------------------------------------------
    def before_io(self, state, call: str, groups: list[UnitGroup] | None = None) -> None:
        """Full tensors under the original keys, gathered on demand and freed again: every
        unit, or ``groups`` (those holding a submodule's parameters, for its state_dict())."""
        groups = state.groups if groups is None else groups
        state.presence.mark(call)
        meet(call, state.process_group, _COLLECTIVE_STATE_DICT)
        self._was_sharded = [g for g in groups if g.gathered_numel() == 0]
        for g in groups:
            g.unshard()
        for g in groups:
            g.wait_for_unshard()

    def after_save(self, state, state_dict) -> None:
        """Copies of the gathered tensors: their memory is freed again below."""
        full = {b.data.untyped_storage().data_ptr() for b in state.buckets}
        for key, value in state_dict.items():
            if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in full:
                state_dict[key] = value.detach().clone()
        self._restore()

    def after_load(self, state) -> None:
        with torch.no_grad():
            for bucket in state.buckets:
                if not bucket.separate_masters:  # else the fp32 masters were loaded directly
                    bucket.shard_data.copy_(bucket.shard(bucket.data))
        self._restore()

    def _restore(self) -> None:
        for g in self._was_sharded:
            g.reshard()
        self._was_sharded = []


def _neighbour(state, group: UnitGroup, step: int, order: list[int]) -> UnitGroup | None:
    k = state.index_of(group)
    if k not in order:
        return None
    j = order.index(k) + step
    if 0 <= j < len(order) and state.groups[order[j]] is not state.root_group:
        return state.groups[order[j]]
    return None


def _last_unit(state, order: list[int]) -> UnitGroup | None:
    """The last unit of ``order`` besides the root (found from the end: no list per call)."""
    return next(
        (state.groups[k] for k in reversed(order) if state.groups[k] is not state.root_group), None
    )


def _check_same_gather(params_ref, group: UnitGroup) -> None:
    """Every rank must gather the same unit now: one all-reduce of its index (MAX of
    ``[k, -k]``) before the gather. Without it a rank-dependent branch pairs one rank's
    gather with another unit's on another rank: mixed parameters for units of one shape,
    an abort inside gloo for units of different shapes."""
    params = params_ref()
    if params is None:
        return
    groups, bucket = params._groups, group.buckets[0]
    k = groups.index(group)
    both = torch.tensor([k, -k], dtype=torch.int64, device=bucket.data.device)
    all_reduce_(both, bucket.group, op=dist.ReduceOp.MAX)
    if int(both[0]) != -int(both[1]):
        names = sorted({groups[int(both[0])].name, groups[-int(both[1])].name})
        raise RuntimeError(
            f"ranks are gathering different units of the model at the same time (this rank "
            f"{group.name!r}; the ranks' units range over {names}): a module runs on some "
            "ranks and not others (a branch that depends on the rank or its data). At "
            "level 'p_g_os' every rank must run the same modules in the same order; use "
            "'os' / 'os_g' for rank-dependent models"
        )
