"""``whole_shards``: for a checkpoint's save, the optimizer state of whole shards where it is
sharded over replicas (``ShardingConfig.shard_optimizer_over_replicas``).

A checkpoint is written and read per shard: replica 0 writes what its pieces hold, and every
replica reads what its pieces hold. With the state sharded over replicas a rank's pieces are
its sub-shard's, so inside ``whole_shards(model, optimizer)`` each bucket's pieces are its
whole shard's again (views of the master shard, which every replica holds whole between
steps) and each optimizer's param groups and state are the whole shard's:

* on entering, each per-element state tensor is all-gathered across the replicas (one
  shard-size buffer per bucket and state key), and the state of a parameter owned whole (Muon,
  Adafactor) is broadcast from the replica that steps it;
* on leaving, each rank keeps its sub-shard's part of whatever the state then is, and its
  own pieces again (so a load run inside it works too; a load needs none of this, though: it
  reads what overlaps each piece, and the refresh after it gathers the master shard).

Memory: inside, a rank holds the optimizer state of its whole shard, R times its own, as it
would without the field; it is freed on leaving. Nothing is sent outside a checkpoint call.
A block-quantized state (torchao) is refused: its codes and scales are not gathered yet.
"""

from __future__ import annotations

import contextlib
import pickle

import torch

from .agreement import gather
from .collectives import broadcast_, start_all_gather_
from .flat_param import FlatParamBucket
from .optimizer import as_optimizer_list
from .state import state_of

_CALL = "checkpoint: the optimizer state of whole shards"


@contextlib.contextmanager
def whole_shards(model, optimizer):
    """Collective over the replicas (every rank of a checkpoint call). A no-op where the
    optimizer state is not sharded over replicas."""
    state = state_of(getattr(model, "stage", model))  # a PipelineModule: its stage's
    buckets = [] if state is None else [b for b in state.buckets if b.replica_group is not None]
    if not buckets:
        yield
        return
    optimizers = [] if optimizer is None else as_optimizer_list(optimizer)
    own = [list(zip(b.pieces, b.param_pieces)) for b in buckets]  # each sub-shard's pieces
    groups = [[list(g["params"]) for g in opt.param_groups] for opt in optimizers]
    for b in buckets:
        b.use_pieces(b.layout.pieces(b.group.rank()))
    try:
        for opt in optimizers:
            _widen(opt, buckets, own)
        yield
    finally:
        for opt, params in zip(optimizers, groups):
            _narrow(opt, buckets, own, params)
        for b, pairs in zip(buckets, own):
            b.pieces, b.param_pieces = tuple(p for p, _ in pairs), [v for _, v in pairs]


def _widen(opt, buckets: list[FlatParamBucket], own: list[list]) -> None:
    """``opt``'s groups over the whole shards' pieces, with the whole shards' state."""
    mine = opt._zerokit.param_ids
    whole_of: dict[int, list[torch.Tensor]] = {}  # id(parameter) -> its whole-shard views
    for b in buckets:
        for piece, view in zip(b.pieces, b.param_pieces):
            param = b.params[piece.slot]
            if id(param) in mine:
                whole_of.setdefault(id(param), []).append(view)
    gathered: dict = {}
    for bucket, subs in zip(buckets, own):
        held: dict = {}  # (slot, key) -> (kind, the replica holding it)
        q = bucket.replica_group.rank()
        mine_kinds = {k: (kind, q) for k, kind in _kinds(opt, bucket, subs).items()}
        for raw in gather(_CALL, pickle.dumps(mine_kinds), bucket.replica_group):
            for k, v in pickle.loads(raw).items():
                held.setdefault(k, v)
        _fill(opt, bucket, subs, held, gathered)
    for p in opt._zerokit.local_params:  # rank-local parameters: their own state, kept
        if p in opt.state:
            gathered[p] = opt.state[p]
    for group, given in zip(opt.param_groups, opt._zerokit.group_params):
        kept = {id(p) for p in group["params"]}
        group["params"] = [
            v for p in given for v in whole_of.get(id(p), [p] if id(p) in kept else [])
        ]
    opt.state.clear()
    opt.state.update(gathered)


