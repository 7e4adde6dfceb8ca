"""Rank-local parameters (``param.is_distributed = True``) and the design documents' AlexNet:
a data-parallel body and a model-parallel head (``tp.BatchGatherLinear``) on the same ranks.

The layer equals ``nn.Linear`` on the gathered batch (output, input and weight gradients);
under every ZeRO level its parameters are neither broadcast at wrap nor averaged nor sharded,
and the hybrid AlexNet trains as one process on the whole batch does (2e-5, AdamW).
"""

import json
import os
import sys
import tempfile

import pytest
import torch
import torch.nn.functional as F
from dist_helpers import run_distributed
from torch import nn

import zerokit
from zerokit import tensor_parallel as tp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

ATOL = 2e-5


def _assert_close(got, want, what, atol=ATOL):
    torch.testing.assert_close(got, want, atol=atol, rtol=0, msg=lambda m: f"{what}: {m}")


# -- the layer ---------------------------------------------------------------------------------
def _check_layer(rank, world, out_features):
    torch.manual_seed(5)
    plain = nn.Linear(6, out_features)
    torch.manual_seed(5)
    layer = tp.BatchGatherLinear(6, out_features)
    assert layer.weight.is_distributed is True and layer.bias.is_distributed is True
    split = layer.tp_splits["weight"]
    assert torch.equal(layer.weight, split.local(plain.weight.detach(), rank))
    assert torch.equal(layer.bias, split.local(plain.bias.detach(), rank))

    b = 3
    torch.manual_seed(11)
    full_x = torch.randn(world * b, 6)
    probe = torch.randn(world * b, out_features)  # d loss / d y, the whole batch
    x = full_x[rank * b : (rank + 1) * b].clone().requires_grad_()
    y = layer(x)
    ref_x = full_x.clone().requires_grad_()
    ref_y = plain(ref_x)
    _assert_close(y, ref_y[rank * b : (rank + 1) * b].detach(), "output")
    # each rank's loss covers its own rows; the layer averages its weight gradient
    (y * probe[rank * b : (rank + 1) * b]).sum().backward()
    (ref_y * probe).sum().backward()
    _assert_close(x.grad, ref_x.grad[rank * b : (rank + 1) * b], "input gradient")
    _assert_close(layer.weight.grad, split.local(plain.weight.grad, rank) / world, "weight grad")
    _assert_close(layer.bias.grad, split.local(plain.bias.grad, rank) / world, "bias grad")

    raw = tp.BatchGatherLinear(6, out_features, average_grads=False)
    with torch.no_grad():
        raw.weight.copy_(layer.weight)
        raw.bias.copy_(layer.bias)
    (raw(x.detach()) * probe[rank * b : (rank + 1) * b]).sum().backward()
    _assert_close(raw.weight.grad, split.local(plain.weight.grad, rank), "summed weight grad")

    with pytest.raises(ValueError, match="same local batch size"):
        layer(torch.randn(b + rank, 6))


@pytest.mark.parametrize("world,out_features", [(2, 8), (3, 10)])
def test_batch_gather_linear_equals_linear_on_gathered_batch(world, out_features):
    run_distributed(_check_layer, world, out_features)


# -- ZeRO leaves rank-local parameters alone -----------------------------------------------------
class _Local(nn.Module):
    """A rank-local parameter (a different value on each rank), and a shared layer."""

    def __init__(self, rank):
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.local = nn.Parameter(torch.full((3, 4), float(rank + 1)))
        self.local.is_distributed = True

    def forward(self, x):
        return (self.shared(x) @ self.local.t()).sum(dim=1)


