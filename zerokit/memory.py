"""What each level costs in memory: estimated from shapes, and measured from what a rank holds.

``estimate`` follows the ZeRO paper's accounting per parameter (fp32 Adam: 4 bytes parameter +
4 gradient + 8 optimizer state; mixed-precision Adam: 2 + 2 + 12) with zerokit's own padding,
computed from the same bucket and unit layouts the levels build. ``measure`` counts the tensors
a rank really holds, each storage once, in the same categories. Both are bytes per rank.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace

import torch
from torch import nn

from .activation_memory import (  # noqa: F401
    ActivationEstimate,
    ActivationMeasurement,
    estimate_activations,
    measure_activations,
)
from .config import LEVELS
from .core import as_optimizer_list, is_placeholder, plan_groups, plan_units, state_of
from .mixed_precision import MixedPrecision

#: optimizer state tensors per parameter element (fp32), by optimizer name
STATE_PER_PARAM = {"adam": 2, "adamw": 2, "sgd": 1, "adagrad": 1, "rmsprop": 1, "none": 0}
ESTIMATE_LEVELS = ("ddp", *LEVELS)  # DDP beside every level
_LEVEL_ALIASES = {"dp": "ddp"}  # the name estimate() used first


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank (the largest over ranks) of model state, by category."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def estimate(
    model_or_num_params: nn.Module | int | float,
    level: str,
    world_size: int,
    *,
    mixed_precision: bool | MixedPrecision = False,
    paper: bool = False,
    optimizer: str = "adam",
    buffer_max_size: int = 2**23,
    segment_size: int = 2**20,
    sharding_degree: int | None = None,
    optimizer_over_replicas: bool = False,
) -> MemoryEstimate:
    """Model-state bytes per rank at ``level`` ('ddp' is plain data parallelism, as torch
    DDP holds it; 'dp' is accepted as another name for it).

    With a model, padding is that of zerokit's real layout for the level; with a parameter
    count (an int, or a whole-valued float such as ``7.5e9``), one padding of fewer than
    ``world_size`` elements is assumed.
    ``mixed_precision``: a ``MixedPrecision`` policy (``True``: bf16 compute, fp32
    reduction) gives what zerokit holds with it, as ``measure`` counts it: the compute copy in
    ``param_dtype`` and the fp32 master shard under parameters, gradients in ``reduce_dtype``
    (full at 'os') or as fp32 shards ('os_g', 'p_g_os'). ``paper=True`` instead follows the
    ZeRO paper's accounting, which assumes fp16 gradients: 2 + 2 + 12 bytes per parameter in
    mixed precision, 4 + 4 + 8 in fp32.

    >>> gb = lambda e: round(e.total / 1e9, 1)  # the ZeRO paper's 7.5B model on 64 GPUs
    >>> [gb(estimate(7_500_000_000, lvl, 64, mixed_precision=True, paper=True))
    ...  for lvl in ESTIMATE_LEVELS]
    [120.0, 31.4, 16.6, 1.9]
    >>> [gb(estimate(7_500_000_000, lvl, 64, mixed_precision=True)) for lvl in ESTIMATE_LEVELS]
    [135.0, 46.4, 16.9, 1.9]
    >>> estimate(7.5e9, "os", 64) == estimate(7_500_000_000, "os", 64)
    True

    ``sharding_degree``: hybrid sharding (a replica group): the state is sharded over this many
    ranks and replicated over ``world_size / sharding_degree``, so a rank holds what it would
    hold at a world of ``sharding_degree`` ranks.

    >>> e8, e2 = estimate(10**9, "p_g_os", 8), estimate(10**9, "p_g_os", 8, sharding_degree=2)
    >>> round(e8.total / 1e9, 1), round(e2.total / 1e9, 1)
    (2.0, 8.0)

    ``optimizer_over_replicas`` (``ShardingConfig.shard_optimizer_over_replicas``): under
    hybrid sharding the optimizer state is sharded over the R = ``world_size /
    sharding_degree`` replicas too, 1/R of it per rank (each shard padded to R sub-shards).

    >>> on = estimate(10**9, "os_g", 8, sharding_degree=2, optimizer_over_replicas=True)
    >>> e2 = estimate(10**9, "os_g", 8, sharding_degree=2)
    >>> e2.optimizer // on.optimizer, on.params == e2.params
    (4, True)
    """
    shard_world = _hybrid_world(level, world_size, sharding_degree)
    replicas = world_size // shard_world if optimizer_over_replicas else 1
    whole = _estimate(
        model_or_num_params, level, shard_world, mixed_precision, paper, optimizer,
        buffer_max_size, segment_size,
    )  # fmt: skip
    if replicas == 1 or level in ("ddp", "dp"):
        return whole
    # the shard cut into R sub-shards (padded to a multiple of R elements: under R each)
    return replace(whole, optimizer=-(-whole.optimizer // replicas))


def _estimate(
    model_or_num_params, level, world_size, mixed_precision, paper, optimizer, buffer_max_size,
    segment_size,
) -> MemoryEstimate:  # fmt: skip
    """``estimate`` at ``world_size`` ranks sharding the state (the shard group's)."""
    level = _LEVEL_ALIASES.get(level, level)
    model_or_num_params = _model_or_count(model_or_num_params)
    if level not in ESTIMATE_LEVELS:
        raise ValueError(f"unknown level {level!r}; valid: {', '.join(ESTIMATE_LEVELS)}")
    if optimizer not in STATE_PER_PARAM:
        raise ValueError(f"unknown optimizer {optimizer!r}; valid: {', '.join(STATE_PER_PARAM)}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if mixed_precision is True and not paper:
        mixed_precision = MixedPrecision(param_dtype=torch.bfloat16)
    full, shard = _full_and_shard_numel(
        model_or_num_params, level, world_size, buffer_max_size, segment_size
    )
    if isinstance(mixed_precision, MixedPrecision):
        if mixed_precision.param_dtype is not None:
            return _estimate_policy(mixed_precision, level, world_size, full, shard, optimizer)
        reduce = mixed_precision.gradient_reduce_dtype()
        if reduce is not None and reduce.itemsize != 4 and level == "os":
            # fp32 compute; the full gradient in reduce_dtype beside the fp32 piece the
            # optimizer reads ('os_g'/'p_g_os' reduce into fp32 shards: nothing changes)
            state = 4 * STATE_PER_PARAM[optimizer]
            grads = shard * world_size * reduce.itemsize + shard * 4  # trainable ones only
            return MemoryEstimate(full * 4, grads, shard * state)
        mixed_precision = False  # compute in the parameters' own dtype: nothing changes
    return _estimate_plain(level, full, shard, optimizer, bool(mixed_precision))


def _hybrid_world(level: str, world_size: int, sharding_degree: int | None) -> int:
    """The world a rank's holdings depend on: hybrid sharding holds what a world of
    ``sharding_degree`` ranks would (replicas change nothing a rank holds)."""
    if sharding_degree is None:
        return world_size
    if not isinstance(sharding_degree, int) or sharding_degree < 1:
        raise ValueError(f"sharding_degree must be an integer >= 1, got {sharding_degree!r}")
    if world_size % sharding_degree:
        raise ValueError(f"sharding_degree {sharding_degree} must divide world_size {world_size}")
    return world_size if level in ("ddp", "dp") else sharding_degree


def _estimate_plain(level, full: int, shard: int, optimizer, mixed: bool) -> MemoryEstimate:
    """Without a policy: fp32, or the ZeRO paper's mixed precision (fp16 gradients)."""
    param_bytes = grad_bytes = 2 if mixed else 4
    # mixed precision keeps fp32 master weights in the optimizer: 4 bytes more per element
    state_bytes = 4 * STATE_PER_PARAM[optimizer] + (4 if mixed else 0)
    if level == "ddp":
        return MemoryEstimate(full * param_bytes, full * grad_bytes, full * state_bytes)
    if level == "os":
        return MemoryEstimate(full * param_bytes, full * grad_bytes, shard * state_bytes)
    if level == "os_g":
        return MemoryEstimate(full * param_bytes, shard * grad_bytes, shard * state_bytes)
    return MemoryEstimate(shard * param_bytes, shard * grad_bytes, shard * state_bytes)


def paper_volume(level: str) -> int:
    """The ZeRO paper's communication volume of a step, in multiples of Ψ(N-1)/N elements
    (Ψ parameters over N ranks): 2 at stages 1 and 2 (a reduce-scatter and an all-gather, as
    an all-reduce), 3 at stage 3 (the parameters gathered once more, for backward).

    >>> [paper_volume(level) for level in ("os", "os_g", "p_g_os")]
    [2, 2, 3]
    """
    return 3 if level == "p_g_os" else 2


def paper_bytes_per_step(level: str, numel: int, world_size: int, itemsize: int) -> int:
    """What a rank sends in a step by the ZeRO paper: ``paper_volume(level)`` Ψ(N-1)/N
    elements of ``itemsize`` bytes."""
    return round(paper_volume(level) * numel * (world_size - 1) / world_size * itemsize)


def _estimate_policy(mp, level, world_size, full, shard, optimizer) -> MemoryEstimate:
    compute = mp.param_dtype.itemsize
    reduce = mp.gradient_reduce_dtype().itemsize
    master = 4  # fp32 master weights
    state = 4 * STATE_PER_PARAM[optimizer]
    if level == "ddp":  # data parallel with fp32 masters beside the compute copy (torch AMP style)
        return MemoryEstimate(full * (compute + master), full * master, full * state)
    frozen = full - shard * world_size  # whole on every rank, cast to the compute dtype
    if level == "p_g_os":  # between steps no compute copy exists: only the master shards
        return MemoryEstimate(shard * master + frozen * compute, shard * master, shard * state)
    params = full * compute + shard * master
    if level == "os_g":
        return MemoryEstimate(params, shard * master, shard * state)
    grads = (full - frozen) * reduce + (shard * master if reduce != master else 0)
    return MemoryEstimate(params, grads, shard * state)


def _model_or_count(x):
    """A model as it is; a parameter count as an int (a float only if it is whole)."""
    if isinstance(x, nn.Module):
        return x
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(
            f"estimate() takes an nn.Module or a number of parameters, got {type(x).__name__}"
        )
    if isinstance(x, numbers.Integral) or float(x).is_integer():
        count = int(x)
    else:
        raise ValueError(f"the number of parameters must be a whole number, got {x!r}")
    if count < 0:
        raise ValueError(f"the number of parameters must be >= 0, got {count}")
    return count


def _full_and_shard_numel(model_or_n, level, world_size, buffer_max_size, segment_size):
    """(elements of a full flat copy, elements of one rank's shard), padding included."""
    if isinstance(model_or_n, int):
        padded = -(-model_or_n // world_size) * world_size
        return (model_or_n if level == "ddp" else padded), padded // world_size
    # an already wrapped model: its parameters' true shapes from the buckets ('p_g_os' leaves
    # them empty between uses); the level and world size asked for, not the wrapped ones
    state = state_of(model_or_n)
    shapes = state.param_shapes() if state is not None else {}

    def shape_of(p: nn.Parameter) -> tuple[int, ...]:
        return tuple(shapes.get(id(p), p.shape))

    named = [(n, p) for n, p in model_or_n.named_parameters() if p.requires_grad]
    frozen = sum(p.numel() for p in model_or_n.parameters() if not p.requires_grad)
    trainable = sum(math.prod(shape_of(p)) for _, p in named)
    if level == "ddp":
        return trainable + frozen, trainable // world_size
    # the layout the core builds: each unit's buckets, split at buffer_max_size, every level
    plans = plan_units(model_or_n, named, segment_size=segment_size, shape_of=shape_of)
    grouped = plan_groups(plans, world_size, buffer_max_size, shape_of=shape_of)
    layouts = [b for _, buckets in grouped for b in buckets]
    padded = sum(layout.padded_numel for layout in layouts)
    # frozen parameters stay whole on every rank, outside the buckets (counted as parameters)
    return padded + frozen, padded // world_size


@dataclass(frozen=True)
class MemoryMeasurement:
    """Bytes this rank holds, each storage counted once; ``peak`` is documented on ``measure``."""

    params: int
    grads: int
    optimizer: int
    peak: int | None = None

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


class StorageCounter:
    """Bytes of the distinct storages among the tensors it is called with, each storage once
    over every call: placeholders hold none, FSDP2's DTensors count their local shard, low-bit
    states their codes and scales, and meta storages (``zerokit plan``'s dry run, all at
    address 0) are told apart by identity."""

    def __init__(self) -> None:
        self._seen: set[tuple[int, int]] = set()

    def __call__(self, tensors) -> int:
        from torch.distributed.tensor import DTensor

        total = 0
        for t in tensors:
            if not isinstance(t, torch.Tensor) or is_placeholder(t):
                continue
            if isinstance(t, DTensor):
                t = t.to_local()
            if hasattr(t, "__tensor_flatten__"):
                names, _ = t.__tensor_flatten__()
                total += self(getattr(t, name) for name in names)
                continue
            storage = t.untyped_storage()
            key = (storage.data_ptr() or storage._cdata, storage.nbytes())
            if storage.nbytes() and key not in self._seen:
                self._seen.add(key)
                total += storage.nbytes()
        return total


def measure(model: nn.Module, optimizer, peak: PeakMemory | None = None) -> MemoryMeasurement:
    """Count the parameter, gradient and optimizer-state bytes this rank holds.

    Works on a plain model, DDP, FSDP2 (local shards) and every zerokit level: parameters are
    the model's parameter storages plus zerokit's shards (stage-3 parameters are empty between
    uses); gradients are every ``.grad`` on the model's and the optimizer's parameters plus
    zerokit's gradient buffers; optimizer state is every tensor in the optimizer's state.
    With ``peak``, its reading is included: see ``PeakMemory``.
    """
    count = StorageCounter()  # one for every category: a storage is counted once
    optimizers = as_optimizer_list(optimizer)
    # ZeroRedundancyOptimizer keeps its own inner optimizer
    inners = [getattr(opt, "optim", opt) for opt in optimizers]
    held = state_of(model).held_tensors() if state_of(model) is not None else {}
    params = count([p.data for p in model.parameters()] + held.get("params", []))
    opt_params = [p for inner in inners for g in inner.param_groups for p in g["params"]]
    zk_grads = held.get("grads", []) + held.get("staging", [])
    grads = count([p.grad for p in model.parameters()] + [p.grad for p in opt_params] + zk_grads)
    state = count(v for inner in inners for s in inner.state.values() for v in s.values())
    return MemoryMeasurement(params, grads, state, peak.read() if peak is not None else None)


class PeakMemory:
    """Peak memory of this process since ``start()``, above what it held at ``start()``.

    CUDA: torch's allocator statistics (``max_memory_allocated``). CPU: the kernel's own
    high-water mark of resident memory (``VmHWM`` in ``/proc/self/status``), reset at
    ``start()`` through ``/proc/self/clear_refs``; the reading is that peak minus the resident
    size at ``start()``. It counts every byte the process touched (tensors, allocator caches,
    the Python heap), so call ``start()`` before building the model to include its state.
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.baseline = 0

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline = torch.cuda.memory_allocated(self.device)
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current resident size
            self.baseline = _proc_status_bytes("VmRSS")

    def read(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self.baseline
        return _proc_status_bytes("VmHWM") - self.baseline


def _proc_status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024  # the kernel reports kB
    raise RuntimeError(f"{key} not found in /proc/self/status (peak memory needs Linux)")


def format_bytes(n: int) -> str:
    """Bytes with a unit that keeps small models readable: B, KiB, MiB or GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
