"""``release``: the core undone, the inverse of ``build`` (what ``zerokit.unwrap`` calls).

Each parameter gets its full value back, in storage of its own, in the dtype it was wrapped in
(the fp32 masters under mixed precision); each optimizer its own class, its param groups the
parameters it was built from (hyperparameters kept) and each parameter's FULL state. A rank
holds only its pieces of that state, so every per-element state tensor is all-gathered within
the shard group (replicas hold the same shards; where the optimizer state is sharded over them
too, each its sub-shard: gathered across them first) and cut per parameter; scalar state (``step``)
is the same on every rank holding a piece. Every hook is removed.

A block-quantized state (torchao's ``AdamW8bit``, ``AdamW4bit``, ``AdamWFp8``) comes back
quantized, as one process holds it: the optimizer makes the whole parameter's state as it
would at its first step, and its codes and scales are filled from every rank's pieces (a piece
starts on a block, so they are slices of the whole one's); nothing is dequantized.

Note: gradients are not given back (``.grad`` is None for every sharded parameter): at
'os_g' / 'p_g_os' no rank holds a full gradient.
"""

from __future__ import annotations

import itertools
import pickle

import torch

from .agreement import gather
from .checks import forget_wrapped
from .collectives import start_all_gather_
from .flat_param import FlatParamBucket
from .module import restore_module_
from .optimizer import restore_optimizer_
from .state import ShardState

_CALL = "zerokit.unwrap()"


def release(state: ShardState, optimizers: list[torch.optim.Optimizer]) -> None:
    """Undo ``build`` for ``state``'s model and ``optimizers`` (every one wrapped with it), in
    place. Collective over the shard group (and its replicas), between steps."""
    _check_optimizers(state, optimizers)
    if state.in_backward:
        raise RuntimeError("zerokit.unwrap was called inside a backward; call it between steps")
    state.presence.mark(_CALL)
    full_states = [_full_optimizer_state(opt, state) for opt in optimizers]
    for bucket in state.buckets:
        _give_back_params(bucket)
    for handle in state.hook_handles:
        handle.remove()
    state.hook_handles.clear()
    model = state.model
    forget_wrapped(model.parameters())
    restore_module_(model)
    for opt, full_state in zip(optimizers, full_states):
        restore_optimizer_(opt, full_state)


def _check_optimizers(state: ShardState, optimizers: list[torch.optim.Optimizer]) -> None:
    """Exactly the optimizers wrapped with this model: none left stepping shards."""
    for opt in optimizers:
        sharded = getattr(opt, "_zerokit", None)
        if sharded is None or sharded.shard_state is not state:
            raise ValueError(
                "zerokit.unwrap: this optimizer was not wrapped together with this model; pass "
                "the optimizer group_sharded_parallel returned with it"
            )
    if {id(opt) for opt in optimizers} != state.optimizer_ids:
        raise ValueError(
            f"zerokit.unwrap: the model was wrapped with {len(state.optimizer_ids)} "
            f"optimizer(s) and {len(optimizers)} were given; pass the list "
            "group_sharded_parallel returned, so none is left stepping shards"
        )


def _give_back_params(bucket: FlatParamBucket) -> None:
    """Each parameter of ``bucket``: its full value from every rank's master shard, in
    storage of its own (no view of the bucket), in the dtype it was wrapped in."""
    full = _all_gather_shard(bucket, bucket.shard_data)  # [padded], the masters' dtype
    for i, param in enumerate(bucket.params):
        param.data = bucket.slot_view(full, i).to(bucket.layout.device, copy=True)
        param.grad = None  # a GradPlaceholder, or a view of zerokit's gradient buffers


def _all_gather_shard(bucket: FlatParamBucket, shard: torch.Tensor) -> torch.Tensor:
    """The full flat buffer whose shards are every rank's ``shard`` (shard-size, 1-D)."""
    full = torch.zeros(bucket.layout.padded_numel, dtype=shard.dtype, device=bucket.data.device)
    bucket.shard(full).copy_(shard)
    if bucket.replica_group is not None:  # each replica filled its own sub-shard
        replicas, ranges = bucket.replica_group, bucket.replica_ranges
        start_all_gather_(bucket.shard(full), replicas, ranges=ranges).finish()
    start_all_gather_(full, bucket.group, ranges=bucket.ranges).finish()
    return full


def _full_optimizer_state(optimizer: torch.optim.Optimizer, state: ShardState) -> dict:
    """parameter -> its whole optimizer state, as one process stepping it would hold.

    First one exchange of what each rank holds (keys, dtypes, scalar values), so that ranks
    holding no piece of a parameter (or of a bucket) take part in the same collectives."""
    buckets = state.buckets
    mine = {}  # (bucket, slot) -> {key: ("piece", dtype) | ("value", value)}
    for b, bucket in enumerate(buckets):
        for piece, view in zip(bucket.pieces, bucket.param_pieces):
            whole = bucket.layout.slots[piece.slot].whole  # its owner holds all of its state
            for key, value in optimizer.state.get(view, {}).items():
                if _is_quantized(value) and not whole:
                    kind = ("quantized", _quantized_kind(value))
                elif isinstance(value, torch.Tensor) and value.dim() > 0 and not whole:
                    kind = ("piece", value.dtype)
                else:
                    kind = ("value", value)
                mine.setdefault((b, piece.slot), {})[key] = kind
    held: dict = mine
    for group in state.piece_groups:  # then across the replicas, where they split the pieces
        merged: dict = {}
        for raw in gather(_CALL, pickle.dumps(held), group):
            for where, keys in pickle.loads(raw).items():
                merged.setdefault(where, {}).update(keys)  # the same wherever a piece is held
        held = merged
    full: dict = {}
    for b, bucket in enumerate(buckets):
        _bucket_state(optimizer.state, b, bucket, held, full)
        _quantized_state(optimizer, b, bucket, held, full)
    for param in optimizer._zerokit.local_params:  # rank-local: stepped whole, kept as is
        if param in optimizer.state:
            full[param] = optimizer.state[param]
    return full


