"""Checkpoints of pipelined models: a pp=2 run (an embedding tied to the LM head across the
stages, AdamW) saves after two steps; loaded at pp=1 (one process), at pp=3 and at dp 2 x pp 2
under ZeRO, the next steps equal uninterrupted training in one process (2e-5), optimizer state
included. The checkpoint names tensors as the whole model does (``layers.<i>.*``,
``shared.<key>.*``), so it also loads into a plain ``PipelineStage(layers, 0)`` and
consolidates. The dp 2 x pp 2 run saves again from its ZeRO shards; that checkpoint loads at
pp=1. Ranks that split the layers differently are refused on every rank."""

import os

import pytest
import torch
from dist_helpers import run_distributed
from models import VOCAB, global_batches, loss_fn
from torch import nn

import zerokit
from zerokit.checkpoint import (
    CheckpointError,
    consolidate,
    describe,
    load,
    load_consolidated,
    save,
)
from zerokit.checkpoint.reading import CheckpointReader
from zerokit.pipeline import LayerDesc, PipelineModule, PipelineStage, SharedLayerDesc

ATOL = 2e-5
DIM = 6
BEFORE, AFTER = 2, 2  # steps before the save, and after the load
BATCH = 8


def head(emb: nn.Embedding, x):  # [B, T, dim] -> [B, T, vocab]
    return x @ emb.weight.t()


class Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(DIM, hidden), nn.Linear(hidden, DIM)
        self.register_buffer("gain", torch.tensor(0.9))  # a persistent buffer, per layer

    def forward(self, x):
        return x + self.gain * self.fc2(torch.tanh(self.fc1(x)))


def half(x):
    return x * 0.5


def layer_list() -> list:
    """6 layers: tied embedding, 3 blocks, a function, the tied head."""
    return [
        SharedLayerDesc("embed", nn.Embedding, None, "weight", VOCAB, DIM),
        *[LayerDesc(Block, 4 + i) for i in range(3)],
        half,
        SharedLayerDesc("embed", nn.Embedding, head, "weight", VOCAB, DIM),
    ]


def make_opt(params):
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def reference():
    """Uninterrupted: every step in one process. Initial state, state after BEFORE steps,
    losses and state after BEFORE + AFTER steps."""
    torch.manual_seed(0)
    model = PipelineStage(layer_list(), 0)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    opt = make_opt(model.parameters())
    losses, middle = [], None
    for step, (x, y) in enumerate(global_batches(BEFORE + AFTER, batch=BATCH)):
        if step == BEFORE:
            middle = {k: v.clone() for k, v in model.state_dict().items()}
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return init, middle, losses, model.state_dict()


def check_state(got: dict, want: dict, what: str) -> None:
    for name, value in got.items():
        torch.testing.assert_close(value, want[name], atol=ATOL, rtol=0, msg=f"{what}: {name}")


def continue_and_check(pipe, opt, what, dp_rank=0, dp=1):
    """Train the AFTER steps on ``pipe`` and compare with the reference."""
    _, _, ref_losses, ref_state = reference()
    per = BATCH // dp
    batches = global_batches(BEFORE + AFTER, batch=BATCH)[BEFORE:]
    for step, (x, y) in enumerate(batches):
        mine = slice(dp_rank * per, (dp_rank + 1) * per)
        loss = pipe.train_batch((x[mine], y[mine]), opt, "1f1b", micro_batches=2).item()
        want = ref_losses[BEFORE + step]
        assert abs(loss - want) <= ATOL, f"{what}: step {BEFORE + step}: {loss} != {want}"
    check_state(pipe.stage.state_dict(), ref_state, what)


def _save_pp2(rank, world_size, path):
    init, middle, ref_losses, _ = reference()
    pipe = PipelineModule(layer_list(), loss_fn, num_stages=2, partition=[0, 3, 6])
    mine = pipe.stage.state_dict()
    pipe.stage.load_state_dict({k: init[k] for k in mine})
    opt = make_opt(pipe.parameters())
    for step, batch in enumerate(global_batches(BEFORE, batch=BATCH)):
        loss = pipe.train_batch(batch, opt, "1f1b", micro_batches=2).item()
        assert abs(loss - ref_losses[step]) <= ATOL
    check_state(pipe.stage.state_dict(), middle, f"pp2 stage {rank} before the save")
    save(path, pipe, opt)


def save_pp2(path: str) -> None:
    run_distributed(_save_pp2, 2, path)


