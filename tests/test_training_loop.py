"""Training-loop semantics a user relies on, each compared with single-process training of the
same global batch: accumulation (with and without no_sync), clipping, LR schedulers,
zero_grad(set_to_none=False), state_dict round trips, buffers, train/eval."""

import contextlib

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
    reference_pair,
)
from torch import nn

import zerokit

ATOL = 2e-5


def train(
    model,
    opt,
    batches,
    *,
    shard=None,
    micro=1,
    no_sync=False,
    clip=None,
    sched=None,
    set_to_none=True,
):
    """One loop for the reference (shard=None) and the sharded run (shard=(rank, world_size)).

    Returns the total gradient norms reported by clipping, if any.
    """
    norms = []
    for x, y in batches:
        if shard:
            x, y = local_slice(x, *shard), local_slice(y, *shard)
        for m, (mx, my) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
            last = m == micro - 1
            ctx = model.no_sync() if (shard and no_sync and not last) else contextlib.nullcontext()
            with ctx:
                (loss_fn(model(mx), my) / micro).backward()
        if clip is not None:
            if shard:
                norms.append(zerokit.clip_grad_norm_(model, clip[0], clip[1]).item())
            else:
                norms.append(
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip[0], clip[1]).item()
                )
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad(set_to_none=set_to_none)
    return norms


def _compare(
    rank,
    world_size,
    level,
    what,
    *,
    opt_kind="adamw",
    sched_factory=None,
    sched_before_wrap=False,
    wrap_options=None,
    **loop,
):
    batches = global_batches(6, batch=6 * world_size)
    (ref_model, ref_opt), (model, opt) = reference_pair("awkward", opt_kind)
    ref_sched = sched_factory(ref_opt) if sched_factory else None
    sched = sched_factory(opt) if sched_factory and sched_before_wrap else None
    ref_norms = train(ref_model, ref_opt, batches, sched=ref_sched, **loop)
    options = {**SMALL[level], **(wrap_options or {})}
    model, opt, _ = zerokit.group_sharded_parallel(model, opt, level, **options)
    if sched_factory and not sched_before_wrap:
        sched = sched_factory(opt)
    norms = train(model, opt, batches, shard=(rank, world_size), sched=sched, **loop)
    what = f"{what} level={level} world_size={world_size}"
    torch.testing.assert_close(
        norms, ref_norms, atol=ATOL, rtol=1e-6, msg=lambda m: f"{what}: norms {m}"
    )
    assert_same_params(model, ref_model, ATOL, what)
    return model, opt, ref_model, ref_opt


def _loop_semantics(rank, world_size, every_level=True):
    """Every check at every level; with ``every_level=False`` (the fast subset) each check at
    one level, the levels taken in turn, so each level still meets several checks."""

    def step_lr(opt):
        return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    def compare(what, **kwargs):
        return lambda level: _compare(rank, world_size, level, what, **kwargs)

    checks = [
        compare("accumulate no_sync", micro=3, no_sync=True),
        compare("accumulate, reduce every micro-batch", micro=3),
        compare("zero_grad(set_to_none=False)", opt_kind="sgd", set_to_none=False),
        compare("clip l2", clip=(0.05, 2.0)),
        compare("clip inf", opt_kind="sgd", clip=(0.01, float("inf"))),
        compare("scheduler after wrap", sched_factory=step_lr),
        compare("scheduler before wrap", sched_factory=step_lr, sched_before_wrap=True),
        compare("sync_comm", micro=2, wrap_options={"sync_comm": True}),
        lambda level: _check_resume(rank, world_size, level),
        lambda level: _check_no_sync_then_step_is_refused(rank, world_size, level),
    ]
    levels = ("os", "os_g", "p_g_os")
    if every_level:
        for level in levels:
            for check in checks:
                check(level)
    else:
        for i, check in enumerate(checks):
            check(levels[i % len(levels)])


