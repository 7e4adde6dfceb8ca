"""Misuse is refused at the call (or at the next forward or step at the latest), on every
rank, with a message that says what to do; never a hang, a gloo abort or a wrong loss."""

import os
import sys
import time

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_distributed
from models import make_model, make_optimizer
from torch import nn

import zerokit
from zerokit import ShardingConfig
from zerokit.runtime.timeouts import AgreementError, CollectiveTimeout


def _wrap(level="os", model=None, opt=None, **kwargs):
    model = model or make_model("awkward")
    opt = opt or make_optimizer("adamw", model)
    return zerokit.group_sharded_parallel(model, opt, level, **kwargs)


def _step(model, opt, x=None):
    x = torch.randint(0, 11, (2, 5)) if x is None else x
    model(x).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _ranks_disagree(rank, world_size):
    # One rank passes another level / bucket size: the same error on both ranks, at once.
    for kwargs, field in (
        ({"level": ("os", "os_g")[rank]}, "level"),
        ({"level": "os", "buffer_max_size": 40 + rank}, "buffer_max_size"),
    ):
        with pytest.raises(
            AgreementError,
            match=f"group_sharded_parallel: the ranks must agree, but {field} differs",
        ):
            _wrap(**kwargs)
    # A model that differs between ranks (another width on rank 1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4 + rank), nn.Linear(4 + rank, 1))
    with pytest.raises(AgreementError, match="parameters differs"):
        zerokit.group_sharded_parallel(model, torch.optim.SGD(model.parameters(), lr=0.1), "os")


def _refused_at_the_call(rank, world_size):
    _, opt, _ = _wrap("os_g")
    with pytest.raises(RuntimeError, match="add_param_group after group_sharded_parallel"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})

    lbfgs_model = make_model("awkward")
    lbfgs = torch.optim.LBFGS([p for p in lbfgs_model.parameters() if p.requires_grad])
    with pytest.raises(ValueError, match="LBFGS cannot be sharded: its line search"):
        zerokit.group_sharded_parallel(lbfgs_model, lbfgs, "os_g")
    assert not hasattr(lbfgs_model, "_zerokit")

    class MySGD(torch.optim.Optimizer):  # elementwise, but zerokit cannot know
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-group["lr"])

    custom = make_model("awkward")
    with pytest.raises(ValueError, match="elementwise_optimizer=True"):
        zerokit.group_sharded_parallel(custom, MySGD(custom.parameters()), "os")
    config = zerokit.ShardingConfig(elementwise_optimizer=True)
    custom, custom_opt, _ = zerokit.group_sharded_parallel(
        custom, MySGD([p for p in custom.parameters() if p.requires_grad]), "os", config=config
    )
    _step(custom, custom_opt)

    # Wrapped twice: a submodule first, then the whole model; or the whole, then a part.
    outer = make_model("awkward")
    zerokit.group_sharded_parallel(outer.block, make_optimizer("sgd", outer.block), "os")
    with pytest.raises(ValueError, match="submodule 'block' is already wrapped"):
        zerokit.group_sharded_parallel(outer, make_optimizer("sgd", outer), "os")
    whole, _, _ = _wrap("os")
    with pytest.raises(ValueError, match="already belong to a model wrapped"):
        zerokit.group_sharded_parallel(whole.block, make_optimizer("sgd", whole.block), "os")

    sparse = nn.Sequential(nn.Embedding(11, 4, sparse=True), nn.Linear(4, 1))
    with pytest.raises(ValueError, match="sparse gradients"):
        zerokit.group_sharded_parallel(sparse, torch.optim.SGD(sparse.parameters(), lr=0.1), "os")


def _refused_at_the_next_forward(rank, world_size):
    for level in ("os", "os_g", "p_g_os"):
        for cast in ("half", "double"):
            model, opt, _ = _wrap(level)
            _step(model, opt)
            getattr(model, cast)()
            with pytest.raises(RuntimeError, match="cast or moved after group_sharded_parallel"):
                _step(model, opt)
        model, opt, _ = _wrap(level)
        model.frozen.weight.requires_grad_(True)  # frozen at wrap time: in no bucket
        with pytest.raises(RuntimeError, match="frozen when group_sharded_parallel ran"):
            _step(model, opt)
        model, opt, _ = _wrap(level)
        model.block[0].weight.requires_grad_(False)
        with pytest.raises(RuntimeError, match="frozen after group_sharded_parallel"):
            _step(model, opt)


def _optimizer_state_from_another_layout(rank, world_size, path):
    model, opt, _ = _wrap("os_g")
    _step(model, opt)
    saved = opt.state_dict()
    _same, same_opt, _ = _wrap("os_g")  # the model must stay alive with its optimizer
    same_opt.load_state_dict(saved)  # same rank, same layout: fine
    _other, other_opt, _ = _wrap("os")
    with pytest.raises(ValueError, match=r"use zerokit\.checkpoint\.save/load"):
        other_opt.load_state_dict(saved)
    plain = make_model("awkward")
    plain_opt = make_optimizer("adamw", plain)
    plain_state = plain_opt.state_dict()
    with pytest.raises(ValueError, match="an unwrapped optimizer"):
        same_opt.load_state_dict(plain_state)
    if rank == 0:
        torch.save(saved, path)


