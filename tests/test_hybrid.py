"""Hybrid sharding (``dp_group``): state sharded inside a group, replicated across groups.

At 4 ranks, each layout trains the same steps as one process on the global batch (2e-5,
fp32): dp 2 x sharding 2 at every level, the edge layouts 1 x 4 and 4 x 1, dp 2 x sharding 1 x
tp 2, with clipping (each element counted once), no_sync accumulation and bf16; a replicated
layout's checkpoint is written once and loads into other layouts."""

import os

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_distributed
from models import (
    SMALL,
    VOCAB,
    assert_same_params,
    global_batches,
    local_slice,
    loss_fn,
    reference_pair,
    train_reference,
    train_sharded,
)

import zerokit
from zerokit.core.state import state_of
from zerokit.models.gpt import GPT, GPTConfig

ATOL = 2e-5
STEPS = 6


def _groups(dp, sharding):
    layout = zerokit.init_hybrid_parallel(dp, 1, sharding_degree=sharding)
    if sharding == 1:  # every rank its own shard group: pure replication over dp_group
        singles = [dist.new_group([r]) for r in range(dist.get_world_size())]
        return singles[dist.get_rank()], layout.dp_group
    return layout.sharding_group, layout.dp_group


LAYOUTS = ((2, 2, ("os", "os_g", "p_g_os")), (1, 4, ("os_g",)), (4, 1, ("p_g_os",)))


def _layouts(rank, world_size, layouts=LAYOUTS, model_kinds=("awkward", "gpt")):
    batches = global_batches(STEPS, batch=2 * world_size)
    for dp, sharding, levels in layouts:
        group, replicas = _groups(dp, sharding)
        for level in levels:
            for model_kind in model_kinds:
                what = f"dp {dp} x sharding {sharding} level={level} model={model_kind}"
                (ref, ref_opt), (model, opt) = reference_pair(model_kind, "adamw")
                ref_losses = train_reference(ref, ref_opt, batches)
                model, opt, _ = zerokit.group_sharded_parallel(
                    model, opt, level, group=group, dp_group=replicas, **SMALL[level]
                )
                losses = train_sharded(model, opt, batches, rank, world_size)
                for step, (got, want) in enumerate(zip(losses, ref_losses)):
                    assert abs(got - want) <= ATOL, f"{what}: step {step}: {got} != {want}"
                assert_same_params(model, ref, ATOL, what)
                if model_kind == "awkward":  # unused everywhere: skipped, as in one process
                    assert torch.equal(model.state_dict()["unused"], ref.unused.detach()), what


@pytest.mark.slow
def test_hybrid_layouts_match_one_process():
    run_distributed(_layouts, 4)


def test_hybrid_dp2_x_sharding2_every_level_matches_one_process():
    """The fast subset's share of the test above: dp 2 x sharding 2, the awkward model."""
    run_distributed(_layouts, 4, LAYOUTS[:1], ("awkward",))


def _loop_features(rank, world_size):
    """Clipping, no_sync accumulation and bf16 at dp 2 x sharding 2."""
    group, replicas = _groups(2, 2)
    batches = global_batches(STEPS, batch=4 * world_size)
    for level in ("os", "os_g", "p_g_os"):
        (ref, ref_opt), (model, opt) = reference_pair("gpt", "sgd")
        model, opt, _ = zerokit.group_sharded_parallel(
            model, opt, level, group=group, dp_group=replicas
        )
        for x, y in batches:
            loss_fn(ref(x), y).backward()
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
            ref_opt.step()
            ref_opt.zero_grad()
            xs, ys = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
            with model.no_sync():
                (loss_fn(model(xs[:2]), ys[:2]) / 2).backward()
            (loss_fn(model(xs[2:]), ys[2:]) / 2).backward()
            norm = zerokit.clip_grad_norm_(model, 0.05)
            torch.testing.assert_close(norm, ref_norm, atol=1e-5, rtol=1e-5)
            opt.step()
            opt.zero_grad()
        assert_same_params(model, ref, ATOL, f"hybrid {level} clip + no_sync")
        # one inf/nan verdict for everyone: the replicas and shards all see it
        state = state_of(model)
        assert state.replica_group is replicas and replicas in state.agree_groups


@pytest.mark.slow
def test_hybrid_composes_with_clipping_and_accumulation():
    run_distributed(_loop_features, 4)


def _precision_and_scaler(rank, world_size):
    """bf16 at dp 2 x sharding 2 tracks full sharding over 4 ranks (the same math, summed in
    another order: bf16 tolerance); an inf on one replica's rank makes every rank skip."""
    batches = global_batches(STEPS, batch=2 * world_size)
    policy = zerokit.MixedPrecision(param_dtype=torch.bfloat16)
    runs = {}
    for name, (group, replicas) in (("full", (dist.group.WORLD, None)), ("hybrid", _groups(2, 2))):
        (_, _), (model, opt) = reference_pair("gpt", "adamw")
        model, opt, _ = zerokit.group_sharded_parallel(
            model, opt, "p_g_os", group=group, dp_group=replicas, mixed_precision=policy
        )
        train_sharded(model, opt, batches, rank, world_size)
        runs[name] = model.state_dict()
    for key, value in runs["full"].items():
        torch.testing.assert_close(runs["hybrid"][key], value, atol=2e-2, rtol=0, msg=key)

    group, replicas = _groups(2, 2)
    (_, _), (model, opt) = reference_pair("gpt", "sgd")
    scaler = zerokit.ShardedGradScaler(init_scale=1024.0)
    model, opt, scaler = zerokit.group_sharded_parallel(
        model, opt, "os_g", group=group, dp_group=replicas, scaler=scaler
    )
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = batches[0]
    xs, ys = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
    scaler.scale(loss_fn(model(xs), ys)).backward()
    if rank == 3:  # one rank of the second replica sees an overflow in its shard
        state_of(opt).owned_grad_pieces()[0][1].fill_(float("inf"))
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 512.0
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), f"rank {rank} stepped {key}"


