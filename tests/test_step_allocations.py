"""No allocation beyond the first step: a steady training step allocates the same tensors every
time, and zerokit's own share of them is what the design calls for (a figure per bucket and
per gather, never per parameter).

Counted, not measured: every aten op is seen by a ``TorchDispatchMode`` (on CPU the autograd
engine runs backward on the calling thread, whose modes it keeps), and each output whose storage
is none of its inputs' and holds bytes is one allocation (``lift_fresh``'s output too: it is how
``torch.tensor(data)`` hands over the storage it made below the dispatcher). A gather at
'p_g_os' refills a freed storage with ``UntypedStorage.resize_``, which no dispatcher sees: those
are counted by wrapping it. An allocation is zerokit's when the nearest Python frame that made
it, through torch's plumbing (``torch/_tensor.py``, ``torch/distributed``, ...), is in the
package, and not in torch's modules, optimizers or autograd (the model's forward, the user's
optimizer stepping its pieces, autograd's gradients: the same with or without zerokit).
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys

import pytest
import torch
from dist_helpers import run_distributed
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import zerokit
from zerokit.core.state import state_of

_ZEROKIT = os.path.dirname(zerokit.__file__) + os.sep
_TORCH = os.path.dirname(torch.__file__) + os.sep
_NOT_OURS = tuple(_TORCH + d + os.sep for d in ("nn", "optim", "autograd"))


def _zerokit_site(depth: int) -> str | None:
    """``file:line`` in zerokit that made this allocation, or None (the model's, the optimizer's,
    autograd's, the test's)."""
    frame = sys._getframe(depth)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_ZEROKIT):
            return f"{name[len(_ZEROKIT) :]}:{frame.f_lineno}"
        if name.startswith(_NOT_OURS) or not name.startswith(_TORCH):
            return None
        frame = frame.f_back  # torch's plumbing between zerokit and the op: look further out
    return None


class Allocations(TorchDispatchMode):
    """Tensors given storage while active: all of them, and zerokit's by (op, site)."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.nbytes = 0
        self.zerokit: collections.Counter[tuple[str, str]] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        fresh = func.overloadpacket is torch.ops.aten.lift_fresh
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if _is(t)}
        for t in tree_leaves(out):
            if _is(t) and t.untyped_storage().nbytes():
                if fresh or t.untyped_storage().data_ptr() not in inputs:
                    self.record(func.overloadpacket.__name__, t.untyped_storage().nbytes(), 3)
        return out

    def record(self, op: str, nbytes: int, depth: int) -> None:
        self.count += 1
        self.nbytes += nbytes
        site = _zerokit_site(depth + 1)
        if site is not None:
            self.zerokit[(op, site)] += 1

    def of(self, op: str) -> int:
        """zerokit's allocations by ``op``."""
        return sum(n for (o, _), n in self.zerokit.items() if o == op)


def _is(t) -> bool:
    return isinstance(t, torch.Tensor)


@contextlib.contextmanager
def counting():
    """An ``Allocations`` over the block, storage refills (``resize_`` from empty) included."""
    allocations = Allocations()
    resize = torch.UntypedStorage.resize_

    def counted_resize(storage, nbytes):
        if nbytes and not storage.nbytes():
            allocations.record("UntypedStorage.resize_", nbytes, 2)
        return resize(storage, nbytes)

    torch.UntypedStorage.resize_ = counted_resize
    try:
        with allocations:
            yield allocations
    finally:
        torch.UntypedStorage.resize_ = resize


