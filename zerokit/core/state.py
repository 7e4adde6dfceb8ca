"""``ShardState``: one per wrapped model. It owns the unit groups, the order their reductions
are launched in, the reductions in flight, the end of backward and the after-step, and offers
the small public protocol the tools around the core use (checkpoint, memory, clip, scaler).

Reachable as ``zerokit.core.state_of(model)`` (or of the wrapped optimizer).

Note: every rank must issue the same collectives in the same sequence. Gradients arrive in the
order autograd runs, which can differ between ranks when a parameter is used on some ranks
only, so reductions are launched in an *agreed* order, never in arrival order: the reverse of
the order units first ran in this step's forward, once every rank has checked (one small
all-reduce after the forward; at 'p_g_os' only when a rank's order differs from the last
agreed one) that it saw the same order; otherwise the reverse of the registration order. A group is launched when it is ready (every parameter has its gradient, or
its module's backward is over) and every group before it in that order has been launched; at
the end of backward the rest are launched in order.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.distributed import ProcessGroup

from ..runtime import presence
from . import checks
from .collectives import Pending, all_reduce_, communication_device, start_all_reduce_
from .flat_param import FlatParamBucket, Storage
from .group import Phase, UnitGroup
from .params import ShardedParams, WholeParams
from .replica_sync import ReplicaSync
from .stand_in import is_stand_in

#: most groups whose reductions are in flight at once; the oldest is finished before another
#: starts, which bounds the staging memory of backward (see docs/ARCHITECTURE.md)
MAX_GROUPS_IN_FLIGHT = 1

# Note: with step_in_backward a synchronised backward *is* an optimizer step, so a second one
# before optimizer.step() (accumulation without no_sync(), a backward per chunk) would step
# again with a part of the batch's gradient: AdamW's count doubles and the model drifts from
# one process. Which backward is the last of a step cannot be known while it runs, so the
# second is refused before it does anything.
_STEPPED_TWICE = (
    "step_in_backward=True: this backward follows a synchronised backward that already "
    "stepped the optimizer, and optimizer.step() was not called since; every backward outside "
    "no_sync() is one optimizer step here. To accumulate micro-batches, run every backward but "
    "the last under `with model.no_sync():`, then call optimizer.step() (which closes the "
    "step) before the next micro-batch's backward; or wrap without step_in_backward. Nothing "
    "of this backward was applied"
)

_DEFERRED_STEP = (
    "step_in_backward=True steps the optimizer inside every synchronised backward, so the "
    "cross-replica reduction cannot wait for a later micro-batch: leave defer_replica_sync() "
    "(requires_replica_sync = True), or accumulate under model.no_sync(), or wrap without "
    "step_in_backward. Nothing of this backward was applied"
)


class ShardState:
    def __init__(
        self,
        model: nn.Module,
        level: str,
        process_group: ProcessGroup,
        groups: list[UnitGroup],
        root_group: UnitGroup | None,
        staging,
        params: WholeParams | ShardedParams,
        *,
        tp_group: ProcessGroup | None = None,
        replica_group: ProcessGroup | None = None,
        sync_comm: bool = False,
        frozen: list[tuple[str, nn.Parameter]] = (),
        replica_sync: ReplicaSync | None = None,
    ):
        self._model = weakref.ref(model)  # the model holds this state: no strong cycle back
        self.level = level  # its name, for reports and checkpoints; never tested here
        self.params = params  # how parameters are held between uses (stage 3's prefetch...)
        self.process_group = process_group
        self.presence = presence.Presence(process_group)  # this rank's last call, for waits
        self.tp_group = tp_group  # given at wrap time: ranks holding other slices of tp layers
        self.replica_group = replica_group  # hybrid sharding: ranks holding the same shards
        # hybrid accumulation: the replica step deferred to the boundary (core/replica_sync.py)
        self.replica_sync = replica_sync if replica_sync is not None else ReplicaSync(None)
        self._vote_crossed = True  # the pending order vote included the replicas
        self.groups = groups
        self.root_group = root_group
        self.staging = staging
        self.sync_comm = sync_comm
        self._frozen = list(frozen)  # frozen at wrap time: must stay frozen
        self.sync_enabled = True  # False inside no_sync()
        self.in_backward = False
        self._graph_pending = False  # a forward with grad ran; its backward has not ended
        self.peak_groups_in_flight = 0
        self._where = {
            id(p): (g, b, i)
            for g in groups
            for b, bucket in enumerate(g.buckets)
            for i, p in enumerate(bucket.params)
        }
        self._index = {id(g): k for k, g in enumerate(groups)}
        self._static_order = list(reversed(range(len(groups))))  # reverse registration
        self.forward_order: list[int] = []  # groups in first-call order, this step
        self.prefetch_order: list[int] = []  # the last complete forward's order
        self.agreed_order: list[int] | None = None  # the last order every rank ran (the same
        # on every rank: set only from an agreement's result)
        self._order_agreed = False
        self._order_votes = []  # [(pending all-reduce, its tensor, the order voted on)]
        self._launch_order: list[int] | None = self._static_order  # None: not decided yet
        self._next_launch = 0
        self._in_flight: collections.deque[tuple[UnitGroup, list[Pending]]] = collections.deque()
        # step_in_backward: the sharded optimizers (weakly: they hold this state weakly too)
        # that step each group as soon as its reduction finishes, so that its gradient shard is
        # freed before the next group's is made
        self._steppers: list[weakref.ref] | None = None
        # step_in_backward: a synchronised backward stepped the optimizers and no
        # optimizer.step() has closed that step yet; another backward now would step again
        self._step_open = False
        # Several optimizers (Muon beside AdamW): each steps buckets of its own, and the
        # gradient buffers are freed once every one has zeroed its gradients since the last
        # backward began.
        self._optimizer_ids: set[int] = set()
        self._zeroed: set[int] = set()
        self._unsynced = False  # no_sync() gradients are waiting for a synchronised backward
        for g in groups:
            g.owner = weakref.ref(self)
        # set by the API: (model, norm_type, parameter ids, call=) -> (global norm, buffers);
        # zerokit.clip's, which the core cannot import (it counts tensor-parallel layers)
        self.grad_norm = None
        self.hook_handles: list = []
        self.state_dict_hooks = None  # hooks.StateDictHooks, set by register_hooks

    # -- the public protocol -----------------------------------------------------------------
    @property
    def model(self) -> nn.Module:
        """The wrapped model (held weakly: the model holds this state)."""
        return self._model()

    @property
    def step_in_backward(self) -> bool:
        return self._steppers is not None

    def enable_step_in_backward(self, optimizers) -> None:
        """Step each group's pieces as soon as its reduction finishes, then free its gradient
        shard (levels 'os_g', 'p_g_os'). Gradients never exist for the whole model at once:
        4/N bytes per parameter less at the peak. No global-norm clipping or loss-scaler skip
        can come first, which ``clip_grad_norm_`` and the scaler refuse."""
        self._steppers = [weakref.ref(optimizer) for optimizer in optimizers]

    def close_step(self) -> None:
        """step_in_backward: ``optimizer.step()`` closes the step a backward took; the next
        backward may step again."""
        self._step_open = False

    def add_optimizer(self, optimizer) -> None:
        """``optimizer`` steps some of this model's pieces (``core/optimizer.py``)."""
        self._optimizer_ids.add(id(optimizer))

    @property
    def optimizer_ids(self) -> set[int]:
        """The ids of the optimizers wrapped with this model."""
        return set(self._optimizer_ids)

    @property
    def buckets(self) -> list[FlatParamBucket]:
        return [b for g in self.groups for b in g.buckets]

    @property
    def communication_device(self) -> torch.device:
        """Where the group's collectives run (offload keeps shards on the CPU, not this)."""
        if is_stand_in(self.process_group):  # a dry run: control values on the CPU, not meta
            return torch.device("cpu")
        buckets = self.buckets
        return buckets[0].data.device if buckets else torch.device("cpu")

    @property
    def agree_groups(self) -> list[ProcessGroup]:
        """Groups a per-step decision (the scaler's skip, which parameters hold a gradient)
        must be agreed over: the shard group, its replicas, the tp group."""
        extra = [g for g in (self.replica_group, self.tp_group) if g is not None and g.size() > 1]
        return [self.process_group, *extra]

    @property
    def piece_groups(self) -> list[ProcessGroup]:
        """The groups this rank's pieces (``owned_grad_pieces``) split the model over, each
        element once: the shard group, and its replicas where the optimizer state is sharded
        over them too (``ShardingConfig.shard_optimizer_over_replicas``)."""
        over_replicas = any(b.replica_group is not None for b in self.buckets)
        return [self.process_group] + ([self.replica_group] if over_replicas else [])

    def check_ready_for_step(self, deferred_ok: bool = False) -> None:
        """``deferred_ok``: gradients whose replica step was deferred may be waiting (a
        ``zero_grad`` drops them; a step, clip or unscale must not read them)."""
        checks.check_params_intact(self.buckets, self._frozen)
        if self.in_backward:
            raise RuntimeError("optimizer.step() was called while a backward was still running")
        if self._unsynced:
            raise RuntimeError(
                "gradients accumulated under no_sync() were never reduced across ranks: run the "
                "last micro-batch's backward outside `with model.no_sync():` before step()"
            )
        if not deferred_ok:
            self.replica_sync.check_step()

    def owned_grad_pieces(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(parameter, gradient of this rank's piece): every element of the model once."""
        if self.step_in_backward:  # clipping and the scaler's check come here
            raise RuntimeError(
                "this model was wrapped with step_in_backward=True: each unit is stepped as "
                "soon as its gradients are reduced and its gradients are freed, so no global "
                "gradient norm (clip_grad_norm_) or overflow check exists before the update; "
                "wrap without step_in_backward to clip or scale"
            )
        return [pair for g in self.groups for pair in g.owned_grad_pieces()]

    def grads_to_scale(self) -> list[torch.Tensor]:
        return [t for g in self.groups for t in g.grads_to_scale()]

    def global_grad_norm(self, param_ids: set[int], norm_type: float) -> torch.Tensor:
        """torch's ``clip_grad_norm_`` over ``GradPlaceholder`` gradients: the norm one
        process would compute over those parameters' gradients. Collective."""
        model = self._model()
        call = "torch.nn.utils.clip_grad_norm_()"
        return self.grad_norm(model, norm_type, param_ids, call=call)[0]

    def zero_grad(self, set_to_none: bool = True, optimizer=None) -> None:
        """Zero the gradients ``optimizer`` steps (every gradient: when it is the model's only
        optimizer, or the last of them to zero; the buffers are freed then)."""
        self.check_ready_for_step(deferred_ok=True)
        if optimizer is not None and len(self._optimizer_ids) > 1:
            self._zeroed.add(id(optimizer))
            if not self._zeroed >= self._optimizer_ids:
                ids = optimizer._zerokit.param_ids
                for g in self.groups:
                    g.zero_grad_of(ids, set_to_none)
                return
        self._zeroed.clear()
        self.replica_sync.clear()  # the deferred accumulation is dropped with the gradients
        for g in self.groups:
            g.zero_grad(set_to_none)

    def reduce_unsynced(self) -> None:
        """Reduce the gradients accumulated under ``no_sync()`` now, as the end of a
        synchronised backward would (collective). For schedules whose last backward cannot be
        the synchronised one (a pipeline that must sum tied weights across stages first)."""
        if self.in_backward:
            raise RuntimeError("reduce_gradients() was called inside a backward")
        if not self.sync_enabled:
            raise RuntimeError("reduce_gradients() was called inside no_sync()")
        if not self._unsynced:
            return
        self.presence.mark("model.reduce_gradients()")
        self.in_backward = True
        self._launch_order, self._next_launch = self._static_order, 0
        self._end_of_backward()

    def start_refresh(self, buckets: list[FlatParamBucket]) -> list[Pending]:
        """The shards of ``buckets`` were just stepped: start spreading them (where full
        parameters are kept), so the next chunk's step hides the transfer."""
        return self.params.start_refresh(buckets)

    def refresh_params(
        self, buckets: list[FlatParamBucket] | None = None, started: list[Pending] | None = None
    ) -> None:
        """The shards changed (a step, a load): make the parameters the model sees match
        (only ``buckets``': one optimizer of several stepped its own). ``started``: what
        ``start_refresh`` began for them, finished here."""
        self.params.refresh(self, self.buckets if buckets is None else buckets, started)

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """What zerokit holds for this model, by category (each storage may appear in several
        lists; ``zerokit.memory.measure`` counts each once)."""
        return {
            "params": [b.shard_data for b in self.buckets],
            "grads": self.grads_to_scale(),
            "staging": self.staging.buffers(),
        }

    def param_shapes(self) -> dict[int, torch.Size]:
        """``id(param)`` -> its full shape, for every parameter in a bucket: the true shape
        also while it is freed ('p_g_os' parameters are empty between uses)."""
        return {
            id(p): torch.Size(slot.shape)
            for b in self.buckets
            for p, slot in zip(b.params, b.layout.slots)
        }

    def gathered_numel(self) -> int:
        """Elements of full parameters that have storage now ('p_g_os'; 0 elsewhere)."""
        return sum(g.gathered_numel() for g in self.groups)

    # -- forward (called by the hooks in hooks.py) ---------------------------------------------
    def root_pre_forward(self) -> None:
        if not self.in_backward:
            checks.check_params_intact(self.buckets, self._frozen)
            self.params.begin_forward(self)
        if not self.in_backward and not self._graph_pending:
            self.forward_order = []
        if self.root_group is not None:
            self._note_call(self.root_group)
            self.root_group.pre_forward()
        self.params.root_forward(self)

    def root_post_forward(self, graph: bool) -> None:
        """``graph``: the output requires grad, so a backward may follow."""
        self.params.forward_done(self, graph)
        if not graph:
            self.prefetch_order = list(self.forward_order)
            if not self.in_backward and not self._graph_pending:
                for g in self.groups:  # no backward will come: leave nothing gathered
                    g.reset()
            return
        self._graph_pending = True
        self._start_order_vote()
        if not self.params.order_vote_can_wait:  # 'p_g_os': backward's gathers follow it
            self._settle_order_vote()

    @property
    def root_gathered(self) -> bool:
        """The root unit's parameters are usable now (always, below 'p_g_os')."""
        group = self.root_group
        return group is None or all(
            not b.shards_params or b.storage is Storage.GATHERED for b in group.buckets
        )

    def root_unit_used(self) -> None:
        """A submodule holding root-unit parameters runs. Inside the model's forward or backward
        the root unit is gathered already (a no-op). Outside it, e.g. a tied head called on
        chunks of the hidden state with a backward per chunk, an earlier backward may have
        freed it: gather it again (a collective, as every call here). It then stays gathered
        until the end of the next backward, as after the model's own forward."""
        if self.root_group is not None:
            self.root_group.wait_for_unshard()

    def unit_pre_forward(self, group: UnitGroup) -> None:
        if self.in_backward:  # recomputation (activation checkpointing): backward follows
            group.wait_for_unshard()
            return
        self._note_call(group)
        group.pre_forward()
        self.params.unit_forward(self, group)

    def unit_post_forward(self, group: UnitGroup) -> None:
        if not self.in_backward:
            group.post_forward(keep_gathered=self.params.keeps_for_backward(self, group))

    def index_of(self, group: UnitGroup) -> int:
        return self._index[id(group)]

    def _note_call(self, group: UnitGroup) -> None:
        k = self._index[id(group)]
        if k not in self.forward_order:
            self.forward_order.append(k)

    def _start_order_vote(self) -> None:
        """Did every rank run the units in the same order? One all-reduce of a digest, when
        the order can have changed (``params.order_check_needed``: at 'p_g_os' only when this
        rank's order differs from the last agreed one), nothing at one rank. Started here, at
        the end of a forward; ``_settle_order_vote`` reads the result when backward first
        needs it (``_launch_ready``), so at 'os'/'os_g' the forward never blocks on it."""
        groups = [g for g in self._data_groups(this_backward=True) if g.size() > 1]
        if not groups or not self.params.order_check_needed(self, groups):
            self._settle_order_vote()  # an earlier forward's, whose backward has not come
            self._order_agreed = True
            self._vote_crossed = True  # the last order every rank agreed on (agreed_order)
            return
        digest = hashlib.sha256(repr(self.forward_order).encode()).digest()
        value = int.from_bytes(digest[:7], "little")  # < 2**56: -value fits an int64 too
        both = torch.tensor([value, -value], dtype=torch.int64, device=self.control_device)
        pending = start_all_reduce_(both, groups[0], op=dist.ReduceOp.MAX)
        for group in groups[1:]:  # hybrid: then across replicas, once the first is done
            pending.then(functools.partial(all_reduce_, both, group, op=dist.ReduceOp.MAX))
        # an earlier forward's vote (its backward has not come: every rank alike) is kept
        # and finished with this one; this one's order includes it, so it decides
        self._order_votes.append((pending, both, list(self.forward_order)))
        self._vote_crossed = self.replica_group in groups or not self.replica_sync.applies

    def _settle_order_vote(self) -> None:
        """Wait for the votes ``_start_order_vote`` started, if any, and act on the last."""
        if not self._order_votes:
            return
        votes, self._order_votes = self._order_votes, []
        for pending, _, _ in votes:
            pending.finish()
        _, both, order = votes[-1]
        agreed = int(both[0]) == -int(both[1])
        if not agreed:
            self.params.order_differs()  # stage 3 refuses; otherwise: the registration order
        if self._vote_crossed:  # a vote inside the shard group binds no other replica
            self.agreed_order = order if agreed else None
        self._order_agreed = agreed

    @functools.cached_property
    def control_device(self) -> torch.device:
        """Where the per-step control values (the order digest, the "holds a gradient" flags)
        are reduced: the CPU when every data group can reduce CPU tensors (gloo, or a
        ``"cpu:gloo,cuda:nccl"`` group), so reading them back is no device-to-host sync;
        else the communication device (an NCCL-only group: each read is one). The groups are
        fixed at wrap time: decided once, not in every step."""
        if all(communication_device(g).type == "cpu" for g in self._data_groups()):
            return torch.device("cpu")
        return self.communication_device

    # -- backward ------------------------------------------------------------------------------
    def begin_backward(self) -> None:
        """First hook of a backward (the model output's gradient, or a parameter's)."""
        if self.in_backward:
            return
        if self._step_open:
            self._drop_forward()
            raise RuntimeError(_STEPPED_TWICE)
        if self._steppers is not None and self.replica_sync.skips_replicas():
            self._drop_forward()
            raise RuntimeError(_DEFERRED_STEP)
        self.in_backward = True
        self._zeroed.clear()  # a zero_grad before this backward is not one of its gradients'
        Variable._execution_engine.queue_callback(self._end_of_backward)
        if self.root_group is not None:  # resharded by an earlier backward of another graph
            self.root_group.wait_for_unshard()
        self._launch_order = None  # decided by the first launch: after the order vote
        self._next_launch = 0
        self.staging.reset_peak()
        # each bucket asks once: a returned buffer no later bucket can reuse is dropped at once
        self.staging.expect(r for g in self.groups for r in g.gradients.staging_requests())

    def _drop_forward(self) -> None:
        """A refused backward: its forward is dropped as one without grad is (every unit
        back to idle and, at 'p_g_os', freed), so training can go on from the last step."""
        self.forward_order = []
        self._graph_pending = False
        for g in self.groups:
            g.reset()

    def unit_pre_backward(self, group: UnitGroup) -> None:
        self.begin_backward()
        if group.phase in (Phase.PRE_BACKWARD, Phase.POST_BACKWARD):
            return
        group.pre_backward()
        self.params.unit_backward(self, group)

    def unit_post_backward(self, group: UnitGroup, ran_once: bool) -> None:
        """The gradients of the module's inputs are computed: this call's backward is over
        (``ran_once``: the module ran once since the last backward, so all of it is)."""
        if not self.in_backward:
            return
        if self.sync_enabled:
            if ran_once:
                group.post_backward_signalled = True
                self._launch_ready(force=False)
        else:  # no_sync(): nothing is reduced
            self.params.unit_paused(group)

    def grad_ready(self, param: nn.Parameter) -> None:
        self.begin_backward()
        if not self.sync_enabled:
            self._unsynced = True
            return
        group, b, i = self._where[id(param)]
        group.accumulate(b, i, param)
        if group.ready:
            self._launch_ready(force=False)

    def _decide_launch_order(self) -> list[int]:
        """Reductions launch in the reverse of the agreed forward order (the registration
        order where the ranks disagreed): the same sequence of collectives on every rank."""
        self._settle_order_vote()
        # a vote inside the shard group only (taken while the replica step was deferred) does
        # not order collectives that cross replicas: then the registration order, everyone's
        crossing = self.replica_sync.applies and not self.replica_sync.skips_replicas()
        if self._order_agreed and not (crossing and not self._vote_crossed):
            called = list(reversed(self.forward_order))
            return called + [k for k in self._static_order if k not in called]
        return self._static_order

    def _launch_ready(self, force: bool) -> None:
        if self._launch_order is None:
            self._launch_order = self._decide_launch_order()
        order = self._launch_order
        while self._next_launch < len(order):
            group = self.groups[order[self._next_launch]]
            if not (force or group.ready):
                return
            while len(self._in_flight) >= MAX_GROUPS_IN_FLIGHT:  # make room: frees staging
                self._finish_oldest()
            self._in_flight.append((group, group.post_backward()))
            self.peak_groups_in_flight = max(self.peak_groups_in_flight, len(self._in_flight))
            self._next_launch += 1
            if self.sync_comm or self._root_is_next():
                self._finish_oldest()

    def _root_is_next(self) -> bool:
        """Is the root unit the next group to launch? Its gradients come last (the input
        embedding's), so the group just launched would hold its staging through the root's
        backward, where a tied embedding peaks (its gradient, the head's and their sum)."""
        order, k = self._launch_order, self._next_launch
        return k < len(order) and self.groups[order[k]] is self.root_group

    def _finish_oldest(self) -> None:
        """Wait for the oldest group's reduction (its staging goes back to the pool); under
        step_in_backward, step that group now."""
        group, pending = self._in_flight.popleft()
        for work in pending:
            work.finish()
        if self._steppers is not None:
            self._step_group(group)

    def _step_group(self, group: UnitGroup) -> None:
        """step_in_backward: agree which of the group's parameters hold a gradient (one small
        all-reduce, in launch order on every rank), publish them, step the group's pieces,
        spread the updated shard (if full parameters are kept) and free the group's gradient
        shard."""
        group.finish_backward(list(self._agree_contributed([group])))
        optimizers = [ref() for ref in self._steppers]
        if any(optimizer is None for optimizer in optimizers):
            raise RuntimeError(
                "step_in_backward: an optimizer wrapped with this model no longer exists"
            )
        for optimizer in optimizers:
            optimizer.step_group(group)
        self.params.after_group_step(group.buckets)
        group.release_stepped()

    def _agree_contributed(self, groups: list[UnitGroup]):
        """Which parameters of ``groups`` hold a gradient on any rank that splits the batch:
        one MAX all-reduce, one byte each. Each bucket's flags, in order."""
        # what earlier backwards left too (has_grad): agreed already, or, after micro-batches
        # whose replica step was deferred, inside this shard group only
        flags = [
            c or h
            for g in groups
            for contributed, had in zip(g.contributed, g.has_grad)
            for c, h in zip(contributed, had)
        ]
        data_groups = [g for g in self._data_groups(this_backward=True) if g.size() > 1]
        if data_groups:  # on the control device: no device-to-host read where gloo can reduce
            contributed = torch.tensor(flags, dtype=torch.uint8).to(self.control_device)
            for group in data_groups:
                all_reduce_(contributed, group, op=dist.ReduceOp.MAX)
            flags = (contributed if contributed.is_cpu else contributed.cpu()).bool().tolist()
        each, start = [], 0
        for size in (len(b.params) for g in groups for b in g.buckets):
            each.append(flags[start : start + size])
            start += size
        return iter(each)

    def _end_of_backward(self) -> None:
        self._settle_order_vote()  # also where no reduction was launched (no_sync())
        if self.sync_enabled and self._steppers is not None:
            self._launch_ready(force=True)
            while self._in_flight:
                self._finish_oldest()  # each steps its group
            self._unsynced = False
            self._step_open = True
        elif self.sync_enabled:
            self._launch_ready(force=True)
            flags = self._agree_contributed(self.groups)
            while self._in_flight:
                self._finish_oldest()
            for g in self.groups:
                g.finish_backward([next(flags) for _ in g.buckets])
            self._unsynced = False
            self.replica_sync.backward_done()
        else:
            for g in self.groups:  # gradients stay in param.grad until a synchronised backward
                g.reset()
        self.staging.clear()
        self.prefetch_order = list(self.forward_order)
        self.forward_order = []
        self.in_backward = False
        self._graph_pending = False
        self.params.backward_done()

    def _data_groups(self, this_backward: bool = False) -> list[ProcessGroup]:
        """The ranks that split the batch: the shard group and its replicas (``this_backward``:
        not the replicas while their reduction is deferred, so nothing crosses hosts)."""
        skip = this_backward and self.replica_sync.skips_replicas()
        replicas = None if skip else self.replica_group
        return [g for g in (self.process_group, replicas) if g is not None]


def state_of(obj) -> ShardState | None:
    """The ``ShardState`` of a model or optimizer returned by ``group_sharded_parallel``."""
    state = getattr(obj, "_zerokit", None)
    return getattr(state, "shard_state", state) if state is not None else None
