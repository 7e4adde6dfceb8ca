"""async_save: the checkpoint is the state at the call although training changes it right
after; .result() raises what the save raised, on every rank; a save killed mid-write leaves
the previous checkpoint loadable."""

import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from dist_helpers import run_distributed
from models import SMALL, global_batches, make_model, make_optimizer, train_sharded
from torch import nn

import zerokit
from zerokit import checkpoint
from zerokit.checkpoint import CheckpointError, background

BATCHES = global_batches(3, batch=12)


def _loaded(path: str):
    """The checkpoint in a bare one-process model and optimizer (every tensor whole)."""
    model = make_model("gpt", seed=9)
    opt = make_optimizer("adamw", model)
    extra = {"step": None}
    checkpoint.load(path, model, opt, extra=extra)
    return model.state_dict(), opt.state_dict(), extra["step"]


def _mutated_after_the_call(rank, world_size, root, level, fmt):
    model = make_model("gpt")
    opt = make_optimizer("adamw", model)
    model, opt, _ = zerokit.group_sharded_parallel(model, opt, level, **SMALL[level])
    train_sharded(model, opt, BATCHES[:2], rank, world_size)
    sync, later = os.path.join(root, "sync"), os.path.join(root, "async")
    checkpoint.save(sync, model, opt, extra={"step": 2}, format=fmt)
    gate, run = threading.Event(), background._Job.run
    background._Job.run = lambda job: (gate.wait(), run(job))[1]  # writes after the changes
    future = checkpoint.async_save(later, model, opt, extra={"step": 2}, format=fmt)
    train_sharded(model, opt, BATCHES[2:], rank, world_size)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    gate.set()
    assert future.result() is None
    want, got = _loaded(sync), _loaded(later)
    for key in want[0]:
        assert torch.equal(got[0][key], want[0][key]), key
    for number, state in want[1]["state"].items():
        for key, value in state.items():
            assert torch.equal(got[1]["state"][number][key], value), (number, key)
    assert got[2] == want[2] == 2


@pytest.mark.parametrize("level,fmt", [("p_g_os", "zerokit"), ("os_g", "dcp")])
def test_training_right_after_the_call_never_changes_what_is_written(tmp_path, level, fmt):
    run_distributed(_mutated_after_the_call, 2, str(tmp_path), level, fmt)


def _ones_saved(path: str) -> nn.Module:
    """A wrapped Linear whose weight is all ones, saved at ``path`` (the previous checkpoint),
    then set to twos (what the next save writes)."""
    model = nn.Linear(8, 8)
    nn.init.constant_(model.weight, 1.0)
    model, _, _ = zerokit.group_sharded_parallel(model, torch.optim.SGD(model.parameters()), "os")
    checkpoint.save(path, model)
    with torch.no_grad():
        model.weight.fill_(2.0)
    return model


def _one_rank_fails(rank, world_size, path):
    from zerokit.checkpoint import saving

    model = _ones_saved(path)
    if rank == 1:

        def disk_full(*args, **kwargs):
            raise OSError(28, "No space left on device")

        saving.write_safetensors = disk_full
    future = checkpoint.async_save(path, model)
    with pytest.raises(CheckpointError, match=r"rank 1: writing its shard failed: .*No space"):
        future.result()
    loaded = nn.Linear(8, 8)
    checkpoint.load(path, loaded)
    assert torch.equal(loaded.weight, torch.ones(8, 8)), "the previous checkpoint changed"


def test_a_failure_on_one_rank_is_raised_by_every_rank_future(tmp_path):
    run_distributed(_one_rank_fails, 2, str(tmp_path / "ckpt"))


