"""What a step overlaps, recorded from the calls (not timed where a call order says it):

* ``optimizer.step()`` at 'os'/'os_g' starts spreading a unit group's updated shards as soon
  as that group is stepped, while the next group steps, and returns only when every shard is
  spread: the parameters are current when it returns, equal to one process's.
* A forward at 'os'/'os_g' does not wait for the other ranks: the unit order vote is started
  at its end and read when backward launches its first reduction. At 'p_g_os' the forward
  reads it (backward's gathers follow the agreed order), so it waits.
"""

from __future__ import annotations

import copy
import time

import pytest
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
from torch.optim.optimizer import register_optimizer_step_post_hook

import zerokit
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
