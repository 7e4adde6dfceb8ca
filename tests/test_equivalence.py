"""The defining property: N ranks, each on its slice of the global batch, train exactly as one
process on the whole global batch. Losses and final parameters within 2e-5 (fp32)."""

import contextlib
import copy

import pytest
import torch
from dist_helpers import run_distributed
from models import (
    SMALL,
    assert_same_params,
    global_batches,
    local_slice,
    loss_fn,
    make_model,
    reference_pair,
    train_reference,
    train_sharded,
)

import zerokit

STEPS = 10
ATOL = 2e-5


def _equivalence_matrix(rank, world_size):
    batches = global_batches(STEPS, batch=4 * world_size)
    for level in ("os", "os_g", "p_g_os"):
        for model_kind in ("awkward", "gpt"):
            for opt_kind in ("sgd", "adamw"):
                what = f"level={level} model={model_kind} opt={opt_kind} world_size={world_size}"
                (ref_model, ref_opt), (model, opt) = reference_pair(model_kind, opt_kind)
                ref_losses = train_reference(ref_model, ref_opt, batches)
                model, opt, _ = zerokit.group_sharded_parallel(model, opt, level, **SMALL[level])
                losses = train_sharded(model, opt, batches, rank, world_size)
                for step, (got, ref) in enumerate(zip(losses, ref_losses)):
                    assert abs(got - ref) <= ATOL, f"{what}: step {step} loss {got} != {ref}"
                assert_same_params(model, ref_model, ATOL, what)
                # a parameter unused everywhere was skipped by the optimizer, as in one process
                if model_kind == "awkward":
                    unused = model.state_dict()["unused"]
                    assert torch.equal(unused, ref_model.unused.detach()), what


OTHER_OPTIMIZERS = {
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2, eps=1e-6),
    # Adagrad creates its state in __init__: wrapping must slice it, not drop it
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=0.05, initial_accumulator_value=0.1),
    "rmsprop": lambda params: torch.optim.RMSprop(params, lr=1e-3, momentum=0.5, centered=True),
}


def _trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def _other_optimizers(rank, world_size, every_pair=True):
    """Every level with every optimizer; with ``every_pair=False`` (the fast subset) each
    optimizer once, at its own level: adam 'os', adagrad 'os_g', rmsprop 'p_g_os'."""
    batches = global_batches(STEPS, batch=2 * world_size)
    for i, level in enumerate(("os", "os_g", "p_g_os")):
        for j, (name, factory) in enumerate(OTHER_OPTIMIZERS.items()):
            if not every_pair and i != j:
                continue
            what = f"level={level} opt={name} world_size={world_size}"
            ref_model = make_model("awkward")
            model = copy.deepcopy(ref_model)
            ref_opt, opt = factory(_trainable(ref_model)), factory(_trainable(model))
            train_reference(ref_model, ref_opt, batches)
            model, opt, _ = zerokit.group_sharded_parallel(model, opt, level, **SMALL[level])
            train_sharded(model, opt, batches, rank, world_size)
            assert_same_params(model, ref_model, ATOL, what)


@pytest.mark.parametrize(
    "world_size",
    [
        pytest.param(1, marks=pytest.mark.slow),
        2,
        pytest.param(3, marks=pytest.mark.slow),
        pytest.param(4, marks=pytest.mark.slow),
    ],
)
def test_matches_single_process_training(world_size):
    run_distributed(_equivalence_matrix, world_size)


@pytest.mark.slow
def test_other_elementwise_optimizers_match_single_process():
    run_distributed(_other_optimizers, 3)


def test_other_elementwise_optimizers_each_at_one_level():
    """The fast subset's share of the test above: 2 ranks, each optimizer at one level."""
    run_distributed(_other_optimizers, 2, False)


def _stage1_loop(model, opt, batches, clip, shard=None, micro=3):
    """Micro-batches per step: the first under ``no_sync`` (where ``no_sync`` exists), the
    next two reduced one after the other without ``zero_grad`` (a reduction accumulates onto
    the last one's), then ``clip(model)`` and a step; every other step zeroes without freeing."""
    norms = []
    for step, (x, y) in enumerate(batches):
        if shard:
            x, y = local_slice(x, *shard), local_slice(y, *shard)
        for k, (mx, my) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
            quiet = shard is not None and k == 0
            with model.no_sync() if quiet else contextlib.nullcontext():
                (loss_fn(model(mx), my) / micro).backward()
        norms.append(clip(model))
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
    return norms


def _stage1_both_reductions(rank, world_size):
    """'os' reduce-scatters by default (the ZeRO paper's 2Ψ) and all-reduces with
    ``whole_grads=True``: both train as one process on the global batch, clipped."""
    batches = global_batches(STEPS // 2, batch=3 * world_size)
    for whole in (False, True):
        for opt_kind in ("sgd", "adamw"):
            what = f"level=os whole_grads={whole} opt={opt_kind} world_size={world_size}"
            (ref_model, ref_opt), (model, opt) = reference_pair("awkward", opt_kind)
            ref_norms = _stage1_loop(
                ref_model, ref_opt, batches,
                lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05).item(),
            )  # fmt: skip
            config = zerokit.ShardingConfig(whole_grads=whole)
            model, opt, _ = zerokit.group_sharded_parallel(
                model, opt, "os", **SMALL["os"], config=config
            )
            norms = _stage1_loop(
                model, opt, batches, lambda m: zerokit.clip_grad_norm_(m, 0.05).item(),
                shard=(rank, world_size),
            )  # fmt: skip
            torch.testing.assert_close(norms, ref_norms, atol=ATOL, rtol=1e-6, msg=what)
            assert_same_params(model, ref_model, ATOL, what)


@pytest.mark.parametrize("world_size", [2, 3])
def test_stage1_reduce_scatter_and_whole_grads_match_single_process(world_size):
    run_distributed(_stage1_both_reductions, world_size)