def _loads_at_another_world_size(rank, world_size, path):
    _model, opt, _ = _wrap("os_g")
    with pytest.raises(ValueError, match="world_size': 2"):
        opt.load_state_dict(torch.load(path, weights_only=False))


class SameShapes(nn.Module):
    """Two blocks of the same shape whose order depends on the rank."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        order = (0, 1) if dist.get_rank() == 0 else (1, 0)
        for i in order:
            x = self.blocks[i](x)
        return x


class DifferentShapes(nn.Module):
    """Rank 0 runs one block, rank 1 two others of other shapes."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 16), nn.Linear(16, 4)])

    def forward(self, x):
        if dist.get_rank() == 0:
            return self.blocks[0](x)
        return self.blocks[2](self.blocks[1](x))


def _rank_dependent_order(rank, world_size):
    # by default: the one check after each forward refuses it before any backward or step
    torch.manual_seed(0)
    model = SameShapes()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, _ = zerokit.group_sharded_parallel(model, opt, "p_g_os")
    with pytest.raises(RuntimeError, match="different orders"):
        model(torch.randn(2, 4))
    # debug mode: refused at the first gather that differs
    debug = ShardingConfig(debug_agreement=True)
    torch.manual_seed(0)
    model = SameShapes()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, _ = zerokit.group_sharded_parallel(model, opt, "p_g_os", config=debug)
    with pytest.raises(RuntimeError, match="gathering different units"):
        model(torch.randn(2, 4))
    # units of different shapes: refused before the gather (it used to abort inside gloo)
    torch.manual_seed(0)
    model = DifferentShapes()
    model, opt, _ = zerokit.group_sharded_parallel(
        model, torch.optim.SGD(model.parameters(), lr=0.1), "p_g_os", config=debug
    )
    with pytest.raises(RuntimeError, match="gathering different units"):
        model(torch.randn(2, 4))
    # at 'os_g' the same model trains (reductions fall back to one fixed order)
    torch.manual_seed(0)
    model = SameShapes()
    model, opt, _ = zerokit.group_sharded_parallel(
        model, torch.optim.SGD(model.parameters(), lr=0.1), "os_g"
    )
    _step(model, opt, torch.randn(2, 4))


def _a_rank_is_elsewhere(rank, world_size, case):
    """A collective only some ranks call ends within the timeout (3 s here, not gloo's 30
    minutes), naming the call and where the other rank is. After that the process group is
    unusable (the abandoned collective is still queued), as after any collective error: the
    rank leaves at once."""
    os.environ["ZEROKIT_COLLECTIVE_TIMEOUT"] = "3"
    level = {"clip": "os_g", "extra batch": "os", "state_dict": "p_g_os"}[case]
    model, opt, _ = _wrap(level)
    _step(model, opt)
    start = time.monotonic()
    if case == "clip":  # only rank 0 clips; rank 1 goes on to step and waits there
        model(torch.randint(0, 11, (2, 5))).float().pow(2).mean().backward()
        if rank == 0:
            with pytest.raises(
                CollectiveTimeout, match=r"clip_grad_norm_.*rank 1 is at call #\d+ \(optimizer.step"
            ):
                zerokit.clip_grad_norm_(model, 1.0)
        else:
            with pytest.raises(
                CollectiveTimeout,
                match=r"optimizer.step.*rank 0 is at call #\d+ \(zerokit.clip_grad_norm_",
            ):
                opt.step()
    elif rank == 0:  # one more batch, or a state dict on rank 0 only
        with pytest.raises(
            CollectiveTimeout, match=r"forward.*rank 1 is at call|state_dict.*rank 1 of 2 did not"
        ):
            _step(model, opt) if case == "extra batch" else model.state_dict()
    else:
        time.sleep(8)  # alive, but not in the call
    assert time.monotonic() - start < 30
    sys.stdout.flush()
    os._exit(0)  # skip destroy_process_group: the abandoned collective would wait on it


@pytest.mark.parametrize(
    "case",
    [
        "clip",
        pytest.param("extra batch", marks=pytest.mark.slow),
        pytest.param("state_dict", marks=pytest.mark.slow),
    ],
)
def test_a_rank_that_is_elsewhere_is_named_within_the_timeout(case):
    run_distributed(_a_rank_is_elsewhere, 2, case)


@pytest.mark.parametrize(
    "fn",
    [_ranks_disagree, _refused_at_the_call, _refused_at_the_next_forward, _rank_dependent_order],
)
def test_misuse_is_refused_on_every_rank(fn):
    run_distributed(fn, 2)


def test_an_optimizer_state_dict_loads_only_into_its_own_layout(tmp_path):
    path = str(tmp_path / "opt.pt")
    run_distributed(_optimizer_state_from_another_layout, 2, path)
    run_distributed(_loads_at_another_world_size, 3, path)
