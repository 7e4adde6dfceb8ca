"""What one rank holds of the model and optimizer, named as the plain model names it: each
global tensor's full shape, dtype and split, and the chunks of it this rank holds (ARCHITECTURE,
"Checkpoints"). Every split is one ``TPSplit`` and the part this rank holds, whatever made it:
a tensor-parallel slice, a rank-local part (``tp.BatchGatherLinear``), or split experts (the
unsplit [E, ...] tensor along E in ep parts, held whole by the first rank of its
expert-data-parallel group). A ``PipelineModule`` is seen through its stage, under the whole
model's names; a layer shared by several stages is written by the first."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from ..core import as_optimizer_list, optimizer_params_of, plain_name, state_of
from ..moe.state_dict import expert_splits
from ..tensor_parallel.gather_batch import distributed_params
from ..tensor_parallel.layers import tensor_parallel_params
from ..tensor_parallel.topology import TPSplit
from .fields import CheckpointError

OPTIM_PREFIX = "optim"  # optimizer state of parameter P under key K: "optim.K.P"


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]  # the plain model's (full) shape
    dtype: torch.dtype
    split: TPSplit | None  # how the full tensor is split into parts, None if it is not
    tp_rank: int  # which part this rank holds

    def local_shape(self) -> tuple[int, ...]:
        if self.split is None:
            return self.shape
        shape = list(self.shape)
        shape[self.split.dim] = self.split.local_size(self.tp_rank)
        return tuple(shape)


@dataclass
class Chunk:
    name: str
    start: int  # flat offset within this rank's part of the tensor
    tensor: torch.Tensor  # 1-D view of the values (a parameter shard piece, a buffer, a state)
    primary: bool  # this rank writes it (one copy of every element across all ranks)


@dataclass
class Holdings:
    metas: dict[str, TensorMeta] = field(default_factory=dict)
    chunks: list[Chunk] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)  # tied name -> the name stored
    scalars: dict[str, dict] = field(default_factory=dict)  # param name -> optimizer scalars
    groups: list[dict] = field(default_factory=list)  # hyperparameters + parameter names
    state_names: dict[str, dict[str, str]] = field(default_factory=dict)  # param -> key -> name
    optimizer_class: str | list[str] | None = None  # for a list of optimizers, each one's
    group_optimizer: list[int] = field(default_factory=list)  # each group's optimizer (list)
    # param name -> {state key -> how its block-quantized state is stored}
    quantized: dict[str, dict[str, dict]] = field(default_factory=dict)
    # (parameter chunk, the tensor the optimizer keys its state by, which optimizer), in order
    optimizer_chunks: list[tuple[Chunk, torch.Tensor, int]] = field(default_factory=list)
    layout: dict = field(default_factory=dict)  # world size, level, dp/tp(/pp/ep) degrees
    pipeline: dict | None = None  # a PipelineModule's {"stage", "stages", "bounds"}
    model_config: dict[str, str] = field(default_factory=dict)  # config.json's text, ...

    @property
    def param_names(self) -> list[str]:
        return [n for n in self.metas if not n.startswith(OPTIM_PREFIX + ".")]


def _hyperparameters(group: dict) -> dict:
    out = {}
    for key, value in group.items():
        if key == "params":
            continue
        if isinstance(value, torch.Tensor):
            value = value.item()
        if isinstance(value, tuple):
            value = list(value)
        if value is None or isinstance(value, (bool, int, float, str, list)):
            out[key] = value
    return out


def _pipeline_of(model: nn.Module):
    from ..pipeline.module import PipelineModule  # checkpoint does not need pipeline otherwise

    return model if isinstance(model, PipelineModule) else None


def holder_of(model: nn.Module) -> nn.Module:
    """The module that holds the tensors: a ``PipelineModule``'s stage, else ``model``."""
    pipe = _pipeline_of(model)
    return pipe.stage if pipe is not None else model


def optimizers_of(optimizer) -> list[torch.optim.Optimizer]:
    """``save``/``load``'s ``optimizer`` argument as a list: none, one, or the list given."""
    if optimizer is None:
        return []
    given = as_optimizer_list(optimizer)
    for o in given:
        if not isinstance(o, torch.optim.Optimizer):
            raise CheckpointError(
                f"optimizer must be an optimizer or a list of them, got {type(o).__name__}"
            )
    return given


