"""The sharded optimizer: the user's optimizer, updating only this rank's pieces.

``shard_optimizer_`` converts the user's optimizer in place, as FSDP2 converts a module: its
class becomes a subclass of the original (``ShardedAdamW`` is still an ``AdamW``), each param
group keeps its dict (so ``lr`` and schedulers keep working) but holds this rank's 1-D pieces
instead of whole parameters, and existing state is sliced to match. Each piece's update is the
original elementwise algorithm on that slice, so the result equals the unsharded step. A
parameter whose optimizer needs all of it (Muon, Adafactor: ``core/optimizer_needs.py``) is one
piece, shaped like the parameter, on the one rank that owns it (the owner layout); a low-bit
optimizer's pieces start on its quantization blocks, and whether a piece's state is quantized
is decided on the whole parameter (``LowBitPieces``). Several optimizers of one model (Muon for
the matrices beside AdamW for the rest) are each converted; each steps buckets of its own
(``core/bucket_layout``: a bucket never mixes optimizers), so after its step it spreads its own
updated shards, and the bytes sent are those one optimizer over all parameters would send.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import weakref

import torch

from .checks import is_distributed
from .gradients import clear_own_grads
from .optimizer_needs import LOW_BIT_MIN_NUMEL, Need, is_low_bit
from .state import ShardState


class ShardedOptimizer:
    """Mixed in front of the user's optimizer class."""

    _zerokit: OptimizerShardState

    def step(self, closure=None):
        state = self._zerokit.shard_state
        state.check_ready_for_step()
        state.presence.mark("optimizer.step()")
        if state.step_in_backward:  # each group was stepped as its gradients were reduced
            if closure is not None:
                raise RuntimeError(
                    "step_in_backward steps inside backward: optimizer.step(closure) cannot "
                    "re-evaluate the model first; call step() without a closure"
                )
            state.close_step()
            # what no group holds (rank-local parameters) is stepped here, as without it
            local = {id(p) for p in self._zerokit.local_params}
            if local:
                with _stepping_only(self, local):
                    super().step()  # type: ignore[misc]
            return None
        if closure is not None:  # one evaluation of the closure: step everything at once
            loss = super().step(closure)  # type: ignore[misc]
            state.refresh_params(self._zerokit.buckets)  # its own buckets only
            return loss
        started = []  # each chunk's shards spread while the next chunk steps
        try:
            for chunk, buckets in self._zerokit.chunks:
                if chunk:
                    with _stepping_only(self, chunk):
                        super().step()  # type: ignore[misc]
                started += state.start_refresh(buckets)
        finally:  # never leave a gather writing into the parameters after step() returns
            state.refresh_params(self._zerokit.buckets, started)
        return None

    def step_group(self, group) -> None:
        """Step only ``group``'s pieces (step_in_backward, called by ``ShardState``)."""
        chunk = {id(piece) for bucket in group.buckets for piece in bucket.param_pieces}
        with _stepping_only(self, chunk):
            super().step()  # type: ignore[misc]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._zerokit.shard_state.zero_grad(set_to_none, optimizer=self)
        clear_own_grads(self._zerokit.local_params, set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        raise RuntimeError(
            "add_param_group after group_sharded_parallel is not supported: the new parameters "
            "would be in no bucket, so each rank would step them with its own unreduced "
            "gradient. Build the optimizer with every param group first, then wrap."
        )

    def state_dict(self) -> dict:
        """Torch's per-rank state dict of this rank's pieces, tagged with the layout it fits."""
        return {**super().state_dict(), "zerokit_layout": self._zerokit.layout_tag()}

    def load_state_dict(self, state_dict: dict) -> None:
        tag, mine = state_dict.get("zerokit_layout"), self._zerokit.layout_tag()
        if tag != mine:
            saved = "an unwrapped optimizer" if tag is None else f"{tag}"
            raise ValueError(
                f"this optimizer state dict was saved by {saved}; this rank is {mine}. A "
                "sharded optimizer's state_dict holds one rank's pieces and loads only into the "
                "same rank of the same layout: use zerokit.checkpoint.save/load to resume at "
                "another world size or level"
            )
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "zerokit_layout"})