@pytest.mark.slow
def test_hybrid_with_bf16_and_an_agreed_loss_scaler():
    run_distributed(_precision_and_scaler, 4)


def _with_tp(rank, world_size):
    """dp 2 x sharding 1 x tp 2, the replicas given as dp_group."""
    layout = zerokit.init_hybrid_parallel(2, 2)
    single = [dist.new_group([r]) for r in range(world_size)][rank]
    cfg = GPTConfig(vocab_size=VOCAB, block_size=8, n_layer=2, n_head=2, n_embd=8)
    batches = global_batches(STEPS, batch=2 * layout.dp_degree)
    torch.manual_seed(0)
    ref = GPT(cfg)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**cfg.__dict__, "tensor_parallel": True}), layout)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    model, opt, _ = zerokit.group_sharded_parallel(
        model, opt, "os_g", group=single, dp_group=layout.dp_group
    )
    for x, y in batches:
        loss_fn(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        xs = local_slice(x, layout.dp_rank, layout.dp_degree)
        ys = local_slice(y, layout.dp_rank, layout.dp_degree)
        zerokit.tensor_parallel.ParallelCrossEntropy(layout=layout)(model(xs), ys).backward()
        opt.step()
        opt.zero_grad()
    full = zerokit.tensor_parallel.gather_full_state_dict(model)
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(full[name], value, atol=ATOL, rtol=0, msg=name)


@pytest.mark.slow
def test_hybrid_with_tensor_parallelism():
    run_distributed(_with_tp, 4)


def _checkpoint_once(rank, world_size, path):
    """A dp 2 x sharding 2 checkpoint: written by replica 0 only, loaded at 1 x 4."""
    batches = global_batches(3, batch=2 * world_size)
    group, replicas = _groups(2, 2)
    _, (model, opt) = reference_pair("gpt", "adamw")
    model, opt, _ = zerokit.group_sharded_parallel(
        model, opt, "p_g_os", group=group, dp_group=replicas
    )
    train_sharded(model, opt, batches, rank, world_size)
    zerokit.checkpoint.save(path, model, opt)
    (_, _), (other, other_opt) = reference_pair("gpt", "adamw")
    other, other_opt, _ = zerokit.group_sharded_parallel(other, other_opt, "os")
    zerokit.checkpoint.load(path, other, other_opt)
    assert_same_params(other, model, 0.0, "loaded at 1 x 4")


def test_replicated_checkpoint_is_written_once_and_reshards(tmp_path):
    path = str(tmp_path / "ckpt")
    run_distributed(_checkpoint_once, 4, path)
    sizes = {
        f: os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.startswith("rank")
    }
    replica0 = [sizes[f] for f in ("rank00000.safetensors", "rank00001.safetensors")]
    replica1 = [sizes.get(f, 0) for f in ("rank00002.safetensors", "rank00003.safetensors")]
    # ranks 2 and 3 (replica 1) hold the same shards and write none of them (at most a header)
    assert max(replica1) < min(replica0) / 4, sizes


@pytest.mark.parametrize("level", ["os_g"])
def test_estimate_shows_what_hybrid_sharding_holds(level):
    from zerokit.memory import estimate

    full = estimate(1_000_000, level, 4)
    hybrid = estimate(1_000_000, level, 4, sharding_degree=2)
    # sharded over 2 ranks instead of 4: twice the optimizer state and gradient shards
    assert hybrid.optimizer == 2 * full.optimizer and hybrid.grads == 2 * full.grads
    assert hybrid.params == full.params


@pytest.mark.slow
def test_compare_shows_what_hybrid_sharding_holds():
    from zerokit.tools.compare import CompareConfig, run_compare

    cfg = {"model": "models:tiny_gpt", "nproc": 4, "steps": 2, "batch": 4}
    full = run_compare(CompareConfig(**cfg), progress=lambda _: None)
    hybrid = run_compare(CompareConfig(**cfg, sharding_degree=2), progress=lambda _: None)
    assert hybrid["sharding_degree"] == 2
    for f, h in zip(full["rows"], hybrid["rows"]):
        if f["level"] == "ddp":
            continue
        # sharded over 2 ranks instead of 4: twice the optimizer state per rank, as estimated
        opt_f, opt_h = f["measured"]["optimizer"], h["measured"]["optimizer"]
        assert abs(opt_h - 2 * opt_f) <= 0.05 * opt_h, (f["level"], opt_f, opt_h)
        assert h["measured"]["optimizer"] == pytest.approx(h["estimated"]["optimizer"], rel=0.05)
        assert abs(h["final_loss"] - f["final_loss"]) < 1e-4  # the same training