def _held_kinds(held: dict, b: int, slots: range, what: str) -> list:
    """The (state key, kind) pairs of one sort (``what``) held for ``bucket`` b's slots, in an
    order every rank agrees on (each pair is one collective)."""
    pairs = {
        (key, kind)
        for i in slots
        for key, (sort, kind) in held.get((b, i), {}).items()
        if sort == what
    }
    return sorted(pairs, key=repr)


def _bucket_state(opt_state, b: int, bucket: FlatParamBucket, held: dict, full: dict) -> None:
    slots = range(len(bucket.params))
    for i in slots:
        for key, (kind, value) in held.get((b, i), {}).items():
            if kind == "value":
                value = value.clone() if isinstance(value, torch.Tensor) else value
                full.setdefault(bucket.params[i], {})[key] = value
    per_element = _held_kinds(held, b, slots, "piece")
    for key, dtype in per_element:  # one all-gather per state tensor kind, for the bucket
        shard = torch.zeros(bucket.shard_end - bucket.shard_start, dtype=dtype)
        shard = shard.to(bucket.data.device)
        for piece, view in zip(bucket.pieces, bucket.param_pieces):
            value = opt_state.get(view, {}).get(key)
            if value is not None:
                start = bucket.layout.slots[piece.slot].offset + piece.start - bucket.shard_start
                shard[start : start + piece.numel].copy_(value)
        flat = _all_gather_shard(bucket, shard)
        for i in slots:
            if held.get((b, i), {}).get(key, (None,))[0] == "piece":
                value = bucket.slot_view(flat, i).to(bucket.layout.device, copy=True)
                full.setdefault(bucket.params[i], {})[key] = value


def _is_quantized(value) -> bool:
    """A block-quantized state tensor: ``codes`` and one ``scale`` per ``block_size`` elements."""
    return isinstance(value, torch.Tensor) and all(
        hasattr(value, a) for a in ("codes", "scale", "block_size")
    )


def _quantized_kind(value) -> tuple:
    """What every rank must agree on to gather a quantized state: its block, whether it is
    signed (torchao makes ``exp_avg`` signed, ``exp_avg_sq`` not), elements per code (2 for
    4-bit), the scales' dtype and the dtype it reads as."""
    signed = getattr(value, "signed", True)
    per_code = value.numel() // value.codes.numel()
    return value.block_size, signed, per_code, value.scale.dtype, value.dtype


def _quantized_state(optimizer, b: int, bucket: FlatParamBucket, held: dict, full: dict) -> None:
    """Each quantized state of ``bucket``'s parameters, whole and quantized. The codes (their
    bytes) and the scales of every piece are all-gathered laid at the piece's first element in
    the bucket (a piece holds no more codes or scales than elements), then copied into the
    state the optimizer makes for the whole parameter."""
    slots = range(len(bucket.params))
    kinds = _held_kinds(held, b, slots, "quantized")
    for key, kind in kinds:
        block, signed, per_code, scale_dtype, dtype = kind
        codes, scales = _gather_codes_and_scales(optimizer.state, bucket, key, scale_dtype)
        for i in slots:
            if held.get((b, i), {}).get(key) != ("quantized", kind):
                continue
            slot = bucket.layout.slots[i]
            like = torch.empty(slot.shape, dtype=dtype, device=bucket.layout.device)
            made = optimizer._new_buffer(like, signed)  # as one process makes it
            made_codes, made_scale = made.codes.view(-1).view(torch.uint8), made.scale.view(-1)
            every = range(bucket.layout.world_size), range(bucket.layout.replicas)
            for rank, replica in itertools.product(*every):  # every sub-shard's pieces
                for piece in bucket.layout.pieces(rank, replica):
                    if piece.slot != i:
                        continue
                    at = slot.offset + piece.start  # in the bucket's elements
                    n, m = piece.numel // per_code, piece.numel // block
                    made_codes[piece.start // per_code :][:n].copy_(codes[at : at + n])
                    made_scale[piece.start // block :][:m].copy_(scales[at : at + m])
            full.setdefault(bucket.params[i], {})[key] = made


def _gather_codes_and_scales(opt_state, bucket: FlatParamBucket, key: str, scale_dtype):
    """The bucket-long codes (bytes) and scales of state ``key``, every rank's pieces laid at
    their first element."""
    n = bucket.shard_end - bucket.shard_start
    codes = torch.zeros(n, dtype=torch.uint8, device=bucket.data.device)
    scales = torch.zeros(n, dtype=scale_dtype, device=bucket.data.device)
    for piece, view in zip(bucket.pieces, bucket.param_pieces):
        value = opt_state.get(view, {}).get(key)
        if _is_quantized(value):
            start = bucket.layout.slots[piece.slot].offset + piece.start - bucket.shard_start
            mine = value.codes.detach().reshape(-1).view(torch.uint8)
            codes[start : start + mine.numel()].copy_(mine)
            scale = value.scale.detach().reshape(-1)
            scales[start : start + scale.numel()].copy_(scale)
    return _all_gather_shard(bucket, codes), _all_gather_shard(bucket, scales)