class LowBitPieces:
    """Mixed in front of a torchao low-bit optimizer (``AdamW8bit``, ``AdamW4bit``,
    ``AdamWFp8``): torchao quantizes a tensor's state only when it has >= 4096 elements that
    divide into blocks, and asks the tensor it is given. Asked of a piece, the answer would
    change with the world size; here it is asked of the whole parameter, as one process asks.
    The layout already starts every piece on a block (``core/bucket_layout.place_owners``)."""

    _zerokit: OptimizerShardState

    def _new_buffer(self, p: torch.Tensor, signed: bool):
        numel = self._zerokit.whole_numel.get(id(p), p.numel())
        if numel >= LOW_BIT_MIN_NUMEL and numel % self.block_size == 0:
            assert p.numel() % self.block_size == 0, "a piece does not start on a block"
            return self._subclass_zeros(p, signed, self.block_size)
        return torch.zeros_like(p)


@contextlib.contextmanager
def _stepping_only(optimizer, chunk: set[int]):
    """Restrict every param group to the pieces in ``chunk`` for one inner step.

    Note: the optimizer is stepped one unit group at a time because its foreach kernels make
    temporaries as large as all the tensors they are given (AdamW: one ``sqrt(v)`` per
    element). Per group, that temporary is bounded by the largest unit's shard instead of the
    whole shard of the model: the difference is 4 bytes x P/N at the peak of a step.
    """
    saved = [group["params"] for group in optimizer.param_groups]
    for group, params in zip(optimizer.param_groups, saved):
        group["params"] = [p for p in params if id(p) in chunk]
    try:
        yield
    finally:
        for group, params in zip(optimizer.param_groups, saved):
            group["params"] = params


class OptimizerShardState:
    """Note: the optimizer holds the model's ``ShardState`` weakly. The model owns it; an
    optimizer can outlive its model in a reference cycle torch makes (the frames of a lazy
    import during the first optimizer's ``__init__``), and a strong reference would keep the
    process group alive until interpreter shutdown, where gloo aborts the process."""

    def __init__(
        self,
        shard_state: ShardState,
        group_params: list[list[torch.Tensor]],
        needs: dict[int, Need] | None = None,
    ):
        self._shard_state = weakref.ref(shard_state)
        self.group_params = group_params  # each param group's whole parameters, as given
        self.param_ids = {id(p) for params in group_params for p in params}
        # the buckets this optimizer steps (each bucket holds one optimizer's parameters)
        self.buckets = [
            b for b in shard_state.buckets if any(id(p) in self.param_ids for p in b.params)
        ]
        mine = {id(b) for b in self.buckets}
        # id(piece) -> its whole parameter's element count (LowBitPieces' choice): the
        # unsplit one's for a rank's part of a larger parameter (split experts), else its own
        needs = needs or {}
        self.whole_numel = {
            id(view): getattr(needs.get(id(bucket.params[piece.slot])), "whole_numel", None)
            or bucket.layout.slots[piece.slot].numel
            for bucket in self.buckets
            for piece, view in zip(bucket.pieces, bucket.param_pieces)
        }
        # rank-local (is_distributed) parameters: in no bucket, stepped whole, as given
        self.local_params = [p for params in group_params for p in params if is_distributed(p)]
        # the pieces of each unit group in its buckets, and those buckets: it steps one chunk
        # at a time and spreads a chunk's updated shards while the next one steps
        chunks = [[b for b in g.buckets if id(b) in mine] for g in shard_state.groups]
        self.chunks = [
            ({id(piece) for b in buckets for piece in b.param_pieces}, buckets)
            for buckets in chunks
        ] + [({id(p) for p in self.local_params}, [])]
        # a chunk with no piece on this rank still spreads its buckets: the other ranks do
        self.chunks = [(ids, buckets) for ids, buckets in self.chunks if ids or buckets]

    @property
    def shard_state(self) -> ShardState:
        state = self._shard_state()
        if state is None:
            raise RuntimeError(
                "the model this optimizer was wrapped with by group_sharded_parallel no longer "
                "exists; keep the model alive as long as its optimizer is used"
            )
        return state

    def layout_tag(self) -> dict:
        """What a per-rank optimizer state dict fits: rank, world, level, and its pieces."""
        state = self.shard_state
        pieces = [
            (b.layout.slots[p.slot].name, p.start, p.end) for b in state.buckets for p in b.pieces
        ]
        digest = hashlib.sha256(repr(pieces).encode()).hexdigest()[:16]
        group = state.process_group
        return {
            "rank": group.rank(),
            "world_size": group.size(),
            "level": state.level,
            "pieces": digest,
        }


def as_optimizer_list(optimizer) -> list:
    """An optimizer argument as a list: one optimizer, or the list or tuple of them a model
    was wrapped with (Muon beside AdamW). Each caller checks what the items are."""
    return list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]