def _check_left_alone(rank, world):
    x = torch.ones(2, 4)
    for level in ("os", "os_g", "p_g_os"):
        torch.manual_seed(rank)  # the shared layer differs too before wrapping
        model = _Local(rank)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        model, opt, _ = zerokit.group_sharded_parallel(model, opt, level)
        state = zerokit.core.state.state_of(model)
        assert all(p is not model.local for b in state.buckets for p in b.params), level
        # not broadcast: each rank keeps its own; the shared layer is rank 0's
        assert torch.equal(model.local, torch.full((3, 4), float(rank + 1))), level
        w = model.shared.weight if level != "p_g_os" else None
        if w is not None:
            got = torch.stack([w.detach().clone() for _ in range(world)])
            torch.distributed.all_gather(list(got), w.detach().contiguous())
            assert all(torch.equal(g, got[0]) for g in got), level
        # not averaged: its gradient is this rank's own (the loss scaled by the rank)
        loss = model(x * (rank + 1)).sum() * (rank + 1)
        loss.backward()
        grad = model.local.grad.clone()
        opt.step()  # stepped by its own rank, with its own gradient, whole
        _assert_close(model.local.detach(), torch.full((3, 4), float(rank + 1)) - 0.5 * grad, level)
        # the shared layer's gradient is averaged, so its values agree after the step
        full = dict(model.state_dict())
        weights = [torch.empty_like(full["shared.weight"]) for _ in range(world)]
        torch.distributed.all_gather(weights, full["shared.weight"].contiguous())
        assert all(torch.equal(wt, weights[0]) for wt in weights), level
        opt.zero_grad()
        assert model.local.grad is None, level
    # the gradient itself: the rank's own, never averaged with another rank's
    torch.manual_seed(0)
    model = _Local(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt, _ = zerokit.group_sharded_parallel(model, opt, "os_g")
    with torch.no_grad():
        own = model.shared(x * (rank + 1)).sum(dim=0) * (rank + 1)  # d loss / d local[j, :]
    (model(x * (rank + 1)).sum() * (rank + 1)).backward()
    _assert_close(model.local.grad, own.expand(3, 4), "rank-local gradient")
    # clip counts it once over the ranks: sum of squares over every rank's slice
    norm_sq = torch.tensor(float(model.local.grad.pow(2).sum()))
    torch.distributed.all_reduce(norm_sq)
    pieces = zerokit.core.state.state_of(model).owned_grad_pieces()
    shared_sq = torch.tensor(sum(float(g.pow(2).sum()) for _, g in pieces))
    torch.distributed.all_reduce(shared_sq)
    total = zerokit.clip_grad_norm_(model, 1e9)
    _assert_close(total, (norm_sq + shared_sq).sqrt(), "clip norm", atol=1e-4)
    # the scaler unscales it and agrees on an inf in it (one rank's)
    scaler = zerokit.ShardedGradScaler(init_scale=4.0)
    opt.zero_grad()
    scaler.scale(model(x).sum()).backward()
    scaled = model.local.grad.clone()
    if rank == 1:
        model.local.grad[0, 0] = float("inf")
    before = model.local.detach().clone()
    scaler.step(opt)
    scaler.update()
    if rank == 0:
        _assert_close(model.local.grad, scaled / 4.0, "unscaled")
    assert torch.equal(model.local.detach(), before), "a step with an inf was not skipped"
    assert scaler.get_scale() == 2.0
    # a checkpoint cannot say whose part an undescribed rank-local parameter is: refused
    nowhere = os.path.join(tempfile.gettempdir(), "zerokit-never-written")
    with pytest.raises(zerokit.checkpoint.CheckpointError, match="cannot save or load it yet"):
        zerokit.checkpoint.save(nowhere, model, opt)
    assert not os.path.exists(nowhere)


def test_rank_local_params_not_broadcast_averaged_or_sharded():
    run_distributed(_check_left_alone, 2)


# -- the documents' AlexNet --------------------------------------------------------------------
def _check_alexnet(rank, world, level, steps):
    import argparse

    import alexnet_hybrid

    args = argparse.Namespace(level=level, steps=steps, batch=12, lr=1e-2, clip=0.3, dropout=0.0)
    got = alexnet_hybrid.run(rank, world, args)
    _assert_close(torch.tensor(got["hybrid"]), torch.tensor(got["reference"]), "losses")
    _assert_close(torch.tensor(got["norms"]), torch.tensor(got["reference_norms"]), "norms")
    assert min(got["reference_norms"]) > args.clip  # the clip clipped every step
    assert got["max_diff"] < ATOL, got["max_diff"]


@pytest.mark.parametrize("level", ["os", "os_g", "p_g_os"])
def test_alexnet_hybrid_trains_as_one_process(level):
    run_distributed(_check_alexnet, 2, level, 4)


@pytest.mark.slow
def test_alexnet_hybrid_three_ranks():
    run_distributed(_check_alexnet, 3, "p_g_os", 4)


# -- checkpoints: each rank's part, described by its split; resharded on load --------------------
def _hybrid(group, seed=0):
    import alexnet_hybrid

    torch.manual_seed(seed)
    reference = alexnet_hybrid.AlexNet()
    torch.manual_seed(seed)
    model = alexnet_hybrid.AlexNet(hybrid=True, group=group)
    return reference, model


def _train(reference, ref_opt, model, opt, steps, first, rank, world):
    import alexnet_hybrid

    per_rank = 12 // world
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    for step in range(first, first + steps):
        x, y = alexnet_hybrid.batch(step, 12)
        ref_loss = F.cross_entropy(reference(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss = F.cross_entropy(model(x[mine]), y[mine])
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss = loss.detach().clone()
        torch.distributed.all_reduce(loss)
        _assert_close(loss / world, ref_loss.detach(), f"loss at step {step}")


def _save_hybrid(rank, world, path, level):
    reference, model = _hybrid(torch.distributed.group.WORLD)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt, _ = zerokit.group_sharded_parallel(model, opt, level)
    _train(reference, ref_opt, model, opt, 2, 0, rank, world)
    zerokit.checkpoint.save(os.path.join(path, "ckpt"), model, opt)
    if rank == 0:
        torch.save(
            {"model": reference.state_dict(), "opt": ref_opt.state_dict()},
            os.path.join(path, "reference.pt"),
        )


def _load_hybrid(rank, world, path, level):
    import alexnet_hybrid

    reference, model = _hybrid(torch.distributed.group.WORLD, seed=1)  # other values
    saved = torch.load(os.path.join(path, "reference.pt"))
    reference.load_state_dict(saved["model"])
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ref_opt.load_state_dict(saved["opt"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt, _ = zerokit.group_sharded_parallel(model, opt, level)
    zerokit.checkpoint.load(os.path.join(path, "ckpt"), model, opt)
    assert alexnet_hybrid.max_difference(model, reference) < ATOL  # seed 1 is far off
    _train(reference, ref_opt, model, opt, 2, 2, rank, world)  # the optimizer state too
    assert alexnet_hybrid.max_difference(model, reference) < ATOL


def test_checkpoint_saves_each_ranks_part(tmp_path):
    """Saved at 2 ranks: each rank writes its part of a head layer, the index says how the
    parts make the whole (its split); loaded at another level, and at 3 ranks (slow), each
    rank reads its part of the new split; training then goes on as one process would."""
    run_distributed(_save_hybrid, 2, str(tmp_path), "os_g")
    index = json.loads((tmp_path / "ckpt" / "index.json").read_text())
    for name in ("classifier.1.weight", "optim.exp_avg.classifier.6.bias"):
        entry = index["tensors"][name]
        sizes = [16, 16] if name.startswith("classifier.1.") else [5, 5]
        assert entry["tp"] == {"dim": 0, "block_sizes": sizes, "stride": 1}, entry
        assert sorted(entry["parts"]) == ["0", "1"], entry
    run_distributed(_load_hybrid, 2, str(tmp_path), "p_g_os")


@pytest.mark.slow
def test_checkpoint_reshards_rank_local_parts(tmp_path):
    run_distributed(_save_hybrid, 2, str(tmp_path), "os")
    run_distributed(_load_hybrid, 3, str(tmp_path), "os_g")  # 32 features: 10/10/12
