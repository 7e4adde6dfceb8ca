"""Pipeline schedules as data: per stage, the ordered forward (``F``) and backward (``B``)
actions on micro-batches, then an executor that runs them.

The transfers follow from the actions (``PipelineModule`` does them): a forward receives its
input from the previous stage (not on the first) and sends its output on (not on the last,
which computes the loss); a backward receives its output's gradient from the next stage (not
on the last) and sends its input's gradient back (not on the first).

>>> " ".join(map(str, one_f_one_b(num_stages=4, stage=0, micro_batches=6)))
'F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5'
>>> " ".join(map(str, one_f_one_b(num_stages=4, stage=3, micro_batches=3)))
'F0 B0 F1 B1 F2 B2'
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Action:
    kind: str  # "F" or "B"
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}"


def naive(num_stages: int, stage: int, micro_batches: int) -> list[Action]:
    """The whole batch as one micro-batch: forward through every stage, then backward."""
    if micro_batches != 1:
        raise ValueError(
            f"the 'naive' schedule runs one micro-batch, got micro_batches={micro_batches}; "
            "use 'fthenb' or '1f1b' to split the batch"
        )
    return [Action("F", 0), Action("B", 0)]


def f_then_b(num_stages: int, stage: int, micro_batches: int) -> list[Action]:
    """GPipe: every forward, then every backward (gradients summed). Stage 0 holds the
    activations of all ``micro_batches`` at once."""
    return [Action("F", i) for i in range(micro_batches)] + [
        Action("B", i) for i in range(micro_batches)
    ]


def one_f_one_b(num_stages: int, stage: int, micro_batches: int) -> list[Action]:
    """PipeDream-flush / Megatron's 1F1B: ``num_stages - stage - 1`` warm-up forwards, then
    one forward and one backward in turn, then the remaining backwards. A stage holds at most
    ``num_stages - stage`` micro-batches' activations, whatever ``micro_batches`` is."""
    warmup = min(num_stages - stage - 1, micro_batches)
    actions = [Action("F", i) for i in range(warmup)]
    for i in range(micro_batches - warmup):
        actions += [Action("F", warmup + i), Action("B", i)]
    actions += [Action("B", i) for i in range(micro_batches - warmup, micro_batches)]
    return actions


SCHEDULES: dict[str, Callable[[int, int, int], list[Action]]] = {
    "naive": naive,
    "fthenb": f_then_b,
    "1f1b": one_f_one_b,
}


def schedule(name: str, num_stages: int, stage: int, micro_batches: int) -> list[Action]:
    if name not in SCHEDULES:
        raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {name!r}")
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    return SCHEDULES[name](num_stages, stage, micro_batches)


def peak_in_flight(actions: list[Action]) -> int:
    """The most micro-batches whose forward has run and backward has not, at once."""
    live = peak = 0
    for action in actions:
        live += 1 if action.kind == "F" else -1
        peak = max(peak, live)
    return peak


def execute(
    actions: list[Action], forward: Callable[[int], None], backward: Callable[[int, bool], None]
) -> None:
    """Run the actions in order; ``backward(i, last)`` is told whether it is this stage's last
    backward of the step (the one that reduces gradients across data-parallel ranks)."""
    last_b = max((k for k, a in enumerate(actions) if a.kind == "B"), default=-1)
    for k, action in enumerate(actions):
        if action.kind == "F":
            forward(action.micro_batch)
        else:
            backward(action.micro_batch, k == last_b)