def _check_resume(rank, world_size, level):
    """Save model and (sharded) optimizer state mid-run, load into fresh objects, continue:
    equal to uninterrupted training; a full state_dict loads into a wrapped model."""
    batches = global_batches(8, batch=2 * world_size)
    (ref_model, ref_opt), (model, opt) = reference_pair("awkward", "adamw")
    train(ref_model, ref_opt, batches)
    model, opt, _ = zerokit.group_sharded_parallel(model, opt, level, **SMALL[level])
    train(model, opt, batches[:4], shard=(rank, world_size))
    model_state = {k: v.clone() for k, v in model.state_dict().items()}
    opt_state = opt.state_dict()
    _, (fresh_model, fresh_opt) = reference_pair("awkward", "adamw")
    fresh_model, fresh_opt, _ = zerokit.group_sharded_parallel(
        fresh_model, fresh_opt, level, **SMALL[level]
    )
    fresh_model.load_state_dict(model_state)
    fresh_opt.load_state_dict(opt_state)
    train(fresh_model, fresh_opt, batches[4:], shard=(rank, world_size))
    assert_same_params(fresh_model, ref_model, ATOL, f"resume level={level}")
    # a full (unsharded) state_dict loads into the flat buckets in place
    fresh_model.load_state_dict(ref_model.state_dict())
    assert_same_params(fresh_model, ref_model, 0.0, f"load_state_dict level={level}")


def _check_no_sync_then_step_is_refused(rank, world_size, level):
    ((x, y),) = global_batches(1, batch=2 * world_size)
    _, (model, opt) = reference_pair("awkward", "sgd")
    model, opt, _ = zerokit.group_sharded_parallel(model, opt, level)
    with model.no_sync():
        loss_fn(model(x), y).backward()
    with pytest.raises(RuntimeError, match=r"outside `with model\.no_sync"):
        opt.step()


def _subgroups(rank, world_size):
    """``group=``: ranks {0, 1} and {2, 3} shard independently; each pair trains exactly as one
    process on that pair's global batch."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    group = pairs[rank // 2]
    batches = global_batches(4, batch=4, seed=10 + rank // 2)  # each pair its own data
    for level in ("os", "os_g", "p_g_os"):
        (ref_model, ref_opt), (model, opt) = reference_pair("awkward", "adamw")
        train(ref_model, ref_opt, batches, clip=(0.05, 2.0))
        model, opt, _ = zerokit.group_sharded_parallel(
            model, opt, level, group=group, **SMALL[level]
        )
        train(model, opt, batches, shard=(group.rank(), group.size()), clip=(0.05, 2.0))
        assert_same_params(model, ref_model, ATOL, f"group= level={level}")


class WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.lin(x))


def _buffers_and_eval(rank, world_size):
    """sync_buffers=True keeps rank 0's running stats on every rank; eval() forwards agree."""
    torch.manual_seed(0)
    model = WithBatchNorm()
    model, opt, _ = zerokit.group_sharded_parallel(
        model, torch.optim.SGD(model.parameters(), lr=0.1), "os_g", sync_buffers=True
    )
    gen = torch.Generator().manual_seed(rank)  # every rank sees different data
    for _ in range(3):
        model(torch.randn(8, 4, generator=gen)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    out = model(torch.ones(2, 4))  # forward pre-hook broadcasts rank 0's stats first
    gathered = [torch.empty_like(out) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, out)
    for other in gathered:
        torch.testing.assert_close(other, out, atol=0, rtol=0)
    assert not model.training and not model.bn.training


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_training_loop_semantics_match_single_process(world_size):
    run_distributed(_loop_semantics, world_size)


def test_training_loop_semantics_each_at_one_level():
    """The fast subset's share of the test above: 2 ranks, each check at one level."""
    run_distributed(_loop_semantics, 2, False)


@pytest.mark.slow  # group= in the fast subset: test_hybrid's 2-rank sharding groups of 4 ranks
def test_process_subgroups_shard_independently():
    run_distributed(_subgroups, 4)


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_sync_buffers_and_eval(world_size):
    run_distributed(_buffers_and_eval, world_size)
