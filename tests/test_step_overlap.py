"""What a step overlaps, recorded from the calls (not timed where a call order says it):

* ``optimizer.step()`` at 'os'/'os_g' starts spreading a unit group's updated shards as soon
  as that group is stepped, while the next group steps, and returns only when every shard is
  spread: the parameters are current when it returns, equal to one process's.
* A forward at 'os'/'os_g' does not wait for the other ranks: the unit order vote is started
  at its end and read when backward launches its first reduction. At 'p_g_os' the forward
  reads it (backward's gathers follow the agreed order), so it waits.
* At 'p_g_os' the forward's last unit stays gathered into backward, whose first unit it is:
  it is gathered once per step, not twice, and freed if the forward ended with another unit.
"""

from __future__ import annotations

import collections
import copy
import time

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_distributed
from models import (
    SMALL,
    assert_same_params,
    global_batches,
    local_slice,
    loss_fn,
    make_model,
    make_optimizer,
    train_reference,
)
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

import zerokit
from zerokit.core.flat_param import FlatParamBucket, Storage
from zerokit.core.state import state_of

ATOL = 2e-5


def _step_order(rank, world_size, level):
    ref = make_model("awkward")
    model = copy.deepcopy(ref)
    ref_opt, opt = make_optimizer("adamw", ref), make_optimizer("adamw", model)
    model, opt, _ = zerokit.group_sharded_parallel(model, opt, level, **SMALL[level])
    groups = [g for g in state_of(model).groups if g.buckets]
    assert len(groups) > 2, "several unit groups: the step has a next group to hide behind"
    events: list[str] = []
    hook = register_optimizer_step_post_hook(lambda *_: events.append("step"))
    broadcast = dist.broadcast

    def recorded(*args, **kwargs):
        events.append("gather")
        return broadcast(*args, **kwargs)

    batches = global_batches(3, batch=2 * world_size)
    try:
        for x, y in batches:
            xs, ys = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
            loss_fn(model(xs), ys).backward()
            events.clear()
            dist.broadcast = recorded
            try:
                opt.step()
            finally:
                dist.broadcast = broadcast
            opt.zero_grad()
            # a group's shards are on the wire before the last group steps ...
            steps = [k for k, e in enumerate(events) if e == "step"]
            assert steps and "gather" in events[: steps[-1]], events
            # ... and step() returned with every parameter current (checked against one
            # process after the loop): nothing is left writing into them
    finally:
        hook.remove()
    train_reference(ref, ref_opt, batches)
    assert_same_params(model, ref, ATOL, f"{level}: spread while stepping")


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("level", ["os", "os_g"])
def test_step_spreads_each_group_while_the_next_steps(level, world_size):
    run_distributed(_step_order, world_size, level)


LATE = 1.5  # seconds rank 1 starts its forward after rank 0


def _forward_wait(rank, world_size, out_of_order):
    """Rank 1 comes late to every forward; rank 0 times its own. At 'os'/'os_g' rank 0's forward
    returns without rank 1; the ranks still agree the order and train as one process."""
    for level in ("os", "os_g", "p_g_os"):
        ref = make_model("gpt")
        model = copy.deepcopy(ref)
        ref_opt, opt = make_optimizer("adamw", ref), make_optimizer("adamw", model)
        model, opt, _ = zerokit.group_sharded_parallel(model, opt, level)
        batches = global_batches(3, batch=2 * world_size)
        took = []
        for step, (x, y) in enumerate(batches):
            xs, ys = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
            dist.barrier()
            if rank == 1:
                time.sleep(LATE)
            start = time.monotonic()
            if out_of_order and step == 1:  # a forward with grad whose backward never comes
                model(xs)  # (on every rank alike): its vote is finished with the next one's
            logits = model(xs)
            took.append(time.monotonic() - start)
            loss_fn(logits, ys).backward()
            opt.step()
            opt.zero_grad()
        train_reference(ref, ref_opt, batches)
        assert_same_params(model, ref, ATOL, f"{level}: forward without waiting")
        assert state_of(model).agreed_order is not None, level
        if rank == 0 and level != "p_g_os":  # its forward ran while rank 1 slept
            assert max(took) < LATE / 2, (level, took)
        if rank == 0 and level == "p_g_os":  # gathers pair the ranks: it waits for rank 1
            assert min(took) > LATE / 2, (level, took)


