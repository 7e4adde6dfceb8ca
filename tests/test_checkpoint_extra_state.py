"""The rest of a run's state rides with the checkpoint, without pickle: an LR scheduler, the
step, RNG states, a data position, nested plain values and tensors; values that differ per
rank are stored per rank and restored only where they mean something."""

import json
import math
import os
import random

import numpy as np
import pytest
import torch
from dist_helpers import run_distributed
from torch import nn

from zerokit import checkpoint
from zerokit.checkpoint import CheckpointError, RNGState


def _run(lr=0.1):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def _train(model, opt, sched, steps):
    for _ in range(steps):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()


PLAIN = {
    "step": 12,
    "data": {"epoch": 1, "offset": 4096, "files": ["a.bin", "b.bin"]},
    "odd": (1, 2.5, None, True, "x", float("nan"), float("-inf"), {3: "int key", (1, 2): [0]}),
    "tensor": torch.arange(6, dtype=torch.bfloat16).view(2, 3),
    "array": np.arange(5, dtype=np.uint32),
}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def test_scheduler_rng_and_plain_values_are_restored(tmp_path):
    model, opt, sched = _run()
    _train(model, opt, sched, 3)
    random.seed(5)
    np.random.seed(5)
    path = tmp_path / "ckpt"
    checkpoint.save(path, model, opt, extra={"scheduler": sched, "rng": RNGState(), **PLAIN})
    after_save = (torch.rand(3), random.random(), np.random.rand())
    _train(model, opt, sched, 2)
    want_lr = opt.param_groups[0]["lr"]

    model2, opt2, sched2 = _run(lr=0.7)
    extra = {"scheduler": sched2, "rng": RNGState(), **dict.fromkeys(PLAIN)}
    torch.manual_seed(123)
    checkpoint.load(path, model2, opt2, extra=extra)
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], after_save[0]) and got[1:] == after_save[1:]
    assert sched2.last_epoch == 3 and opt2.param_groups[0]["lr"] == 0.05
    for key, value in PLAIN.items():
        assert _same(value, extra[key]), key
    _train(model2, opt2, sched2, 2)
    assert opt2.param_groups[0]["lr"] == want_lr


def test_rng_state_restores_the_same_random_numbers(tmp_path):
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    checkpoint.save(tmp_path / "ckpt", nn.Linear(2, 2), extra={"rng": RNGState()})
    want = (torch.rand(4), random.random(), np.random.rand(2))
    torch.manual_seed(2)
    random.seed(2)
    np.random.seed(2)
    checkpoint.load(tmp_path / "ckpt", nn.Linear(2, 2), extra={"rng": RNGState()})
    got = (torch.rand(4), random.random(), np.random.rand(2))
    assert torch.equal(got[0], want[0]) and got[1] == want[1] and np.array_equal(got[2], want[2])


def test_extra_state_is_json_and_safetensors_only(tmp_path):
    checkpoint.save(tmp_path / "ckpt", nn.Linear(2, 2), extra=PLAIN)
    index = json.loads((tmp_path / "ckpt" / "index.json").read_text())
    assert index["extra"]["step"] == {"per_rank": False, "values": [{"json": 12, "tensors": []}]}
    assert index["extra"]["tensor"]["values"][0]["tensors"][0]["dtype"] == "bfloat16"
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["index.json", "rank00000.safetensors"]


class _Opaque:
    pass


@pytest.mark.parametrize(
    "value, message",
    [
        (lambda: 1, r"extra\['bad'\]: a function cannot be stored without pickle"),
        ({"deep": [_Opaque()]}, r"extra\['bad'\]\['deep'\]\[0\]: a _Opaque cannot be stored"),
        (torch.zeros(2, dtype=torch.complex64), r"a torch\.complex64 tensor cannot be stored"),
    ],
)
def test_what_cannot_be_stored_without_pickle_is_refused_before_writing(tmp_path, value, message):
    with pytest.raises(CheckpointError, match=message):
        checkpoint.save(tmp_path / "ckpt", nn.Linear(2, 2), extra={"bad": value})
    assert os.listdir(tmp_path) == []


def test_asking_for_extra_state_the_checkpoint_lacks_changes_nothing(tmp_path):
    model, opt, _sched = _run()
    checkpoint.save(tmp_path / "ckpt", model, opt, extra={"step": 3})
    model2, opt2, sched2 = _run(lr=0.7)
    extra = {"step": 0, "scheduler": sched2}
    with pytest.raises(CheckpointError, match=r"holds no extra state \['scheduler'\] \(it holds \['step'\]\)"):  # fmt: skip
        checkpoint.load(tmp_path / "ckpt", model2, opt2, extra=extra)
    assert extra["step"] == 0 and opt2.param_groups[0]["lr"] == 0.7


def _per_rank(rank, world_size, path):
    model = nn.Linear(2, 2)
    torch.manual_seed(0)
    nn.init.constant_(model.weight, 1.0)
    torch.manual_seed(100 + rank)  # each rank its own stream
    position = {"offset": 10 * rank}
    checkpoint.save(path, model, extra={"rng": RNGState(), "data": position, "step": 7})
    want = torch.rand(3)
    torch.manual_seed(999)
    extra = {"rng": RNGState(), "data": None, "step": None}
    checkpoint.load(path, model, extra=extra)
    assert torch.equal(torch.rand(3), want) and extra == {
        "rng": extra["rng"],
        "data": position,
        "step": 7,
    }


def _load_alone(path, keys):
    extra = dict.fromkeys(keys)
    checkpoint.load(path, nn.Linear(2, 2), extra=extra)
    return extra


def test_values_that_differ_per_rank_are_stored_per_rank(tmp_path):
    path = str(tmp_path / "ckpt")
    run_distributed(_per_rank, 2, path)
    index = json.loads(open(os.path.join(path, "index.json")).read())
    assert index["extra"]["data"]["per_rank"] and not index["extra"]["step"]["per_rank"]
    assert _load_alone(path, ["step"]) == {"step": 7}  # the same on every rank: loads anywhere
    with pytest.raises(CheckpointError, match=r"extra 'data' differed between the 2 saving ranks .* world size 2 only, not 1"):  # fmt: skip
        _load_alone(path, ["data"])