def model_config(model: nn.Module) -> dict[str, str]:
    """``config.json`` / ``generation_config.json`` of a model with a Hugging Face style
    ``config`` (anything with ``to_json_string``), as ``save_pretrained`` writes them."""
    files = {}
    for attribute in ("config", "generation_config"):
        config = getattr(model, attribute, None)
        if callable(getattr(config, "to_json_string", None)):
            files[f"{attribute}.json"] = config.to_json_string()
    return files


def collect(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None,
) -> Holdings:
    """This rank's holdings. Cheap: views only, nothing copied or gathered."""
    pipe = _pipeline_of(model)
    if pipe is not None:
        model = pipe.stage
    place = _place(model, pipe)
    h = Holdings(layout=place.layout, model_config=model_config(model))
    if pipe is not None:
        h.layout["pp_degree"] = pipe.num_stages
        h.pipeline = {
            "stage": pipe.stage_id,
            "stages": pipe.num_stages,
            "bounds": list(pipe.bounds),
        }
    names, params = {}, {}  # id(parameter) -> its first name, the parameter
    for name, p in model.named_parameters(remove_duplicate=False):
        name = place.global_name(name)
        if id(p) in names:
            h.aliases[name] = names[id(p)]
        else:
            names[id(p)], params[id(p)] = name, p
    owner = {}  # id(tensor the optimizer steps) -> the parameter chunk it is
    sharded = _collect_pieces(h, place, names, owner)
    for p_id, name in names.items():  # everything else whole: frozen (or unwrapped) parameters
        if p_id not in sharded:
            p = params[p_id]
            meta = h.metas[name] = place.meta_of(p, p.shape)
            chunk = Chunk(name, 0, p.detach().view(-1), place.writes_whole(p, name, meta))
            h.chunks.append(chunk)
            owner[p_id] = chunk
    _collect_buffers(h, place, model)
    if optimizer is not None:
        _collect_optimizer(h, optimizer, owner, names)
    return h


class _Part(NamedTuple):
    split: TPSplit
    part: int  # which part this rank holds
    writes_whole: bool | None  # held whole, does this rank write it (None: ``is_primary``)


@dataclass
class _Place:
    """Where this rank stands: its stage's names, its part of each split tensor, its place in
    the shard and replica groups; what it writes follows from these."""

    pipe: Any
    checkpoint_names: dict  # a stage's name -> (global name, whether this stage writes it)
    written: dict  # global name -> whether this stage writes it (a shared layer: one stage)
    state: Any  # the model's ShardState, None for a bare model
    parts: dict[int, _Part]  # id(split parameter) -> its split and this rank's part
    tp_rank: int
    group_rank: int
    replica_rank: int
    layout: dict  # as the checkpoint records it: world size, level, dp/tp/ep degrees

    def global_name(self, name: str) -> str:  # a compiled module's "_orig_mod." never shows
        return self.checkpoint_names[name][0] if self.pipe is not None else plain_name(name)

    def writes(self, name: str) -> bool:  # False: another stage writes this tensor (shared)
        return self.written[name] if self.pipe is not None else True

    def meta_of(self, p: torch.Tensor, local_shape, dtype=None) -> TensorMeta:
        shape, held = list(local_shape), self.parts.get(id(p))
        if held is None:
            return TensorMeta(tuple(shape), dtype or p.dtype, None, 0)
        shape[held.split.dim] = held.split.full_size
        return TensorMeta(tuple(shape), dtype or p.dtype, held.split, held.part)

    def is_primary(self, name: str, meta: TensorMeta, whole: bool) -> bool:
        replicated_copy = (meta.split is None and self.tp_rank != 0) or self.replica_rank != 0
        return self.writes(name) and not replicated_copy and (self.group_rank == 0 or not whole)

    def writes_whole(self, p: torch.Tensor, name: str, meta: TensorMeta) -> bool:
        """Does this rank write ``p``, held whole? A rank-local part: it alone holds it; split
        experts: the first rank holding its part; else as any tensor held whole."""
        first = self.parts[id(p)].writes_whole if id(p) in self.parts else None
        if first is not None:
            return self.writes(name) and first
        return self.is_primary(name, meta, whole=True)