def optimizer_params_of(optimizer: torch.optim.Optimizer) -> list[list[torch.Tensor]]:
    """Each param group's whole parameters: for an optimizer sharded by
    ``group_sharded_parallel`` (whose groups hold this rank's 1-D pieces) as they were given,
    for any other optimizer its groups' own."""
    sharded = getattr(optimizer, "_zerokit", None)
    if isinstance(sharded, OptimizerShardState):
        return [list(params) for params in sharded.group_params]
    return [list(group["params"]) for group in optimizer.param_groups]


def shard_optimizer_(
    optimizer: torch.optim.Optimizer, shard_state: ShardState, needs: dict[int, Need] | None = None
):
    """Point ``optimizer`` at this rank's pieces, in place. Validation happens before this.
    ``needs``: what the layout was planned from (``core/optimizer_needs.py``); its
    ``whole_numel`` tells a low-bit optimizer the unsplit size of a rank's part."""
    piece_of = {}  # id(original param) -> its pieces on this rank
    for bucket in shard_state.buckets:
        for piece, piece_param in zip(bucket.pieces, bucket.param_pieces):
            param = bucket.params[piece.slot]
            slot = bucket.layout.slots[piece.slot]  # param.shape may be empty (stage 3)
            piece_of.setdefault(id(param), []).append((piece, piece_param, slot))

    group_params = [list(group["params"]) for group in optimizer.param_groups]
    old_state = optimizer.state
    new_state: dict = {}
    for group_dict in optimizer.param_groups:
        pieces = []
        for param in group_dict["params"]:
            if id(param) not in piece_of and is_distributed(param):  # rank-local: kept whole
                pieces.append(param)
                if param in old_state:
                    new_state[param] = old_state[param]
                continue
            for piece, piece_param, slot in piece_of.get(id(param), []):
                pieces.append(piece_param)
                if param in old_state:
                    new_state[piece_param] = _slice_state(old_state[param], slot, piece)
        group_dict["params"] = pieces
    optimizer.state.clear()
    optimizer.state.update(new_state)

    cls = type(optimizer)
    mixins = (ShardedOptimizer, LowBitPieces) if is_low_bit(optimizer) else (ShardedOptimizer,)
    optimizer.__class__ = type(f"Sharded{cls.__name__}", (*mixins, cls), {})
    optimizer._zerokit = OptimizerShardState(shard_state, group_params, needs)
    shard_state.add_optimizer(optimizer)
    _repoint_scheduler_patch(optimizer)
    return optimizer


def restore_optimizer_(optimizer: torch.optim.Optimizer, state: dict) -> torch.optim.Optimizer:
    """Undo ``shard_optimizer_`` (``zerokit.unwrap``): the user's class, each param group its
    whole parameters as given (hyperparameters kept), and ``state`` (parameter -> its full
    state, gathered by the caller)."""
    sharded = optimizer._zerokit
    for group_dict, params in zip(optimizer.param_groups, sharded.group_params):
        group_dict["params"] = list(params)
    optimizer.state.clear()
    optimizer.state.update(state)
    optimizer.__class__ = type(optimizer).__bases__[-1]  # (ShardedOptimizer, ..., the user's)
    del optimizer._zerokit
    _repoint_scheduler_patch(optimizer)  # a scheduler's step wrapper: the user's step again
    return optimizer


def _slice_state(state: dict, slot, piece) -> dict:
    """A piece's share of a parameter's optimizer state: per-element tensors are sliced (a
    parameter owned whole keeps all of its state, shaped as it was)."""
    out = {}
    for key, value in state.items():
        sliced = not slot.whole and isinstance(value, torch.Tensor) and value.dim() > 0
        if sliced and tuple(value.shape) == slot.shape:
            out[key] = value.detach().reshape(-1)[piece.start : piece.end].clone()
        elif isinstance(value, torch.Tensor):
            out[key] = value.detach().clone()
        else:
            out[key] = value
    return out


def _repoint_scheduler_patch(optimizer: torch.optim.Optimizer) -> None:
    # An LR scheduler created before wrapping replaced ``optimizer.step`` on the instance with a
    # wrapper around the *original* class's step, which would skip the sharded step. Re-wrap
    # around the class's step now (after ``unwrap``: the original's again).
    if "step" not in vars(optimizer):
        return
    sharded_step = type(optimizer).step

    @functools.wraps(sharded_step)
    def step(*args, **kwargs):
        optimizer._opt_called = True
        return sharded_step(optimizer, *args, **kwargs)

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = step
