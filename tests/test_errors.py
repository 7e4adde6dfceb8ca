"""Bad input gets a clear error that says what to do, and nothing is changed."""

import pytest
import torch
from dist_helpers import run_distributed
from models import make_model, make_optimizer
from torch import nn

import zerokit


def test_no_process_group_says_how_to_start_one(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(var, raising=False)
    model = make_model("awkward")
    with pytest.raises(RuntimeError, match=r"torchrun.*init_process_group"):
        zerokit.group_sharded_parallel(model, make_optimizer("sgd", model), "os")


def _snapshot(model, opt):
    return (
        type(model),
        type(opt),
        {k: v.clone() for k, v in model.state_dict().items()},
        [list(g["params"]) for g in opt.param_groups],
    )


def _assert_untouched(model, opt, snapshot):
    cls_m, cls_o, state, groups = snapshot
    assert type(model) is cls_m and type(opt) is cls_o
    assert not hasattr(model, "_zerokit") and not hasattr(opt, "_zerokit")
    assert all(a is b for g, h in zip(groups, opt.param_groups) for a, b in zip(g, h["params"]))
    for name, value in model.state_dict().items():
        assert torch.equal(value, state[name]), name


class TwoDevices(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = nn.Linear(2, 2, device="meta")


def _bad_inputs(rank, world_size):
    cases = [
        ("unknown level", {"level": "stage2"}, ValueError, "valid levels: 'os'"),
        ("scaler", {"level": "os", "scaler": object()}, TypeError, "ShardedGradScaler"),
        (
            "mixed precision",
            {"level": "os", "mixed_precision": "bf16"},
            TypeError,
            "MixedPrecision",
        ),
        (  # world size 2: the world as both shard group and replica group shares 2 ranks
            "dp_group overlapping group",
            {"level": "os", "dp_group": torch.distributed.group.WORLD},
            ValueError,
            "must share exactly this rank",
        ),
        (
            "a group without this rank",
            {"level": "os", "group": -100},
            ValueError,
            "not a process group of this rank",
        ),
        ("exclude_layer", {"level": "os_g", "exclude_layer": [nn.Linear]}, ValueError, "p_g_os"),
    ]
    for _what, kwargs, error, match in cases:
        model = make_model("awkward")
        opt = make_optimizer("adamw", model)
        snapshot = _snapshot(model, opt)
        with pytest.raises(error, match=match):
            zerokit.group_sharded_parallel(model, opt, **kwargs)
        _assert_untouched(model, opt, snapshot)

    model = make_model("awkward")
    stranger = nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([*model.parameters(), stranger], lr=0.1)
    snapshot = _snapshot(model, opt)
    with pytest.raises(ValueError, match="not parameters of the model"):
        zerokit.group_sharded_parallel(model, opt, "os")
    _assert_untouched(model, opt, snapshot)

    model = TwoDevices()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="more than one device"):
        zerokit.group_sharded_parallel(model, opt, "os")
    assert type(model) is TwoDevices

    model = make_model("awkward")
    model, opt, _ = zerokit.group_sharded_parallel(model, make_optimizer("sgd", model), "os")
    with pytest.raises(ValueError, match="already wrapped"):
        zerokit.group_sharded_parallel(model, opt, "os_g")
    with pytest.raises(TypeError, match="group_sharded_parallel"):
        zerokit.clip_grad_norm_(make_model("awkward"), 1.0)


def test_bad_input_is_refused_before_anything_changes():
    run_distributed(_bad_inputs, 2)