def _place(model: nn.Module, pipe) -> _Place:
    state, split_of = state_of(model), tensor_parallel_params(model)
    tp_layout = next((layer.layout for layer, _ in split_of.values()), None)
    tp_rank = tp_layout.tp_rank if tp_layout else 0
    # one description of every split, the most specific last: tp slices, rank-local, experts
    parts = {i: _Part(s, tp_rank, None) for i, (_, s) in split_of.items() if s is not None}
    for i, d in _rank_local(model, split_of, pipe is not None).items():
        parts[i] = _Part(d.split, d.split_rank, True)
    experts = expert_splits(model)
    for i, e in experts.items():
        parts[i] = _Part(e.split, e.part, e.holders.rank() == 0)
    if state is not None:
        group_rank, group_size = state.process_group.rank(), state.process_group.size()
        # hybrid sharding: every replica holds the same shards; replica 0 writes them
        replica_rank = state.replica_group.rank() if state.replica_group is not None else 0
    else:  # a bare model: every data-parallel replica holds all of it
        replica_rank, group_size = 0, 1
        group_rank = (
            tp_layout.dp_rank if tp_layout else (dist.get_rank() if dist.is_initialized() else 0)
        )
        if pipe is not None and dist.is_initialized():  # the position among the stage's ranks
            in_stage = dist.get_rank() % (dist.get_world_size() // pipe.num_stages)
            group_rank = in_stage // (tp_layout.tp_degree if tp_layout else 1)
    layout = {
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "level": state.level if state else None,
        "dp_degree": tp_layout.dp_degree if tp_layout else None,
        "tp_degree": tp_layout.tp_degree if tp_layout else 1,
        "zero_group_size": group_size,
        "replicas": state.replica_group.size() if state and state.replica_group else 1,
    }
    if experts:  # split experts: E / ep of each layer's experts per rank
        layout["ep_degree"] = len(next(iter(experts.values())).split.block_sizes)
    names = pipe.checkpoint_names() if pipe is not None else {}
    return _Place(
        pipe, names, dict(names.values()), state, parts,
        tp_rank, group_rank, replica_rank, layout,
    )  # fmt: skip


def _collect_pieces(h: Holdings, place: _Place, names: dict, owner: dict) -> set[int]:
    """Trainable parameters under ZeRO: this rank's pieces of the flat buckets. Returns the
    ids of the parameters held in buckets."""
    sharded = set()
    if place.state is None:
        return sharded
    for bucket in place.state.buckets:
        # the fp32 master under mixed precision, whatever the compute copy's dtype
        dtype, slots = bucket.layout.dtype, bucket.layout.slots
        for piece, view in zip(bucket.pieces, bucket.param_pieces):
            p = bucket.params[piece.slot]
            name = names[id(p)]
            meta = h.metas[name] = place.meta_of(p, slots[piece.slot].shape, dtype)
            # 1-D, also where the piece is shaped like its parameter (owned whole: Muon)
            chunk = Chunk(name, piece.start, view.view(-1), place.is_primary(name, meta, False))
            h.chunks.append(chunk)
            owner[id(view)] = chunk
        for i, p in enumerate(bucket.params):  # a rank may hold no piece of a parameter
            h.metas.setdefault(names[id(p)], place.meta_of(p, slots[i].shape, dtype))
            sharded.add(id(p))
    return sharded


def _collect_buffers(h: Holdings, place: _Place, model: nn.Module) -> None:
    """Persistent buffers, whole."""
    for prefix, module in model.named_modules():
        for bname, buf in module._buffers.items():
            if buf is None or bname in module._non_persistent_buffers_set:
                continue
            name = place.global_name(f"{prefix}.{bname}" if prefix else bname)
            meta = h.metas[name] = TensorMeta(tuple(buf.shape), buf.dtype, None, 0)
            h.chunks.append(Chunk(name, 0, buf.view(-1), place.is_primary(name, meta, True)))


def _rank_local(model: nn.Module, split_of: dict, pipelined: bool) -> dict:
    """The rank-local (``is_distributed``) parameters, each one part of its split across the
    world (``tp.BatchGatherLinear``'s). Others are refused: a checkpoint cannot say whose
    part they are."""
    local = distributed_params(model)
    world = dist.get_world_size() if dist.is_initialized() else 1
    for d in local.values():
        why = None
        if d.split is None:
            why = "its split is not described (only tp.BatchGatherLinear's are)"
        elif (d.group.size() if d.group is not None else 1) != world:
            why = "its layer's group is not the whole world"
        elif split_of or pipelined:
            why = "the model also has tensor-parallel layers or pipeline stages"
        if why:
            raise NotImplementedError(
                f"{d.name} is a rank-local (is_distributed) parameter and {why}: "
                "zerokit.checkpoint cannot save or load it yet (it would save one rank's values "
                "as the whole parameter)"
            )
    return local


def _collect_optimizer(
    h: Holdings, optimizer, owner: dict[int, Chunk], names: dict[int, str]
) -> None:
    """Each optimizer's groups and state, in the order given (a list keeps its order)."""
    optimizers = optimizers_of(optimizer)
    classes = [type(o).__name__.removeprefix("Sharded") for o in optimizers]
    h.optimizer_class = classes if isinstance(optimizer, (list, tuple)) else classes[0]
    stepped_by: dict[str, int] = {}  # param name -> the optimizer stepping it
    for k, opt in enumerate(optimizers):
        given = optimizer_params_of(opt)  # whole parameters; a sharded group holds pieces
        for whole, group in zip(given, opt.param_groups):
            if any(id(p) not in names for p in whole):
                raise ValueError(
                    "the optimizer holds a tensor that is not a parameter of the model"
                )
            params = [names[id(p)] for p in whole]
            for name in params:
                if stepped_by.setdefault(name, k) != k:
                    raise CheckpointError(
                        f"{name} is in optimizers {stepped_by[name]} and {k} of the list: each "
                        "parameter must be stepped by one optimizer"
                    )
            for key_tensor in group["params"]:
                chunk = owner[id(key_tensor)]
                h.optimizer_chunks.append((chunk, key_tensor, k))
                for key, value in opt.state.get(key_tensor, {}).items():
                    _collect_state(h, chunk, key_tensor, key, value)
            h.groups.append({"hyperparameters": _hyperparameters(group), "params": params})
            h.group_optimizer.append(k)


def holds_all_of(chunk: Chunk, key_tensor: torch.Tensor, meta: TensorMeta) -> bool:
    """Does this rank hold all of the parameter (a bare model, or owned whole)?"""
    return chunk.start == 0 and key_tensor.numel() == math.prod(meta.local_shape())


def _collect_state(h: Holdings, chunk: Chunk, key_tensor: torch.Tensor, key: str, value) -> None:
    """One state entry of one parameter piece: per element, held whole in a shape of its own,
    block-quantized (torchao's: ``codes`` and one ``scale`` per block), or a scalar (the kinds:
    ARCHITECTURE, "Checkpoints")."""
    meta = h.metas[chunk.name]
    state_name = f"{OPTIM_PREFIX}.{key}.{chunk.name}"
    is_tensor = isinstance(value, torch.Tensor)
    if is_tensor and all(hasattr(value, a) for a in ("codes", "scale", "block_size")):
        _collect_quantized(h, chunk, key_tensor, key, value)
    elif is_tensor and value.dim() > 0:
        if tuple(value.shape) == tuple(key_tensor.shape):  # per element
            state_meta = TensorMeta(meta.shape, value.dtype, meta.split, meta.tp_rank)
            start = chunk.start
        elif holds_all_of(chunk, key_tensor, meta) and meta.split is None:
            state_meta, start = TensorMeta(tuple(value.shape), value.dtype, None, 0), 0
        else:
            raise CheckpointError(
                f"optimizer state {key!r} of {chunk.name} has shape {list(value.shape)}, not "
                f"its piece's {list(key_tensor.shape)}, and this rank holds only part of the "
                "parameter: an optimizer with such state must be stepped on whole parameters "
                "(ShardingConfig(whole_parameter_optimizer=True))"
            )
        h.state_names.setdefault(chunk.name, {})[key] = state_name
        h.metas[state_name] = state_meta
        h.chunks.append(Chunk(state_name, start, value.detach().reshape(-1), chunk.primary))
    else:  # a scalar (Adam's step), kept in the index
        h.scalars.setdefault(chunk.name, {})[key] = {
            "value": value.item() if is_tensor else value,
            "tensor_dtype": str(value.dtype).removeprefix("torch.") if is_tensor else None,
        }


def _collect_quantized(h: Holdings, chunk: Chunk, key_tensor, key: str, value) -> None:
    """Note: saved exactly, as its codes (their bytes) and scales: a piece starts on a block
    (``core/bucket_layout.place_owners``), so its codes and scales are slices of the ones one
    process holds for the whole parameter, and a load at any world size cuts them again."""
    meta, block = h.metas[chunk.name], value.block_size
    codes = value.codes.detach().reshape(-1)
    at = flat_part_start(meta)  # split experts: their codes and scales are a run of the whole's
    if at is None or codes.element_size() != 1 or (at + chunk.start) % block:
        raise CheckpointError(
            f"optimizer state {key!r} of {chunk.name} is block-quantized "
            f"({type(value).__name__}) on a tensor-parallel split other than whole rows, or "
            "off its blocks: zerokit.checkpoint cannot save it"
        )
    start = at + chunk.start  # in the whole parameter, flattened
    per_code = key_tensor.numel() // codes.numel()  # elements per code: 1, or 2 (4-bit)
    numel = math.prod(meta.shape)
    names = {part: f"{OPTIM_PREFIX}.{key}:{part}.{chunk.name}" for part in ("codes", "scale")}
    scale = value.scale.detach().reshape(-1)
    for part, stored, per in (
        ("codes", codes.view(torch.uint8), per_code),
        ("scale", scale, block),
    ):
        h.metas[names[part]] = TensorMeta((numel // per,), stored.dtype, None, 0)
        h.chunks.append(Chunk(names[part], start // per, stored, chunk.primary))
    signed = getattr(value, "signed", None)
    h.quantized.setdefault(chunk.name, {})[key] = {
        "class": type(value).__name__,
        "block_size": block,
        "signed": signed if isinstance(signed, bool) else None,
        **names,
    }


# Range arithmetic, pure: where a rank's flat range of its part lies in the full tensor.


def full_runs(meta: TensorMeta, start: int, numel: int) -> Iterator[tuple[int, int, int]]:
    """The flat element ranges ``[lo, hi)`` of the full tensor that hold elements
    ``[start, start + numel)`` of this rank's part, each with its offset in that request.
    Unsplit: one range. Split: a run per row of the split dimension (the tensor seen as
    [outer, rows, inner]), merged where contiguous."""
    split = meta.split
    if split is None:
        yield start, start + numel, 0
        return
    d, full_rows, rows = split.dim, meta.shape[split.dim], meta.local_shape()[split.dim]
    inner = math.prod(meta.shape[d + 1 :])
    part, before = split.block_sizes[meta.tp_rank], split.start(meta.tp_rank)
    block = sum(split.block_sizes)
    end, row, pending = start + numel, start // max(inner, 1), None
    while inner and row * inner < end:
        outer, j = divmod(row, rows)
        shift = (outer * full_rows + (j // part) * block + before + j % part - row) * inner
        lo, hi = max(start, row * inner), min(end, (row + 1) * inner)
        if pending and pending[1] == lo + shift:
            pending = (pending[0], hi + shift, pending[2])
        else:
            if pending:
                yield pending
            pending = (lo + shift, hi + shift, lo - start)
        row += 1
    if pending:
        yield pending


def _cuts_rows(split: TPSplit | None) -> bool:
    """Unsplit, or split along dim 0 in one block (split experts' E / ep, a colwise weight):
    each part is then one run of the whole tensor, flattened."""
    return split is None or (split.dim == 0 and split.stride == 1)


def flat_part_start(meta: TensorMeta) -> int | None:
    """Where this rank's part starts in the whole tensor, flattened, when it is one run of it
    (``_cuts_rows``); else None."""
    if not _cuts_rows(meta.split):
        return None
    return meta.split.start(meta.tp_rank) * math.prod(meta.shape[1:]) if meta.split else 0


def row_part_runs(
    meta: TensorMeta, saved: TPSplit | None, start: int, numel: int
) -> list[tuple[int, int, int, int]] | None:
    """Where elements ``[start, start + numel)`` of this rank's part lie in a checkpoint whose
    parts are split by ``saved``, when both splits cut whole rows (``_cuts_rows``: split
    experts at any ep): ``(saved part, start in it, numel, offset in the request)`` runs, so
    a load at another ep reads only this rank's rows. None for other splits (read it whole)."""
    if not (_cuts_rows(meta.split) and _cuts_rows(saved)):
        return None
    inner = math.prod(meta.shape[1:])
    sizes = saved.block_sizes if saved is not None else (meta.shape[0] if meta.shape else 1,)
    lo = flat_part_start(meta) + start  # the request, one run of the whole tensor
    runs, first = [], 0  # first: the saved part's first flat element in the whole tensor
    for part, rows in enumerate(sizes):
        a, b = max(lo, first), min(lo + numel, first + rows * inner)
        if a < b:
            runs.append((part, a - first, b - a, a - lo))
        first += rows * inner
    return runs