@pytest.mark.parametrize("out_of_order", [False, True])
def test_a_forward_does_not_wait_for_the_order_vote(out_of_order):
    run_distributed(_forward_wait, 2, out_of_order)


class Chain(nn.Module):
    """Three blocks run in ``order`` (the same on every rank), between an embedding and a head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8)) for _ in range(3)
        )
        self.head = nn.Linear(8, 11)
        self.order = [0, 1, 2]

    def forward(self, idx):
        x = self.emb(idx)
        for i in self.order:
            x = x + self.blocks[i](x)
        return self.head(x)


def _last_unit_kept(rank, world_size):
    torch.manual_seed(0)
    ref = Chain()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt, _ = zerokit.group_sharded_parallel(model, opt, "p_g_os")
    state = state_of(model)
    units = {id(b): g.name for g in state.groups if g is not state.root_group for b in g.buckets}
    largest = max(
        sum(b.layout.padded_numel for b in g.buckets)
        for g in state.groups
        if g is not state.root_group
    )
    root = sum(b.layout.padded_numel for b in state.root_group.buckets)
    per_unit = collections.Counter(units.values())  # buckets of each unit
    assert sorted(per_unit) == ["blocks.0", "blocks.1", "blocks.2"], per_unit
    gathers = collections.Counter()  # unit -> buckets gathered this step
    start_unshard = FlatParamBucket.start_unshard

    def counted(bucket):
        if bucket.storage is Storage.SHARDED and id(bucket) in units:
            gathers[units[id(bucket)]] += 1
        start_unshard(bucket)

    def gathered_units():
        return {g.name for g in state.groups if g is not state.root_group and g.gathered_numel()}

    # the blocks' orders per step: a change ends the forward with another unit than predicted
    # ([1, 2, 0]: no unit after blocks.2 prefetches it, so only the end of the forward frees it)
    orders = [[0, 1, 2], [0, 1, 2], [1, 2, 0], [1, 2, 0]]
    batches = global_batches(len(orders), batch=2 * world_size)
    FlatParamBucket.start_unshard = counted
    try:
        for step, ((x, y), order) in enumerate(zip(batches, orders)):
            xs, ys = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
            model.order = ref.order = order
            if step == 3:  # a forward with grad whose backward never comes keeps its last unit
                model(xs)
                assert gathered_units() == {"blocks.0"}, gathered_units()
            gathers.clear()
            logits = model(xs)
            after_forward = gathered_units()
            assert state.gathered_numel() <= root + largest, (state.gathered_numel(), largest)
            loss_fn(logits, ys).backward()
            opt.step()
            opt.zero_grad()
            assert state.gathered_numel() == 0  # backward's end freed every unit, the kept one too
            last = f"blocks.{order[-1]}"
            if step in (1, 3):  # the order repeats: the last unit is kept, gathered once
                assert after_forward == {last}, (step, after_forward)
                # (at step 3 the forward without backward gathered and kept it already)
                once = 0 if step == 3 else 1
                want = {name: n * (once if name == last else 2) for name, n in per_unit.items()}
                want = {name: n for name, n in want.items() if n}
                assert gathers == want, (step, gathers, want)
            else:  # first step, or a changed order: the guess (blocks.2) was freed
                assert after_forward == set(), (step, after_forward)
    finally:
        FlatParamBucket.start_unshard = start_unshard
    for (x, y), order in zip(batches, orders):
        ref.order = order
        loss_fn(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert_same_params(model, ref, ATOL, "p_g_os: last unit kept into backward")


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_last_unit_stays_gathered_into_backward(world_size):
    run_distributed(_last_unit_kept, world_size)
