"""A failing writer is named everywhere: a write that fails on one rank (an injected error,
a disk really full on a small tmpfs, a writer thread that stops) ends ``save`` and
``async_save`` on every rank with the same ``CheckpointError`` naming that rank and its file,
within the collective timeout, and the previous checkpoint still loads; an async save's
failure nobody asked its future for is raised by the next save, never a hang."""

import os
import subprocess
import time

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_distributed
from torch import nn

import zerokit
from zerokit import checkpoint
from zerokit.checkpoint import CheckpointError

FILES = {"zerokit": "rank{:05d}.safetensors", "dcp": "__{}_0.distcp"}


class Killed(BaseException):
    """What a writer thread stopped from outside would raise (not an ``Exception``)."""


def _sharded(value: float, size: int = 8):
    model = nn.Linear(size, size, bias=False)
    nn.init.constant_(model.weight, value)
    optimizer = torch.optim.SGD(model.parameters())
    model, _, _ = zerokit.group_sharded_parallel(model, optimizer, "os")
    return model


def _break_writer(fmt: str, how: str) -> None:
    """This rank's writer fails as ``how`` says (the first tensor it writes)."""
    from zerokit.checkpoint import background, dcp_save, saving

    error = {
        "disk full": OSError(28, "No space left on device"),
        "permission": PermissionError(13, "Permission denied"),
        "killed": Killed("stopped"),
    }.get(how)

    def fail(*args, **kwargs):
        raise error

    if how == "no post":  # the thread ends without a word: rank 0 must time out on it
        background._post = lambda *args, **kwargs: None
    elif fmt == "zerokit":
        saving.write_safetensors = fail
    else:
        dcp_save.DcpFile.tensor = fail


def _all_messages(message: str) -> list[str]:
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, message)
    return every


def _fails_alike(rank, world_size, path, fmt, how, bad, mode):
    checkpoint.save(path, _sharded(1.0), format=fmt)
    if rank == bad:
        _break_writer(fmt, how)
    started = time.monotonic()
    with pytest.raises(CheckpointError) as caught:
        if mode == "sync":
            checkpoint.save(path, _sharded(2.0), format=fmt)
        else:
            checkpoint.async_save(path, _sharded(2.0), format=fmt).result(timeout=120)
    took = time.monotonic() - started
    messages = _all_messages(str(caught.value))
    assert len(set(messages)) == 1, f"the ranks raised different errors: {messages}"
    file = os.path.join(path, FILES[fmt].format(bad))
    assert f"rank {bad}" in messages[0] and file in messages[0], messages[0]
    assert took < 30, f"{took:.1f} s to fail (the collective timeout is 4 s)"
    loaded = nn.Linear(8, 8, bias=False)
    checkpoint.load(path, loaded)
    assert torch.equal(loaded.weight, torch.ones(8, 8)), "the previous checkpoint changed"


@pytest.fixture
def short_timeout(monkeypatch):
    monkeypatch.setenv("ZEROKIT_COLLECTIVE_TIMEOUT", "4")


@pytest.mark.parametrize("fmt", ["zerokit", "dcp"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_disk_full_on_one_rank_fails_every_rank_alike(tmp_path, short_timeout, fmt, mode):
    run_distributed(_fails_alike, 3, str(tmp_path / "ckpt"), fmt, "disk full", 2, mode)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["zerokit", "dcp"])
@pytest.mark.parametrize(
    "how,mode", [("permission", "sync"), ("permission", "async"), ("killed", "async")]
)  # a sync save's writer is the calling thread: a BaseException there is the caller's
def test_every_failing_writer_on_rank_0_or_1_is_named(tmp_path, short_timeout, fmt, how, mode):
    for bad in (0, 1):
        path = str(tmp_path / f"ckpt{bad}")
        run_distributed(_fails_alike, 2, path, fmt, how, bad, mode)


@pytest.mark.parametrize("fmt", ["zerokit", "dcp"])
def test_a_writer_thread_that_stops_silently_is_named_within_the_timeout(
    tmp_path, short_timeout, fmt
):
    run_distributed(_fails_alike, 2, str(tmp_path / "ckpt"), fmt, "no post", 1, "async")


def _real_disk_full(rank, world_size, path, fmt, mode):
    size = 96  # 3 ranks x 96 x 96 float32: ~37 KiB a checkpoint; the tmpfs holds one, not two
    checkpoint.save(path, _sharded(1.0, size), format=fmt)
    with pytest.raises(CheckpointError) as caught:
        if mode == "sync":
            checkpoint.save(path, _sharded(2.0, size), format=fmt)
        else:
            checkpoint.async_save(path, _sharded(2.0, size), format=fmt).result(timeout=120)
    messages = _all_messages(str(caught.value))
    assert len(set(messages)) == 1, f"the ranks raised different errors: {messages}"
    assert "No space left on device" in messages[0] and "rank " in messages[0], messages[0]
    loaded = nn.Linear(size, size, bias=False)
    checkpoint.load(path, loaded)
    assert torch.equal(loaded.weight, torch.ones(size, size)), "the previous checkpoint changed"


@pytest.fixture
def small_disk(tmp_path):
    where = tmp_path / "disk"
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.mark.parametrize("fmt", ["zerokit", "dcp"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_really_full_disk_fails_every_rank_alike(small_disk, short_timeout, fmt, mode):
    run_distributed(_real_disk_full, 3, str(small_disk / "ckpt"), fmt, mode)


def _surfaces_at_next_save(rank, world_size, path):
    checkpoint.save(path, _sharded(1.0))
    if rank == 1:
        _break_writer("zerokit", "disk full")
    future = checkpoint.async_save(path, _sharded(2.0))  # its future is never asked
    with pytest.raises(CheckpointError, match=r"the async_save to .* failed.*rank 1"):
        checkpoint.save(path, _sharded(3.0))
    assert future.done()
    if rank == 1:
        from zerokit.checkpoint import saving
        from zerokit.checkpoint.streaming import write_safetensors

        saving.write_safetensors = write_safetensors
    checkpoint.save(path, _sharded(3.0))  # raised once: the next save goes ahead
    loaded = nn.Linear(8, 8, bias=False)
    checkpoint.load(path, loaded)
    assert torch.equal(loaded.weight, torch.full((8, 8), 3.0))


def test_an_unasked_async_failure_is_raised_by_the_next_save(tmp_path, short_timeout):
    run_distributed(_surfaces_at_next_save, 2, str(tmp_path / "ckpt"))
