"""``zerokit.core.agreement``: ranks that differ are named on every rank; a rank that does not
come is named within the timeout (not gloo's 30 minutes), on every rank, and the group stays
in step; a rank that is slow but at work is waited for; checkpoint.save and load called on one
rank only fail within the timeout."""

import os
import time

import pytest
import torch.distributed as dist
from dist_helpers import run_distributed
from torch import nn

from zerokit import checkpoint
from zerokit.core.agreement import agree, agree_all, alive, gather
from zerokit.runtime.timeouts import AgreementError, CollectiveTimeout, collective_timeout


def test_the_timeout_comes_from_the_argument_then_the_environment(monkeypatch):
    monkeypatch.delenv("ZEROKIT_COLLECTIVE_TIMEOUT", raising=False)
    assert collective_timeout() == 60.0
    monkeypatch.setenv("ZEROKIT_COLLECTIVE_TIMEOUT", "2.5")
    assert collective_timeout() == 2.5
    assert collective_timeout(7) == 7.0
    monkeypatch.setenv("ZEROKIT_COLLECTIVE_TIMEOUT", "soon")
    with pytest.raises(ValueError, match=r"ZEROKIT_COLLECTIVE_TIMEOUT='soon' is not a number"):
        collective_timeout()
    with pytest.raises(ValueError, match="positive"):
        collective_timeout(0)


def test_without_a_process_group_everything_agrees():
    assert gather("x", b"v", None) == [b"v"]
    agree("x", b"v", None)


def _differ(rank, world_size):
    assert gather("hello", f"r{rank}".encode(), None) == [b"r0", b"r1", b"r2"]
    agree("same", b"v", None)
    value = b"odd" if rank == 1 else b"even"
    with pytest.raises(AgreementError, match=r"^layout check: the ranks must agree, but the value differs \(ranks 0, 2: 'even'; rank 1: 'odd'\)$"):  # fmt: skip
        agree("layout check", value, None)
    fields = {"path": b"/a", "model": b"m" if rank else b"n"}
    with pytest.raises(AgreementError, match=r"model differs \(ranks 1, 2: 'm'; rank 0: 'n'\)$"):
        agree_all("wrap", fields, None)
    # ranks in different calls at the same point are told so
    with pytest.raises(AgreementError, match=r"different collective calls: rank 0: save; rank 1: load; rank 2: load"):  # fmt: skip
        gather("save" if rank == 0 else "load", b"", None)
    assert gather("still in step", b"ok", None) == [b"ok"] * 3


def test_ranks_that_differ_are_named_on_every_rank():
    run_distributed(_differ, 3)


def _absent(rank, world_size):
    if rank == 0:
        started = time.monotonic()
        with pytest.raises(CollectiveTimeout, match=r"^checkpoint\.save: rank 1 of 2 did not make this call within 1 s") as e:  # fmt: skip
            gather("checkpoint.save", b"", None, timeout=1)
        assert e.value.missing == [1]
        assert time.monotonic() - started < 10
    else:
        time.sleep(8)  # not there (doing something else), then late
        with pytest.raises(CollectiveTimeout, match=r"this rank \(1\) arrived after the other ranks had waited 1 s for it"):  # fmt: skip
            gather("checkpoint.save", b"", None, timeout=1)
    # both gave up on the same call: the group is in step again
    assert gather("next", str(rank).encode(), None, timeout=30) == [b"0", b"1"]
    # a rank slow at work (inside alive) is waited for, however long past the timeout
    with alive(None):
        if rank == 1:
            time.sleep(8)  # longer than the timeout and the three heartbeats rank 0 watches
        assert gather("slow write", b"", None, timeout=1) == [b"", b""]


@pytest.mark.slow
def test_a_missing_rank_is_named_within_the_timeout():
    run_distributed(_absent, 2)


def _save_on_rank_0_only(rank, world_size, path):
    model = nn.Linear(3, 2)
    if rank == 0:
        started = time.monotonic()
        with pytest.raises(CollectiveTimeout, match=r"^checkpoint\.save: rank 1 of 2 did not make this call within 2 s"):  # fmt: skip
            checkpoint.save(path, model, timeout=2)
        assert time.monotonic() - started < 15
        assert not os.path.exists(path) and os.listdir(os.path.dirname(path)) == []
        os.environ["ZEROKIT_COLLECTIVE_TIMEOUT"] = "2"
        with pytest.raises(CollectiveTimeout, match=r"^checkpoint\.load: rank 1 of 2"):
            checkpoint.load(path, model)
    else:
        time.sleep(12)
    dist.barrier()


@pytest.mark.slow
def test_save_and_load_on_one_rank_only_fail_within_the_timeout(tmp_path):
    run_distributed(_save_on_rank_0_only, 2, str(tmp_path / "ckpt"))