def test_pp2_checkpoint_loads_at_pp1(tmp_path):
    path = str(tmp_path / "pp2")
    save_pp2(path)
    # the whole model's names, each tensor once; only stage 0 wrote the tied weight
    reader = CheckpointReader(path)
    index = reader.index
    reader.close()
    _, middle, _, _ = reference()
    model_names = {n for n in index["tensors"] if not n.startswith("optim.")}
    assert model_names == set(middle), sorted(model_names ^ set(middle))
    assert index["layout"]["pp_degree"] == 2 and index["layout"]["world_size"] == 2
    tied = index["tensors"]["shared.embed.weight"]["parts"]["0"]
    assert [p["file"] for p in tied] == ["rank00000.safetensors"]
    assert "layers.3.fc2.weight" in index["tensors"]  # stage 1's, under its global index

    # a plain single-process model of the same layers: names as the checkpoint's
    plain = PipelineStage(layer_list(), 0)
    load(path, plain)
    check_state(plain.state_dict(), middle, "plain PipelineStage")
    consolidate(path, str(tmp_path / "model.safetensors"))  # offline: one plain file
    plain = PipelineStage(layer_list(), 0)
    load_consolidated(str(tmp_path / "model.safetensors"), plain)
    check_state(plain.state_dict(), middle, "consolidated")
    report, ok = describe(path)
    assert ok and "2 pipeline stages" in report, report

    # pp=1 PipelineModule (no process group) with its optimizer: training goes on exactly
    torch.manual_seed(5)
    pipe = PipelineModule(layer_list(), loss_fn)
    opt = make_opt(pipe.parameters())
    load(path, pipe, opt)
    check_state(pipe.stage.state_dict(), middle, "pp1 after load")
    assert all(s["step"].item() == BEFORE for s in opt.state.values())
    continue_and_check(pipe, opt, "pp2 -> pp1")


def _load_pp3(rank, world_size, path):
    torch.manual_seed(10 + rank)  # the load must set everything
    pipe = PipelineModule(layer_list(), loss_fn, num_stages=3, partition=[0, 2, 4, 6])
    opt = make_opt(pipe.parameters())
    load(path, pipe, opt)
    continue_and_check(pipe, opt, f"pp2 -> pp3, stage {rank}")


@pytest.mark.slow
def test_pp2_checkpoint_loads_at_pp3(tmp_path):
    path = str(tmp_path / "pp2")
    save_pp2(path)
    run_distributed(_load_pp3, 3, path)


def _load_dp2_pp2(rank, world_size, path, level, path_again):
    layout = zerokit.init_hybrid_parallel(2, 1, pp_degree=2)
    torch.manual_seed(20 + rank)
    pipe = PipelineModule(layer_list(), loss_fn, layout=layout, partition=[0, 2, 6])
    opt = make_opt(pipe.stage.parameters())
    _, opt, _ = zerokit.group_sharded_parallel(pipe.stage, opt, level, group=layout.dp_group)
    load(path, pipe, opt)
    # saved again from ZeRO shards across both axes: the same checkpoint, resharded
    save(path_again, pipe, opt)
    continue_and_check(pipe, opt, f"pp2 -> dp2 x pp2 {level}, rank {rank}", layout.dp_rank, 2)


@pytest.mark.slow
@pytest.mark.parametrize("level", ["os_g", "p_g_os"])
def test_pp2_checkpoint_loads_at_dp2_pp2_under_zero(tmp_path, level):
    path, again = str(tmp_path / "pp2"), str(tmp_path / "dp2pp2")
    save_pp2(path)
    run_distributed(_load_dp2_pp2, 4, path, level, again)
    # the ZeRO pipeline's checkpoint holds the same values and loads at pp=1
    _, middle, _, _ = reference()
    pipe = PipelineModule(layer_list(), loss_fn)
    opt = make_opt(pipe.parameters())
    load(again, pipe, opt)
    check_state(pipe.stage.state_dict(), middle, "dp2 x pp2 checkpoint at pp1")
    continue_and_check(pipe, opt, "pp2 -> dp2 x pp2 -> pp1")
    assert sorted(os.listdir(again)) == [
        "index.json",
        *[f"rank{r:05d}.safetensors" for r in range(4)],
    ]


def _different_pipelines(rank, world_size, path):
    """Ranks that split the layers differently: the same error on every rank, nothing written
    (a plain layer list: no tied weight, so building needs no collective)."""
    layers = [LayerDesc(nn.Embedding, VOCAB, DIM), *[LayerDesc(Block, 4) for _ in range(3)]]
    layers.append(LayerDesc(nn.Linear, DIM, VOCAB))
    bounds = [0, 2, 5] if rank == 0 else [0, 3, 5]
    pipe = PipelineModule(layers, loss_fn, num_stages=2, partition=bounds)
    opt = make_opt(pipe.parameters())
    with pytest.raises(CheckpointError, match="the ranks see different pipelines"):
        save(path, pipe, opt)
    assert not os.path.exists(path)
    pipe = PipelineModule(layers, loss_fn, num_stages=2, partition=[0, 2, 5])
    save(path, pipe, make_opt(pipe.parameters()))  # the ranks agree now
    with pytest.raises(CheckpointError, match="the ranks see different pipelines"):
        load(path, PipelineModule(layers, loss_fn, num_stages=2, partition=bounds))


def test_ranks_with_different_pipelines_are_refused_on_every_rank(tmp_path):
    run_distributed(_different_pipelines, 2, str(tmp_path / "bad"))