def _group_gone_before_the_future(rank, world_size, root):
    """A script may end its process group while an async save still writes: the writer
    thread never asks the group who it is (a rank but 0 taking itself for rank 0 would
    publish an empty index over the previous checkpoint)."""
    path = os.path.join(root, "ckpt")
    model = _ones_saved(path)
    gate, run = threading.Event(), background._Job.run
    background._Job.run = lambda job: (gate.wait(), run(job))[1]  # writes once the group is gone
    future = checkpoint.async_save(path, model)
    torch.distributed.destroy_process_group()
    gate.set()
    assert future.result() is None
    again = f"file://{os.path.join(root, 'again')}"  # a new group: the load's, and the teardown's
    torch.distributed.init_process_group(
        "gloo", init_method=again, rank=rank, world_size=world_size
    )
    loaded = nn.Linear(8, 8)
    checkpoint.load(path, loaded)
    assert torch.equal(loaded.weight, torch.full((8, 8), 2.0))


def test_an_async_save_outliving_its_process_group_is_published_whole(tmp_path):
    run_distributed(_group_gone_before_the_future, 2, str(tmp_path))


def _copy_fails_on_one_rank(rank, world_size, path):
    model = _ones_saved(path)
    if rank == 1:

        def broken_copy(chunks):
            raise RuntimeError("the copy broke")

        background._STAGING.copy = broken_copy
    # every rank hears of it at the call (not a writer thread waiting out the timeout)
    with pytest.raises(CheckpointError, match=r"rank 1: staging its state failed: .*copy broke"):
        checkpoint.async_save(path, model, timeout=20)
    loaded = nn.Linear(8, 8)
    checkpoint.load(path, loaded)
    assert torch.equal(loaded.weight, torch.ones(8, 8)), "the previous checkpoint changed"
    if rank == 1:
        del background._STAGING.copy
    checkpoint.save(path, model)  # the lock was released, the temp directory removed
    checkpoint.load(path, loaded)
    assert torch.equal(loaded.weight, torch.full((8, 8), 2.0))
    assert set(os.listdir(os.path.dirname(path))) <= {"ckpt", "ckpt.zerokit-lock"}  # no temp


def test_a_copy_failing_on_one_rank_fails_every_rank_at_the_call(tmp_path):
    run_distributed(_copy_fails_on_one_rank, 2, str(tmp_path / "ckpt"))


_KILLED = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    from zerokit import checkpoint
    from zerokit.checkpoint import saving

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    saving.write_safetensors = die
    model = torch.nn.Linear(64, 64)
    torch.nn.init.constant_(model.weight, 2.0)
    checkpoint.async_save(sys.argv[1], model).result()
    """
)


def test_a_process_killed_mid_write_leaves_the_previous_checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    model = nn.Linear(64, 64)
    nn.init.constant_(model.weight, 1.0)
    checkpoint.save(path, model)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", _KILLED, str(path)], env=env)
    assert done.returncode == -signal.SIGKILL
    loaded = nn.Linear(64, 64)
    checkpoint.load(path, loaded)
    assert torch.equal(loaded.weight, model.weight), "the previous checkpoint was damaged"
    nn.init.constant_(model.weight, 3.0)
    checkpoint.async_save(path, model).result()  # the next save clears the debris
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    checkpoint.load(path, loaded)
    assert torch.equal(loaded.weight, model.weight)


def test_a_second_save_waits_for_the_one_in_flight(tmp_path):
    model = nn.Linear(4, 4)
    gate, run = threading.Event(), background._Job.run
    background._Job.run = lambda job: (gate.wait(), run(job))[1]
    try:
        first = checkpoint.async_save(tmp_path / "a", model, format="dcp")
        second = threading.Thread(target=checkpoint.save, args=(tmp_path / "a", model),
                                  kwargs={"format": "dcp"})  # fmt: skip
        second.start()
        second.join(0.5)
        assert second.is_alive() and not first.done(), "the second save did not wait"
    finally:
        background._Job.run = run
        gate.set()
    first.result()
    second.join(30)
    assert not second.is_alive()
    assert sorted(os.listdir(tmp_path)) == ["a"]  # the DCP directory replaced, no debris
    loaded = nn.Linear(4, 4)
    checkpoint.load(tmp_path / "a", loaded)
    assert torch.equal(loaded.weight, model.weight)
