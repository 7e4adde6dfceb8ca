"""What each optimizer needs of the shard layout: which elements one rank must hold together.

Three kinds are sharded, each exactly as one process steps it:

* elementwise (SGD, Adam, AdamW, ...): an element's update reads that element's gradient and
  state alone, so any split of the flat buffer is exact;
* whole-parameter (``torch.optim.Muon``: Newton-Schulz on the matrix; ``torch.optim.Adafactor``:
  row and column statistics, and a step size from the parameter's RMS; any optimizer declared
  so): every parameter it steps is owned whole by one rank (``core/bucket_layout.py``'s owner
  layout), which steps it on the averaged gradient;
* block-quantized states (torchao's ``AdamW8bit``, ``AdamW4bit``, ``AdamWFp8`` and the Adam
  variants): elementwise, but the state is quantized in blocks of ``block_size`` elements, so
  every boundary inside a parameter falls on a block, and whether a parameter is quantized
  at all is decided on the whole parameter (``core/optimizer.py``'s ``LowBitPieces``).

The cost that balances owners is the optimizer's work on a whole parameter: for Muon its five
Newton-Schulz iterations, each ~ m * n * min(m, n) multiply-adds for an m x n matrix; for
others the element count. Nothing here imports torchao: its optimizers are told by their
``block_size`` and ``_new_buffer`` (how torchao makes a state tensor).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

# An element's update reads only that element's gradient and state (and scalars).
ELEMENTWISE_OPTIMIZERS = tuple(
    getattr(torch.optim, name)
    for name in (
        "SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam",
        "RMSprop", "Rprop",
    )
)  # fmt: skip
# Each update reads the whole parameter (its matrix, its rows and columns, its norm).
WHOLE_PARAMETER_OPTIMIZERS = tuple(
    cls for cls in (getattr(torch.optim, n, None) for n in ("Muon", "Adafactor")) if cls
)
# Why these cannot be sharded at all.
REFUSED = {
    "LBFGS": "its line search evaluates the whole model many times per step and keeps one "
    "flat history of every parameter",
    "SparseAdam": "it takes sparse gradients, which zerokit's flat buckets cannot hold",
}


@dataclass(frozen=True)
class Need:
    """What one parameter's optimizer needs of the layout (``core/bucket_layout.ParamSpec``)."""

    whole: bool = False  # one rank steps all of it
    block: int = 1  # a boundary inside it falls on a multiple of this
    cost: float = 0.0  # the work of stepping it whole, for balancing owners
    optimizer: int = 0  # which of the model's optimizers steps it (buckets never mix two)
    # a rank's part of a larger parameter (split experts): the unsplit one's element count,
    # which torchao's quantize-or-not rule reads (``core/optimizer.py``'s ``LowBitPieces``)
    whole_numel: int | None = None


# torchao quantizes a state only when its tensor has at least this many elements
LOW_BIT_MIN_NUMEL = 4096


def is_low_bit(optimizer: torch.optim.Optimizer) -> bool:
    """A torchao optimizer with block-quantized states."""
    return isinstance(getattr(optimizer, "block_size", None), int) and hasattr(
        optimizer, "_new_buffer"
    )


def is_whole_parameter(optimizer: torch.optim.Optimizer, declared: bool) -> bool:
    """Does its update read whole parameters? The class's own ``zerokit_whole_parameter``
    decides first; then Muon and Adafactor do; ``declared``
    (``ShardingConfig(whole_parameter_optimizer=True)``) speaks for the optimizers zerokit does
    not know, never for the elementwise or low-bit ones beside them in a list."""
    said = getattr(type(optimizer), "zerokit_whole_parameter", None)
    if said is not None:
        return bool(said)
    if isinstance(optimizer, WHOLE_PARAMETER_OPTIMIZERS):
        return True
    known = isinstance(optimizer, ELEMENTWISE_OPTIMIZERS) or is_low_bit(optimizer)
    return declared and not known


