"""Where a training step's time goes, per phase, for ``benchmarks/step_time.py --breakdown``.

A ``Breakdown`` wraps zerokit's entry points (the hooks' state calls, the waits on
collectives, the collectives' launches, the optimizer step) with timers that keep *exclusive*
time: a call's time less the time of the timed calls nested in it, so the categories add up to
the step. Waits are told apart by the phase they happen in (forward, backward, step). What no timer covers inside ``forward``/``backward``/``step`` is the model's own
compute (and, for DDP and FSDP2, their hooks and waits, which run in C++ or are not wrapped).

It patches classes and modules for the whole process: build it after every runner is built,
and use it for timing the breakdown only (the timers cost about a microsecond a call).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import sys
import time

from zerokit.core import collectives, flat_param, gradients, optimizer, state
from zerokit.runtime import presence

WAITS = "waits on collectives"  # split by the phase they happen in: "... in backward"
# and by what is waited for: the first of these zerokit functions up the caller's stack
_WAITED_FOR = {
    "wait_for_unshard": "gathers",
    "_finish_oldest": "reductions",
    "_end_of_backward": "reductions",
    "_settle_order_vote": "order vote",
    "refresh_params": "after-step gather",
}
# (object, attribute, category): what is timed, and which category its exclusive time joins
_TIMED = [
    (state.ShardState, "root_pre_forward", "forward hooks"),
    (state.ShardState, "unit_pre_forward", "forward hooks"),
    (state.ShardState, "unit_post_forward", "forward hooks"),
    (state.ShardState, "root_post_forward", "forward hooks"),
    (state.ShardState, "begin_backward", "backward hooks"),
    (state.ShardState, "unit_pre_backward", "backward hooks"),
    (state.ShardState, "grad_ready", "backward hooks"),
    (state.ShardState, "unit_post_backward", "backward hooks"),
    (state.ShardState, "_end_of_backward", "backward hooks"),
    (state.ShardState, "zero_grad", "zero_grad"),
    (presence, "wait", WAITS),
    (presence.Presence, "mark", "store marks"),
    (gradients.ShardedGradients, "start_reduce", "gradient reduction launch"),
    (gradients.FullGradients, "start_reduce", "gradient reduction launch"),
    (collectives.Pending, "finish", "collective epilogues"),
    (flat_param.FlatParamBucket, "start_unshard", "parameter all-gather launch"),
    (flat_param.FlatParamBucket, "start_gather_updated", "parameter all-gather launch"),
    (state.ShardState, "refresh_params", "after-step parameter refresh"),
    (optimizer.ShardedOptimizer, "step", "optimizer step"),
]
PHASES = ("forward", "backward", "step", "zero_grad")


def _waited_for() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        what = _WAITED_FOR.get(frame.f_code.co_name)
        if what is not None:
            return what
        frame = frame.f_back
    return "other"


class Breakdown:
    """Exclusive seconds per category, summed over the steps timed since ``reset()``."""

    def __init__(self):
        self.seconds: collections.Counter[str] = collections.Counter()
        self.steps = 0
        self._children = [0.0]  # per open timer: time of the timed calls nested in it
        self._phase = ""  # the step's phase now open (forward, backward, step, zero_grad)
        self._restore = []
        for owner, name, category in _TIMED:
            original = getattr(owner, name)
            self._restore.append((owner, name, original))
            setattr(owner, name, self._timed(original, category))

    def _timed(self, fn, category: str):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with self.timing(category):
                return fn(*args, **kwargs)

        return wrapper

    @contextlib.contextmanager
    def timing(self, category: str):
        if category in PHASES:
            self._phase = category
        elif category == WAITS:  # which wait: the after-step gather's is one "in step"
            category = f"{WAITS} in {self._phase or 'none'}: {_waited_for()}"
        self._children.append(0.0)
        start = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - start
            nested = self._children.pop()
            self.seconds[category] += spent - nested
            self._children[-1] += spent

    def reset(self) -> None:
        self.seconds.clear()
        self.steps = 0

    def per_step_ms(self) -> dict[str, float]:
        return {k: v * 1e3 / max(self.steps, 1) for k, v in self.seconds.items()}

    def close(self) -> None:
        for owner, name, original in self._restore:
            setattr(owner, name, original)