class Net(nn.Module):
    """A root parameter of its own (the root unit) and three blocks (units), two parameters each:
    every bucket holds several parameters, so a per-parameter allocation shows."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.blocks = nn.Sequential(
            nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 11), nn.Tanh(), nn.Linear(11, 3)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x * self.scale)


def _run(rank, world_size, level, out, whole_grads=False):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = zerokit.ShardingConfig(whole_grads=whole_grads)
    model, opt, _ = zerokit.group_sharded_parallel(model, opt, level, config=config)
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(rank))
    steps = []
    for step in range(3):  # the first is the warm-up: the optimizer's state is made there
        with counting() if step else contextlib.nullcontext() as allocations:
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        if step:
            steps.append(allocations)
    state = state_of(model)
    root = len(state.root_group.buckets) if state.root_group is not None else 0
    units = [g for g in state.groups if g is not state.root_group]
    last = len(units[-1].buckets)  # the blocks run in registration order: the last runs last
    buckets = len(state.buckets)
    params = sum(len(b.params) for b in state.buckets)
    summary = [(a.count, a.nbytes, dict(a.zerokit)) for a in steps]
    out.put((rank, summary, buckets, root, last, params))


def _bound(level: str, buckets: int, root: int, last: int, whole: bool) -> dict[str, int]:
    """zerokit's allocations in one steady step at 2 gloo ranks, from docs/ARCHITECTURE.md
    ("Who owns which buffer", "The life of one step"), per kind; B buckets, R of them the root
    unit's. Nothing here scales with the parameters: a per-parameter tensor is not in the design.

    - 'os': each bucket's full gradient lives from its first gradient after
      ``zero_grad(set_to_none=True)`` to the next such call, so it is made again every step
      (B ``empty``, only the padding zeroed: every slot is written before the reduction).
      By default its reduce-scatter, on gloo, borrows a receive buffer from the staging pool
      (at most B ``empty`` more, as below); with ``whole_grads=True`` the all-reduce works in
      place. The all-gather after the step works in place.
    - 'os_g', 'p_g_os': each bucket's gradient shard likewise (B ``empty_like``: unfilled, its
      reduction writes every element); the staging
      pool is emptied when backward ends, so each bucket reduced borrows a fresh staged buffer
      and, on gloo, a fresh receive buffer for its reduce-scatter (at most 2B ``empty``: a
      returned buffer the same size as a later request is reused, which only lowers it).
    - every level at several ranks: the "holds a gradient" flags, one byte a parameter made a
      tensor once a step (``torch.tensor``: ``lift_fresh``) and read back as bools
      (``_to_copy``); at 'os' and 'os_g' the units' order digest, agreed every forward (one
      more ``lift_fresh``), at 'p_g_os' only when the order changed: not in a steady step.
    - 'p_g_os': a unit's full storage is freed after each use and refilled before the next: one
      gather per bucket of a unit per forward and per backward (2(B - R)), less the buckets of
      the forward's last unit (L), which stays gathered into its backward; the root unit is
      gathered once a step and stays so through backward (R).
    """
    sharded = level != "os"
    return {
        "empty_like": buckets if sharded else 0,
        "empty": buckets if whole else 2 * buckets,
        "lift_fresh": 1 if level == "p_g_os" else 2,
        "_to_copy": 1,
        "UntypedStorage.resize_": 2 * (buckets - root) + root - last if level == "p_g_os" else 0,
    }


@pytest.mark.parametrize(
    "level, whole", [("os", False), ("os", True), ("os_g", False), ("p_g_os", False)]
)
def test_a_steady_step_allocates_no_more_than_the_design(level, whole):
    import multiprocessing

    queue = multiprocessing.get_context("fork").SimpleQueue()
    run_distributed(_run, 2, level, queue, whole)
    for _ in range(2):
        rank, (second, third), buckets, root, last, params = queue.get()
        assert buckets == 4 and root == 1 and params == 7, (buckets, root, params)
        # Steady: the third step allocates exactly what the second did, tensors and bytes,
        # zerokit's at the same places: nothing grows step to step.
        assert third == second, (level, rank, second, third)
        count, _, ours = second
        bound = _bound(level, buckets, root, last, whole)
        kinds = collections.Counter()
        for (op, _), n in ours.items():
            kinds[op] += n
        # zerokit allocates only the kinds the design names, each within its figure.
        for op, n in kinds.items():
            assert n <= bound.get(op, 0), (level, rank, op, n, bound, ours)
        # Not blind: the counter sees the step's tensors and zerokit's own among them, and at
        # 2 ranks and buckets of different sizes each kind's figure is reached exactly.
        assert count > sum(kinds.values()) > 0, (level, rank, count, kinds)
        assert kinds == {op: n for op, n in bound.items() if n}, (level, rank, kinds, bound)