def check_optimizer(
    optimizer: torch.optim.Optimizer, *, elementwise: bool = False, whole: bool = False
) -> None:
    """Refuse an optimizer zerokit cannot step exactly, saying why and what to do."""
    name = type(optimizer).__name__
    for refused, why in REFUSED.items():
        if isinstance(optimizer, getattr(torch.optim, refused)):
            raise ValueError(f"{name} cannot be sharded: {why}. Train it without zerokit.")
    if is_whole_parameter(optimizer, whole):
        return
    if elementwise or isinstance(optimizer, ELEMENTWISE_OPTIMIZERS) or is_low_bit(optimizer):
        return
    raise ValueError(
        f"{name} is not a known elementwise optimizer, nor one known to need whole "
        "parameters: zerokit steps each rank's shard separately, which is exact only when it "
        "knows what an update reads. Known: SGD, Adam, AdamW, Adagrad, RMSprop, ... "
        "(elementwise), Muon and Adafactor (whole parameters, each owned by one rank), "
        "torchao's low-bit AdamW (aligned blocks). If yours updates each element from that "
        "element alone, say so with config=zerokit.ShardingConfig(elementwise_optimizer=True); "
        "if it needs whole parameters, with ShardingConfig(whole_parameter_optimizer=True) "
        "or the class attribute zerokit_whole_parameter = True."
    )


def refuse_whole_on_slices(needs: dict[int, Need], sliced: dict[int, str]) -> None:
    """``sliced``: ``id(parameter)`` -> its name, for parameters a tensor-parallel rank holds a
    slice of (or will, once a plan is applied). Muon on a slice is not Muon on the matrix,
    which one process steps: refused, naming the first."""
    names = [sliced[i] for i, need in needs.items() if need.whole and i in sliced]
    if names:
        raise ValueError(
            f"{names[0]!r} is a tensor-parallel slice, and its optimizer reads whole "
            "parameters (Muon, Adafactor): stepping a slice is not stepping the matrix. Give "
            "tensor-parallel layers to an elementwise optimizer (AdamW), or train with tp = 1"
        )


def muon_cost(shape: Sequence[int]) -> float:
    """Newton-Schulz work on an m x n matrix: ~ m * n * min(m, n) per iteration."""
    if len(shape) < 2:
        return float(math.prod(shape))
    m, n = shape[0], math.prod(shape[1:])
    return float(m * n * min(m, n))


def needs_of(
    optimizers: Sequence[torch.optim.Optimizer], *, whole_declared: bool = False
) -> dict[int, Need]:
    """``id(parameter)`` -> its ``Need``, for the parameters whose optimizer cares where
    boundaries fall, or, with several optimizers, which one steps it (a lone elementwise
    optimizer's are left out: any layout is exact for them)."""
    needs: dict[int, Need] = {}
    for k, optimizer in enumerate(optimizers):
        muon = isinstance(optimizer, getattr(torch.optim, "Muon", ()))
        whole = is_whole_parameter(optimizer, whole_declared)
        block = optimizer.block_size if is_low_bit(optimizer) else 1
        for group in optimizer.param_groups:
            for p in group["params"]:
                shape = tuple(p.shape)
                if whole:
                    cost = muon_cost(shape) if muon else float(math.prod(shape))
                    needs[id(p)] = Need(whole=True, cost=cost, optimizer=k)
                elif block > 1 or k > 0:
                    needs[id(p)] = Need(block=block, optimizer=k)
    return needs


def with_whole_numel(
    needs: dict[int, Need], parts: dict[int, tuple[str, int, int]]
) -> dict[int, Need]:
    """``needs`` with each low-bit part's unsplit size. ``parts``: ``id(parameter)`` -> (its
    name, its element count, the unsplit parameter's), for parameters a rank holds a part of
    (split experts: the part's E / ep experts start where the unsplit one's do). One process
    quantizes the unsplit parameter in blocks from its start: the part is quantized as it is
    only if it starts and ends on one of those blocks, else it is refused by name."""
    out = dict(needs)
    for key, (name, numel, whole) in parts.items():
        need = needs.get(key)
        if need is None or need.block == 1:
            continue
        if whole >= LOW_BIT_MIN_NUMEL and whole % need.block == 0 and numel % need.block:
            raise ValueError(
                f"{name!r} ({numel} values on this rank, {whole} unsplit) is quantized in "
                f"blocks of {need.block} over the whole parameter, and this rank's part does "
                "not end on a block, so its low-bit state could not be one process's: use an "
                "ep that leaves each rank a multiple of the block, a block_size dividing the "
                "part, or AdamW for these parameters"
            )
        out[key] = replace(need, whole_numel=whole)
    return out
