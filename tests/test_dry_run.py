"""``zerokit plan``'s dry run (``zerokit.dry_run``, ``core.stand_in``): one process plays a rank
of an N-rank job through zerokit's real wrapping and step, so what the plan reports is what
the code does, collectives the model itself makes included; the stand-in groups answer as if
every rank held this rank's values; a plan inside a running job is refused."""

import pytest
import torch
import torch.distributed as dist
from compare_models import FEATURES
from dist_helpers import run_distributed

from zerokit.core import agreement, stand_in
from zerokit.core.collectives import all_gather_bytes, communication_device
from zerokit.dry_run import DryRunError
from zerokit.plan import PlanConfig, make_plan


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


def test_the_plan_shows_the_collectives_a_model_makes_itself():
    """A rule-based plan knows only zerokit's collectives; the dry run runs the model's forward
    against the stand-in world, so the model's own all-reduce is in the plan."""
    plain = make_plan(PlanConfig(world=3, level="os_g", model="verify_models:with_dropout"))
    synced = make_plan(PlanConfig(world=3, level="os_g", model="verify_models:batch_statistic"))
    forward = [c for c in synced["ranks"][0]["collectives"] if c["what"] == "all_reduce (forward)"]
    assert forward == [
        {"op": "all_reduce", "group_size": 3, "calls": 1, "bytes": 4 * FEATURES,
         "what": "all_reduce (forward)"}
    ]  # fmt: skip
    assert not [c for c in plain["ranks"][0]["collectives"] if "(forward)" in c["what"]]
    assert synced["played_ranks"] and set(synced["played_ranks"]) <= {0, 1, 2}


def _plan_inside_a_job(rank, world_size):
    with pytest.raises(DryRunError, match="without an initialised process group"):
        make_plan(PlanConfig(world=2, level="p_g_os", model="verify_models:tiny_gpt"))


def test_a_plan_inside_a_running_job_is_refused():
    run_distributed(_plan_inside_a_job, 2)


def test_a_model_that_reads_values_is_refused_saying_why(capsys):
    from zerokit import cli

    code = cli.main(["plan", "--model", "verify_models:reads_values", "--world", "2",
                     "--level", "os"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2, err
    assert "failed: DataDependentOutputException" in err and "must not read tensor values" in err
    assert not dist.is_initialized()  # the stand-in world is gone
