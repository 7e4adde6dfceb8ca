"""``MixedPrecision(reduce_dtype=torch.bfloat16)`` without ``param_dtype``: fp32 compute and
fp32 masters, gradients averaged across ranks in bf16 (half the bytes sent). It used to be
dropped silently (reduced in fp32); docs/GUIDE.md (The call) promises nothing is silently ignored.

What is checked, and why it can fail:
- every gradient the optimizer reads is a bf16 number (the average was taken in bf16, then
  widened): a reduction in fp32 leaves values that bf16 cannot hold;
- one rank does exactly what one process does when it rounds each gradient to bf16 by hand
  (within 1e-6): the policy is that and nothing else;
- at 2 and 3 ranks, several SGD steps stay as close to exact fp32 training as that
  hand-rounded process, within 4x (two runs rounded differently: the tolerance of
  test_mixed_precision; measured 1.2x-2.2x). SGD, not AdamW: here each rank's gradient is
  rounded and then their sum, two roundings against the hand run's one, and Adam divides
  a near-zero gradient's rounding by sqrt(v), which made AdamW's gap 6x at 2 ranks;
- ``memory.estimate`` agrees with ``memory.measure`` ('os' keeps the full gradient in bf16).
"""

import copy

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_distributed
from models import (
    SMALL,
    global_batches,
    local_slice,
    loss_fn,
    make_model,
    make_optimizer,
    train_reference,
    train_sharded,
)

import zerokit
from zerokit.core.state import state_of
from zerokit.memory import estimate, measure

STEPS = 6
POLICY = zerokit.MixedPrecision(reduce_dtype=torch.bfloat16)


def _train_rounding_by_hand(model, opt, batches) -> list[float]:
    """One process on the global batch, each gradient rounded to bf16 before the step."""
    losses = []
    for x, y in batches:
        loss = loss_fn(model(x), y)
        loss.backward()
        for p in model.parameters():
            if p.grad is not None:
                p.grad = p.grad.bfloat16().float()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _pieces(model):
    """(name, flat start, master view) of this rank's fp32 master pieces."""
    names = {id(p): n for n, p in model.named_parameters()}
    for bucket in state_of(model).buckets:
        for piece, view in zip(bucket.pieces, bucket.param_pieces):
            yield names[id(bucket.params[piece.slot])], piece.start, view


def _sum_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def _reduced_in_bf16(rank, world_size, opt_kind="adamw"):
    batches = global_batches(STEPS, batch=4 * world_size)
    for level in zerokit.LEVELS:
        what = f"level={level} {opt_kind} world_size={world_size}"
        exact = make_model("gpt")
        by_hand, model = copy.deepcopy(exact), copy.deepcopy(exact)
        exact_losses = train_reference(exact, make_optimizer(opt_kind, exact), batches)
        hand_losses = _train_rounding_by_hand(by_hand, make_optimizer(opt_kind, by_hand), batches)
        opt = make_optimizer(opt_kind, model)
        model, opt, _ = zerokit.group_sharded_parallel(
            model, opt, level, mixed_precision=POLICY, **SMALL[level]
        )
        # one backward: the gradients the optimizer would read are bf16 numbers in fp32
        x, y = (local_slice(t, rank, world_size) for t in batches[0])
        loss_fn(model(x), y).backward()
        for name, _, view in _pieces(model):
            assert view.dtype == torch.float32, f"{what}: {name} master is {view.dtype}"
            if view.grad is not None:
                assert torch.equal(view.grad, view.grad.bfloat16().float()), (
                    f"{what}: {name}'s gradient was not reduced in bf16"
                )
        got = measure(model, opt)
        want = estimate(exact, level, world_size, mixed_precision=POLICY, **SMALL[level])
        assert (got.params, got.grads) == (want.params, want.grads), f"{what}: {got} {want}"
        opt.zero_grad()

        losses = train_sharded(model, opt, batches, rank, world_size)
        hand = dict(by_hand.named_parameters())
        exact_params = dict(exact.named_parameters())
        if world_size == 1:  # the same computations as the hand-rounded run
            assert max(abs(a - b) for a, b in zip(losses, hand_losses)) <= 1e-6, what
            for name, start, view in _pieces(model):
                want_view = hand[name].detach().reshape(-1)[start : start + view.numel()]
                torch.testing.assert_close(view, want_view, atol=1e-6, rtol=0, msg=what)
            continue
        # no farther from exact fp32 training than the hand-rounded process (4x: rounding luck)
        hand_gap = max(abs(a - b) for a, b in zip(hand_losses, exact_losses))
        gap = max(abs(a - b) for a, b in zip(losses, exact_losses))
        assert gap <= 4 * hand_gap + 1e-6, f"{what}: loss {gap} from exact, by hand {hand_gap}"
        sq, n = 0.0, 0
        for name, start, view in _pieces(model):
            want_view = exact_params[name].detach().reshape(-1)[start : start + view.numel()]
            sq += ((view - want_view).double() ** 2).sum().item()
            n += view.numel()
        sq, n = _sum_over_ranks([sq, n])
        hand_sq = sum(
            ((p.detach() - exact_params[k].detach()).double() ** 2).sum().item()
            for k, p in hand.items()
            if p.requires_grad
        )
        hand_n = sum(p.numel() for p in hand.values() if p.requires_grad)
        rms, hand_rms = (sq / n) ** 0.5, (hand_sq / hand_n) ** 0.5
        assert rms <= 4 * hand_rms, f"{what}: masters rms {rms} from exact, by hand {hand_rms}"


@pytest.mark.parametrize("world_size", [1, 2, pytest.param(3, marks=pytest.mark.slow)])
def test_reduce_dtype_alone_reduces_in_it(world_size):
    run_distributed(_reduced_in_bf16, world_size, "sgd")


def test_a_policy_without_reduce_dtype_changes_nothing():
    assert zerokit.MixedPrecision().gradient_reduce_dtype() is None
    assert estimate(1000, "os", 2, mixed_precision=zerokit.MixedPrecision()) == estimate(
        1000, "os", 2
    )
    bf16 = zerokit.MixedPrecision(param_dtype=torch.bfloat16)
    assert bf16.gradient_reduce_dtype() == torch.float32  # fp32 reduction under bf16 compute