def _kinds(opt, bucket: FlatParamBucket, subs: list) -> dict:
    """What this rank holds of ``bucket``'s state: (slot, key) -> kind."""
    kinds = {}
    for piece, sub in subs:
        whole = bucket.layout.slots[piece.slot].whole
        for key, value in opt.state.get(sub, {}).items():
            if hasattr(value, "codes") and hasattr(value, "scale"):
                raise ValueError(
                    "a block-quantized optimizer state (torchao) sharded over replicas cannot "
                    "be checkpointed yet: wrap without shard_optimizer_over_replicas to save it"
                )
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                kinds[(piece.slot, key)] = (
                    ("owned", tuple(value.shape), value.dtype) if whole else ("piece", value.dtype)
                )
            else:
                kinds[(piece.slot, key)] = ("value", value)
    return kinds


def _fill(opt, bucket: FlatParamBucket, subs: list, held: dict, out: dict) -> None:
    """Each whole-shard piece's state (into ``out``) from what some replica holds."""
    lo = bucket.shard_start
    by_slot = {p.slot: (p, v) for p, v in zip(bucket.pieces, bucket.param_pieces)}
    keys = sorted(
        {(k, kind[1]) for (_, k), (kind, _) in held.items() if kind[0] == "piece"}, key=repr
    )
    for key, dtype in keys:  # one all-gather across the replicas per state key
        shard = torch.zeros(bucket.shard_end - lo, dtype=dtype, device=bucket.data.device)
        for piece, sub in subs:
            value = opt.state.get(sub, {}).get(key)
            if value is not None:
                at = bucket.layout.slots[piece.slot].offset + piece.start - lo
                shard[at : at + piece.numel].copy_(value.reshape(-1))
        start_all_gather_(shard, bucket.replica_group, ranges=bucket.replica_ranges).finish()
        for (slot, k), (kind, _) in held.items():
            if k == key and kind[0] == "piece" and slot in by_slot:
                piece, view = by_slot[slot]
                at = bucket.layout.slots[slot].offset + piece.start - lo
                value = shard[at : at + piece.numel].to(bucket.shard_data.device, copy=True)
                out.setdefault(view, {})[key] = value
    own = {p.slot: v for p, v in subs}
    for (slot, key), (kind, holder) in sorted(held.items(), key=repr):
        view = by_slot[slot][1]
        if kind[0] == "value":
            value = kind[1]
            out.setdefault(view, {})[key] = value.clone() if torch.is_tensor(value) else value
        elif kind[0] == "owned":  # a whole parameter's state: from the replica stepping it
            _, shape, dtype = kind
            if holder == bucket.replica_group.rank():
                tensor = opt.state[own[slot]][key].detach().clone()
            else:
                tensor = torch.empty(shape, dtype=dtype, device=bucket.data.device)
            broadcast_(tensor, bucket.replica_group, group_src=holder)
            out.setdefault(view, {})[key] = tensor.to(bucket.shard_data.device)


def _narrow(opt, buckets: list[FlatParamBucket], own: list[list], params: list) -> None:
    """Each rank keeps its sub-shard's part of ``opt``'s state (as saved, or as loaded)."""
    narrowed: dict = {}
    for bucket, subs in zip(buckets, own):
        whole = {p.slot: (p, v) for p, v in zip(bucket.pieces, bucket.param_pieces)}
        for piece, sub in subs:
            w_piece, w_view = whole[piece.slot]
            state = opt.state.get(w_view)
            if state is not None:
                narrowed[sub] = _slice(state, w_view, piece.start - w_piece.start, piece.numel)
    for p in opt._zerokit.local_params:
        if p in opt.state:
            narrowed[p] = opt.state[p]
    for group, kept in zip(opt.param_groups, params):
        group["params"] = kept
    opt.state.clear()
    opt.state.update(narrowed)


def _slice(state: dict, whole_view: torch.Tensor, start: int, numel: int) -> dict:
    """A sub-piece's share of a whole-shard piece's state: per-element tensors sliced (a
    parameter owned whole is one piece either way: its state kept as it is)."""
    out = {}
    for key, value in state.items():
        per_element = (
            whole_view.dim() == 1
            and isinstance(value, torch.Tensor)
            and tuple(value.shape) == tuple(whole_view.shape)
        )
        out[key] = (
            value.detach().reshape(-1)[start : start + numel].clone() if per_element else value
        )
    return out
