"""``zerokit.unwrap``: train wrapped, unwrap, go on training the plain model with the plain
optimizer (every rank the same full-batch step), then wrap again: the whole run matches one
process that trained all along (2e-5, fp32), at every level, at 2 and 3 ranks (uneven shards)
and hybrid (dp 2 x sharding 2). After unwrap no hook of zerokit's is left, the classes are the
user's, the optimizer holds the user's parameters (hyperparameters kept) with their full
state, each parameter has storage of its own and no gradient."""

import copy

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
    make_model,
    make_optimizer,
    train_reference,
)

import zerokit
from zerokit.core.state import state_of

ATOL = 2e-5
WRAPPED, PLAIN, AGAIN = 3, 2, 1  # steps wrapped, then plain, then wrapped again
CASES = (("awkward", "adamw"), ("gpt", "sgd"))  # AdamW: step + 2 moments; SGD: momentum


def _hooks(model) -> dict:
    """How many hooks of each kind every module and parameter holds."""
    kinds = (
        "_forward_pre_hooks",
        "_forward_hooks",
        "_backward_hooks",
        "_backward_pre_hooks",
        "_state_dict_hooks",
        "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
    )
    counts = {}
    for name, module in model.named_modules():
        for kind in kinds:
            counts[f"{name}:{kind}"] = len(getattr(module, kind))
    for name, param in model.named_parameters():
        counts[f"{name}:grad hooks"] = len(param._backward_hooks or {})
        counts[f"{name}:post-accumulate"] = len(param._post_accumulate_grad_hooks or {})
    return counts


def _sharded_steps(model, opt, batches, rank, world_size) -> list[float]:
    """Each rank its slice; the last step leaves its gradients (no zero_grad), so unwrap
    must drop the placeholders or zerokit's gradient views."""
    losses = []
    for step, (x, y) in enumerate(batches):
        loss = loss_fn(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size))
        loss.backward()
        opt.step()
        if step < len(batches) - 1:
            opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world_size)
    return losses


def _unwrap_and_go_on(rank, world_size, levels, hybrid=False):
    batches = global_batches(WRAPPED + PLAIN + AGAIN, batch=2 * world_size)
    group = replicas = None
    if hybrid:
        layout = zerokit.init_hybrid_parallel(2, 1, sharding_degree=2)
        group, replicas = layout.sharding_group, layout.dp_group
    for level in levels:
        for model_kind, opt_kind in CASES:
            what = f"level={level} {model_kind}/{opt_kind} world_size={world_size}"
            ref = make_model(model_kind)
            model = copy.deepcopy(ref)
            ref_opt, opt = make_optimizer(opt_kind, ref), make_optimizer(opt_kind, model)
            ref_losses = train_reference(ref, ref_opt, batches)
            cls, opt_cls, hooks = type(model), type(opt), _hooks(model)
            groups = [(list(g["params"]), g["lr"], g["weight_decay"]) for g in opt.param_groups]

            model, opt, _ = zerokit.group_sharded_parallel(
                model, opt, level, group=group, dp_group=replicas, **SMALL[level]
            )
            losses = _sharded_steps(model, opt, batches[:WRAPPED], rank, world_size)
            plain, plain_opt = zerokit.unwrap(model, opt)

            assert plain is model and plain_opt is opt, what
            assert type(plain) is cls and type(plain_opt) is opt_cls, what
            assert state_of(plain) is None and not hasattr(plain_opt, "_zerokit"), what
            assert _hooks(plain) == hooks, f"{what}: a hook of zerokit's is left"
            for got, (params, lr, wd) in zip(plain_opt.param_groups, groups):
                assert [id(p) for p in got["params"]] == [id(p) for p in params], what
                assert (got["lr"], got["weight_decay"]) == (lr, wd), what
            for name, p in plain.named_parameters():
                assert p.grad is None, f"{what}: {name} kept a gradient"
                own = p.untyped_storage().nbytes() == p.numel() * p.element_size()
                assert own, f"{what}: {name} is still a view of a flat bucket"

            losses += train_reference(plain, plain_opt, batches[WRAPPED : WRAPPED + PLAIN])

            model, opt, _ = zerokit.group_sharded_parallel(  # and back again
                plain, plain_opt, level, group=group, dp_group=replicas, **SMALL[level]
            )
            losses += _sharded_steps(model, opt, batches[WRAPPED + PLAIN :], rank, world_size)
            for step, (got, want) in enumerate(zip(losses, ref_losses)):
                assert abs(got - want) <= ATOL, f"{what}: step {step}: {got} != {want}"
            assert_same_params(model, ref, ATOL, what)


@pytest.mark.parametrize("world_size", [2, 3])
def test_unwrap_then_plain_training_matches_one_process(world_size):
    run_distributed(_unwrap_and_go_on, world_size, ("os", "os_g", "p_g_os"))


@pytest.mark.slow
def test_unwrap_hybrid_matches_one_process():
    """dp 2 x sharding 2: replicas hold the same shards, gathered in the shard group."""
    run_distributed(_unwrap_and_go_on, 4, ("os", "os_g", "p_g_os"), True)


def _mixed_precision(rank, world_size):
    policy = zerokit.MixedPrecision(param_dtype=torch.bfloat16)
    for level in ("os", "p_g_os"):
        model = make_model("gpt")
        opt = make_optimizer("adamw", model)
        model, opt, _ = zerokit.group_sharded_parallel(
            model, opt, level, mixed_precision=policy, **SMALL[level]
        )
        _sharded_steps(model, opt, global_batches(2, batch=2 * world_size), rank, world_size)
        masters = model.state_dict()  # collective: the fp32 masters, gathered
        plain, _ = zerokit.unwrap(model, opt)
        for name, p in plain.named_parameters():
            assert p.dtype == torch.float32, f"level={level}: {name} is {p.dtype}"
            assert torch.equal(p.detach(), masters[name]), f"level={level}: {name} != master"


def test_unwrap_gives_back_the_fp32_masters_under_mixed_precision():
    run_distributed(_mixed_precision, 2)


def test_unwrap_refuses_a_model_that_is_not_wrapped():
    model = make_model("gpt")
    with pytest.raises(ValueError, match="not wrapped"):
        zerokit.unwrap(model, make_optimizer("sgd", model))
