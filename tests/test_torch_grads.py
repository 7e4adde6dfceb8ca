"""A user's loop that reads gradients the torch way: ``torch.nn.utils.clip_grad_norm_`` /
``clip_grad_value_`` on ``model.parameters()`` are exact (equal to one process on the global
batch) at every level; what cannot be exact is refused on every rank at that call, naming
``zerokit.clip_grad_norm_``: never silently wrong (before, ``p.grad`` was None at
'os_g'/'p_g_os' and torch's clip returned 0 and clipped nothing)."""

import pytest
import torch
from dist_helpers import run_distributed
from models import SMALL, assert_same_params, global_batches, local_slice, loss_fn, reference_pair

import zerokit
from zerokit import ShardedGradError

ATOL = 2e-5
LEVELS = ("os", "os_g", "p_g_os")


def _train(model, opt, batches, clip, shard=None, micro=2):
    """``clip(model) -> norm or None`` after the micro-batches' backwards (no no_sync, so the
    second backward accumulates onto the first one's published gradients)."""
    norms = []
    for x, y in batches:
        if shard:
            x, y = local_slice(x, *shard), local_slice(y, *shard)
        for mx, my in zip(x.chunk(micro), y.chunk(micro)):
            (loss_fn(model(mx), my) / micro).backward()
        norms.append(clip(model))
        opt.step()
        opt.zero_grad()
    return norms


def _torch_value_clip(model):
    torch.nn.utils.clip_grad_value_(model.parameters(), 0.02)


def _torch_norm_clip(model):
    return torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05).item()


def _torch_norm_clip_foreach(model):
    return torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, foreach=True).item()


def _torch_inf_clip(model):
    return torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01, float("inf")).item()


def _zerokit_norm_clip(model):
    return zerokit.clip_grad_norm_(model, 0.05).item()


def _check_level(rank, world_size, level, **options):
    batches = global_batches(4, batch=4 * world_size)
    for what, ref_clip, clip in [
        ("clip_grad_value_", _torch_value_clip, _torch_value_clip),
        ("clip_grad_norm_", _torch_norm_clip, _torch_norm_clip),
        ("clip_grad_norm_ foreach", _torch_norm_clip, _torch_norm_clip_foreach),
        ("clip_grad_norm_ inf", _torch_inf_clip, _torch_inf_clip),
        ("zerokit.clip_grad_norm_", _torch_norm_clip, _zerokit_norm_clip),
    ]:
        (ref_model, ref_opt), (model, opt) = reference_pair("awkward", "adamw")
        ref_norms = _train(ref_model, ref_opt, batches, ref_clip)
        config = zerokit.ShardingConfig(**options)
        model, opt, _ = zerokit.group_sharded_parallel(
            model, opt, level, **SMALL[level], config=config
        )
        norms = _train(model, opt, batches, clip, shard=(rank, world_size))
        tag = f"torch's {what} level={level} {options} world_size={world_size}"
        torch.testing.assert_close(
            norms, ref_norms, atol=ATOL, rtol=1e-6, msg=lambda m, tag=tag: tag + m
        )
        assert_same_params(model, ref_model, ATOL, tag)


def _check_what_grad_holds(rank, world_size, level, **options):
    """``p.grad is None`` exactly where one process has no gradient (the unused and frozen
    parameters); elsewhere the full gradient ('os' with ``whole_grads=True``) or a placeholder
    of the parameter's shape (every level by default: 'os' reduce-scatters too)."""
    ((x, y),) = global_batches(1, batch=2 * world_size)
    (ref_model, _), (model, opt) = reference_pair("awkward", "sgd")
    loss_fn(ref_model(x), y).backward()
    config = zerokit.ShardingConfig(**options)
    model, opt, _ = zerokit.group_sharded_parallel(model, opt, level, **SMALL[level], config=config)
    loss_fn(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
    for (name, p), ref_p in zip(model.named_parameters(), ref_model.parameters()):
        assert (p.grad is None) == (ref_p.grad is None), f"{level} {name}: {p.grad!r}"
        if p.grad is None:
            continue
        assert p.grad.shape == p.shape, name  # at 'p_g_os' a sharded parameter is empty
        if options.get("whole_grads"):
            torch.testing.assert_close(p.grad, ref_p.grad, atol=1e-6, rtol=0)
        else:
            assert "placeholder" in repr(p.grad).lower() or "GradPlaceholder" in repr(p.grad)


def _refusals(rank, world_size):
    """What cannot be exact is refused on every rank, at the call, changing nothing."""
    ((x, y),) = global_batches(1, batch=2 * world_size)
    x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)

    def read_values(model):
        return sum(p.grad.sum() for p in model.parameters() if p.grad is not None)

    def add_a_tensor(model):  # arithmetic with a whole tensor: refused by name, not by torch
        grad = max((p for p in model.parameters() if p.grad is not None), key=torch.numel).grad
        return grad + torch.ones(grad.shape)  # several elements: not a number either

    def one_norm(model):
        return next(p for p in model.parameters() if p.grad is not None).grad.norm().item()

    for level, options, use, match in [
        # step_in_backward applied every gradient during backward: any clip comes too late
        ("os_g", {"step_in_backward": True}, _torch_value_clip, "already applied"),
        ("p_g_os", {"step_in_backward": True}, _torch_norm_clip, "already applied"),
        ("os_g", {}, read_values, "placeholder"),
        ("os", {}, read_values, "whole_grads=True"),  # the default reduce-scatters: sharded
        ("os_g", {}, add_a_tensor, "placeholder"),
        ("p_g_os", {}, one_norm, "summed over the ranks"),
    ]:
        _, (model, opt) = reference_pair("awkward", "sgd")
        model, opt, _ = zerokit.group_sharded_parallel(model, opt, level, **options)
        loss_fn(model(x), y).backward()
        with pytest.raises(ShardedGradError, match=match):
            use(model)


def _all_levels(rank, world_size):
    for level in LEVELS:
        _check_level(rank, world_size, level)
        _check_what_grad_holds(rank, world_size, level)
    _check_level(rank, world_size, "os", whole_grads=True)  # .grad whole: torch reads it all
    _check_what_grad_holds(rank, world_size, "os", whole_grads=True)
    _refusals(rank, world_size)


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_torch_clip_is_exact_or_refused(world_size):
    run_distributed(_all_levels, world_size)
