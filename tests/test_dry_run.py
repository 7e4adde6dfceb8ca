"""``zerokit plan``'s dry run (``zerokit.tools.dry_run``, ``core.stand_in``): one process plays a rank
of an N-rank job through zerokit's real wrapping and step, so what the plan reports is what
the code does, collectives the model itself makes included; the stand-in groups answer as if
every rank held this rank's values; a plan inside a running job is refused."""

import logging
import os
import sys

import pytest
import torch
import torch.distributed as dist
from compare_models import FEATURES
from dist_helpers import run_distributed

from zerokit.core import agreement, stand_in
from zerokit.core.collectives import all_gather_bytes, communication_device
from zerokit.tools.dry_run import DryRunError
from zerokit.tools.plan import PlanConfig, make_plan


@pytest.fixture
def stand_in_world():
    stand_in.register()
    dist.init_process_group(stand_in.BACKEND, store=dist.HashStore(), rank=2, world_size=4)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_stand_in_groups_answer_as_if_every_rank_held_this_ranks_values(stand_in_world):
    group = stand_in_world
    assert stand_in.is_stand_in(group) and (group.rank(), group.size()) == (2, 4)
    assert communication_device(group) == torch.device("cpu")
    assert all_gather_bytes(b"zerokit", group) == [b"zerokit"] * 4
    agreement.agree("a check every rank passes", b"same", group)  # no store meeting to wait for
    both = torch.tensor([5, -5])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    assert both.tolist() == [5, -5]
    full = torch.empty(8, device="meta")
    dist.all_gather_single(full, torch.empty(2, device="meta"), group=group)
    ops = [(c.op, c.group_size, c.bytes) for c in group.calls]
    assert ("all_reduce", 4, 16) in ops and ("all_gather", 4, 32) in ops


@pytest.mark.parametrize("degree", [None, 2])
def test_the_plan_shows_the_collectives_a_model_makes_itself(degree):
    """A rule-based plan knows only zerokit's collectives; the dry run runs the model's forward
    against the stand-in world, so the model's own all-reduce (on the world group, which
    zerokit is not given under hybrid sharding) is in the plan."""
    world = 4 if degree else 3
    plain = make_plan(PlanConfig(world=3, level="os_g", model="verify_models:with_dropout"))
    synced = make_plan(
        PlanConfig(world=world, level="os_g", model="verify_models:batch_statistic",
                   sharding_degree=degree)
    )  # fmt: skip
    forward = [c for c in synced["ranks"][0]["collectives"] if c["what"] == "all_reduce (forward)"]
    assert forward == [
        {"op": "all_reduce", "group_size": world, "calls": 1, "bytes": 4 * FEATURES,
         "what": "all_reduce (forward)"}
    ]  # fmt: skip
    assert not [c for c in plain["ranks"][0]["collectives"] if "(forward)" in c["what"]]
    assert synced["played_ranks"] and set(synced["played_ranks"]) <= set(range(world))


def test_the_optimizer_named_is_the_one_played():
    state = {
        name: make_plan(PlanConfig(world=2, level="os_g", optimizer=name))["ranks"][0]["memory"]
        for name in ("adamw", "sgd", "none")
    }
    assert state["none"]["optimizer"] == 0
    assert state["sgd"]["optimizer"] == state["sgd"]["grads"]  # a momentum per owned element
    steps = state["adamw"]["optimizer"] - 2 * state["sgd"]["optimizer"]
    assert 0 < steps < 1024  # Adam's two moments, and a 4-byte step per piece


def test_zero_over_one_rank_replicated_over_the_rest():
    report = make_plan(PlanConfig(world=4, level="os_g", sharding_degree=1))
    ops = {(c["op"], c["group_size"], c["what"]) for c in report["ranks"][0]["collectives"]}
    assert ("all_reduce", 4, "replicas: reduce gradient shard") in ops
    assert not [op for op in ops if op[0] in ("reduce_scatter", "all_gather")]
    memory = report["ranks"][0]["memory"]
    assert memory["grads"] == memory["params"] == report["params"] * 4


def test_the_process_is_left_as_found(monkeypatch):
    """The played ranks leave no process group, excepthook (torch's prefixes every line with
    the rank), logger setting or environment change behind; a store barrier asked for by
    $TORCH_DIST_INIT_BARRIER is not waited for (only one rank ever comes)."""
    monkeypatch.setenv("TORCH_DIST_INIT_BARRIER", "1")
    log = logging.getLogger("zerokit")
    before = (sys.excepthook, log.level, list(log.handlers), log.propagate)
    make_plan(PlanConfig(world=4, level="p_g_os", sharding_degree=2))
    assert (sys.excepthook, log.level, list(log.handlers), log.propagate) == before
    assert not dist.is_initialized() and os.environ["TORCH_DIST_INIT_BARRIER"] == "1"


def _plan_inside_a_job(rank, world_size):
    with pytest.raises(DryRunError, match="without an initialised process group"):
        make_plan(PlanConfig(world=2, level="p_g_os", model="verify_models:tiny_gpt"))


def test_a_plan_inside_a_running_job_is_refused():
    run_distributed(_plan_inside_a_job, 2)


def test_a_model_that_reads_values_is_refused_saying_why(capsys):
    from zerokit.tools import cli

    code = cli.main(["plan", "--model", "verify_models:reads_values", "--world", "2",
                     "--level", "os"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2, err
    assert "failed: DataDependentOutputException" in err and "must not read tensor values" in err
    assert not dist.is_initialized()  # the stand-in world is gone


def test_a_linspace_buffer_stays_on_meta_after_transformers_swapped_linspace(monkeypatch):
    """transformers 5 swaps ``torch.linspace`` for a stand-in inside ``from_pretrained``; torch's
    cached list of the factory functions ``torch.device("meta")`` redirects, first built then,
    held the stand-in, and every later plan of a model with a linspace buffer failed."""
    from torch.utils._device import _device_constructors

    from zerokit.tools.workload import on_meta

    real = torch.linspace
    _device_constructors.cache_clear()
    monkeypatch.setattr(torch, "linspace", lambda *a, **k: real(*a, **k))
    _device_constructors()  # built while swapped, as inside from_pretrained
    monkeypatch.undo()
    try:
        with on_meta():
            assert torch.linspace(0.5, 1.5, 4).is_meta
    finally:
        _device_constructors.cache_clear()
