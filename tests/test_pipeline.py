"""Pipeline parallelism: schedules as pure action lists; pp=2 and pp=3 (uneven stages) train as
one process on the whole batch (2e-5, fp32) with every schedule and 1, 2, 4 micro-batches;
dp 2 x pp 2 under each ZeRO level with a global clipping norm; an embedding tied to the LM head
across stages; a rank builds only its own stage's layers; ``eval_batch`` equals the one-process
model's loss (in eval mode: dropout off, train mode restored); the built-in GPT, its embedding
tied to its head, as a pipeline (``gpt_layers``) trains as ``GPT`` in one process.
Tensor parallelism inside stages and mixed precision: test_pipeline_tp_mp.py."""

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_distributed
from models import VOCAB, global_batches, loss_fn, pipeline_reference
from torch import nn

import zerokit
from zerokit.models.gpt import GPT, GPTConfig, gpt_layers, gpt_pipeline_state_dict, lm_loss
from zerokit.pipeline import LayerDesc, PipelineModule, PipelineStage, SharedLayerDesc
from zerokit.pipeline import partition as part
from zerokit.pipeline.schedules import f_then_b, naive, one_f_one_b, peak_in_flight, schedule

ATOL = 2e-5
STEPS = 3
DIM = 6
BUILT: list[int] = []  # layers this process built on a real device (Recorded)


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):  # [B, T, dim]
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Recorded(Block):
    def __init__(self, index: int, dim: int, hidden: int):
        super().__init__(dim, hidden)
        if self.fc1.weight.device.type != "meta":
            BUILT.append(index)


def head(emb: nn.Embedding, x):  # [B, T, dim] -> [B, T, vocab]
    return x @ emb.weight.t()


def half(x):  # a parameterless function between layers
    return x * 0.5


def layer_list(blocks: int, tied: bool = False) -> list:
    first = (
        SharedLayerDesc("embed", nn.Embedding, None, "weight", VOCAB, DIM)
        if tied
        else LayerDesc(nn.Embedding, VOCAB, DIM)
    )
    last = (
        SharedLayerDesc("embed", nn.Embedding, head, "weight", VOCAB, DIM)
        if tied
        else LayerDesc(nn.Linear, DIM, VOCAB)
    )
    hidden = [LayerDesc(Recorded, i + 1, DIM, 5 + i % 3) for i in range(blocks)]
    return [first, *hidden, half, last]


# -- pure --------------------------------------------------------------------------------------
def test_schedules_as_lists():
    def show(fn, p, s, m):
        return " ".join(map(str, fn(p, s, m)))

    # Megatron's 1F1B at p=4, m=8: p-s-1 warm-up forwards, steady pairs, cool-down backwards.
    assert show(one_f_one_b, 4, 0, 8) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7"
    assert show(one_f_one_b, 4, 1, 8) == "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7"
    assert show(one_f_one_b, 4, 3, 8) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"
    assert show(one_f_one_b, 4, 0, 2) == "F0 F1 B0 B1"  # fewer micro-batches than stages
    assert show(f_then_b, 3, 1, 3) == "F0 F1 F2 B0 B1 B2"
    assert show(naive, 3, 2, 1) == "F0 B0"
    with pytest.raises(ValueError, match="one micro-batch"):
        schedule("naive", 2, 0, 2)
    for p in (2, 3, 4):
        for m in (1, 2, 5, 8):
            for s in range(p):
                acts = one_f_one_b(p, s, m)
                assert sorted(map(str, acts)) == sorted(map(str, f_then_b(p, s, m)))
                # micro-batches whose activations are held: F-then-B holds m
                assert peak_in_flight(acts) == min(p - s, m)


def test_partitions():
    assert part.partition_uniform(7, 3) == [0, 3, 5, 7]
    assert part.partition_balanced([1, 1, 10, 1, 1], 3) == [0, 2, 3, 5]
    assert part.partition_balanced([5, 1, 1, 1, 1, 1], 2) == [0, 1, 6]
    layers = layer_list(3)
    counts = [part.count_params(item) for item in layers]
    assert counts[0] == VOCAB * DIM and counts[-2] == 0
    assert BUILT == []  # counted on the meta device
    assert part.partition(layers, 2, [0, 4, 6]) == [0, 4, 6]
    with pytest.raises(ValueError, match="rise strictly"):
        part.partition(layers, 2, [0, 6, 6])
    with pytest.raises(ValueError, match="at least one layer"):
        part.partition_uniform(2, 3)


# -- distributed -------------------------------------------------------------------------------
def reference_run(layers, batches, clip=None):
    init, state, losses, _ = pipeline_reference(layers, batches, clip=clip)
    return init, state, losses


@torch.no_grad()
def reference_eval(layers, state, batch) -> float:
    """The one-process model's loss on ``batch`` with ``state`` loaded, in eval mode."""
    model = PipelineStage(layers, 0)
    model.load_state_dict(state)
    model.eval()
    x, y = batch
    return loss_fn(model(x), y).item()


def load_stage(pipe: PipelineModule, state: dict) -> None:
    mine = pipe.stage.state_dict()
    pipe.stage.load_state_dict({k: state[k] for k in mine})


def check(pipe, losses, ref_losses, ref_state, what):
    for step, (got, want) in enumerate(zip(losses, ref_losses)):
        assert abs(got - want) <= ATOL, f"{what}: step {step}: {got} != {want}"
    for name, value in pipe.stage.state_dict().items():
        torch.testing.assert_close(value, ref_state[name], atol=ATOL, rtol=0, msg=f"{what}: {name}")


def _equivalence(rank, world_size, blocks, partition):
    layers = layer_list(blocks)
    batches = global_batches(STEPS, batch=4)
    init, ref_state, ref_losses = reference_run(layers, batches)
    cases = [("naive", 1)] + [(s, m) for s in ("fthenb", "1f1b") for m in (1, 2, 4)]
    for sched, m in cases:
        BUILT.clear()
        pipe = PipelineModule(layers, loss_fn, num_stages=world_size, partition=partition)
        lo, hi = pipe.bounds[rank], pipe.bounds[rank + 1]
        # only this stage's layers were ever built; nothing left on the meta device
        assert BUILT == [i for i in range(1, blocks + 1) if lo <= i < hi], (BUILT, lo, hi)
        assert all(p.device.type == "cpu" for p in pipe.parameters())
        held = sum(p.numel() for p in pipe.parameters())
        assert held == sum(part.count_params(layers[i]) for i in range(lo, hi))
        load_stage(pipe, init)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.2, momentum=0.9)
        losses = [pipe.train_batch(b, opt, schedule=sched, micro_batches=m).item() for b in batches]
        check(pipe, losses, ref_losses, ref_state, f"pp{world_size} {sched} m={m}")
        want = reference_eval(layers, ref_state, batches[0])
        for em in (1, 2):
            got = pipe.eval_batch(batches[0], micro_batches=em).item()
            assert abs(got - want) <= ATOL, f"pp{world_size} {sched} m={m}: eval {got} != {want}"


def test_pp2_every_schedule():
    run_distributed(_equivalence, 2, 3, "uniform")


@pytest.mark.slow
def test_pp3_uneven_every_schedule():
    run_distributed(_equivalence, 3, 4, "parameters")  # 7 layers over 3 stages


def _zero(rank, world_size):
    layout = zerokit.init_hybrid_parallel(2, 1, pp_degree=2)
    assert (layout.pp_rank, layout.dp_rank) == divmod(rank, 2)
    layers = layer_list(3)
    batches = global_batches(STEPS, batch=8)
    init, ref_state, ref_losses = reference_run(layers, batches, clip=0.5)
    for level in zerokit.LEVELS:
        m = 2  # two micro-batches in flight on the first stage at every level
        pipe = PipelineModule(layers, loss_fn, layout=layout, partition=[0, 3, 6])
        load_stage(pipe, init)
        opt = torch.optim.SGD(pipe.stage.parameters(), lr=0.2, momentum=0.9)
        _, opt, _ = zerokit.group_sharded_parallel(pipe.stage, opt, level, group=layout.dp_group)
        losses = []
        for x, y in batches:
            half = slice(layout.dp_rank * 4, layout.dp_rank * 4 + 4)
            loss = pipe.train_batch((x[half], y[half]), opt, "1f1b", m, clip_norm=0.5)
            losses.append(loss.item())
        check(pipe, losses, ref_losses, ref_state, f"dp2 x pp2 level={level}")
        x, y = batches[0]
        half = slice(layout.dp_rank * 4, layout.dp_rank * 4 + 4)
        got = pipe.eval_batch((x[half], y[half]), micro_batches=2).item()
        want = reference_eval(layers, ref_state, batches[0])
        assert abs(got - want) <= ATOL, f"dp2 x pp2 level={level}: eval {got} != {want}"


@pytest.mark.slow
def test_dp2_pp2_every_zero_level():
    run_distributed(_zero, 4)


def _tied(rank, world_size):
    layers = layer_list(2, tied=True)
    batches = global_batches(STEPS, batch=4)
    init, ref_state, ref_losses = reference_run(layers, batches, clip=0.5)
    torch.manual_seed(rank)  # different draws on each stage: the build must make them equal
    pipe = PipelineModule(layers, loss_fn, num_stages=2, partition=[0, 2, 5])
    weight = pipe.stage.shared["embed"].weight
    both = [torch.empty_like(weight) for _ in range(2)]
    dist.all_gather(both, weight.detach())
    assert torch.equal(both[0], both[1]), "tied weights start equal"
    load_stage(pipe, init)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.2, momentum=0.9)
    losses = [pipe.train_batch(b, opt, "fthenb", 2, clip_norm=0.5).item() for b in batches]
    check(pipe, losses, ref_losses, ref_state, "tied embedding")


def test_tied_embedding_across_stages():
    run_distributed(_tied, 2)


def _tied_zero(rank, world_size):
    """Tied weights across stages under ZeRO: every backward runs in no_sync(), the copies'
    gradients are summed across stages, then each stage reduces (model.reduce_gradients())."""
    layout = zerokit.init_hybrid_parallel(2, 1, pp_degree=2)
    layers = layer_list(2, tied=True)
    batches = global_batches(STEPS, batch=8)
    init, ref_state, ref_losses = reference_run(layers, batches, clip=0.5)
    for level in ("os_g", "p_g_os"):
        pipe = PipelineModule(layers, loss_fn, layout=layout, partition=[0, 2, 5])
        load_stage(pipe, init)
        opt = torch.optim.SGD(pipe.stage.parameters(), lr=0.2, momentum=0.9)
        _, opt, _ = zerokit.group_sharded_parallel(pipe.stage, opt, level, group=layout.dp_group)
        losses = []
        for x, y in batches:
            half = slice(layout.dp_rank * 4, layout.dp_rank * 4 + 4)
            loss = pipe.train_batch((x[half], y[half]), opt, "fthenb", 2, clip_norm=0.5)
            losses.append(loss.item())
        check(pipe, losses, ref_losses, ref_state, f"tied, dp2 x pp2 level={level}")


@pytest.mark.slow
def test_tied_embedding_across_stages_under_zero():
    run_distributed(_tied_zero, 4)


# -- the built-in GPT as a pipeline --------------------------------------------------------------
GPT_CFG = GPTConfig(vocab_size=VOCAB, block_size=8, n_layer=2, n_head=2, n_embd=8)


def reference_gpt(cfg, batches, clip):
    torch.manual_seed(0)
    model = GPT(cfg)
    init = {k: v.clone() for k, v in gpt_pipeline_state_dict(model.state_dict(), cfg).items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    losses = []
    for x, y in batches:
        loss = lm_loss(model(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        assert norm > clip  # the clipping bites
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, init, gpt_pipeline_state_dict(model.state_dict(), cfg), losses


def _gpt(rank, world_size, level, segment_size=2**20):
    """``PipelineModule(gpt_layers(cfg), lm_loss)`` against ``GPT(cfg)``: training (the tied
    embedding on the first stage, the head on the last), clipping, ``eval_batch``; then with
    dropout, ``eval_batch`` runs in eval mode and leaves the stage training. A small
    ``segment_size`` makes each layer a unit of its own: the head, which uses the tied copy's
    weight without calling the embedding, must still find it gathered at 'p_g_os'."""
    layout = None if level is None else zerokit.init_hybrid_parallel(2, 1, pp_degree=2)
    dp = 1 if layout is None else 2
    batches = global_batches(STEPS, batch=4 * dp)
    ref, init, ref_state, ref_losses = reference_gpt(GPT_CFG, batches, clip=0.5)
    pipe = PipelineModule(gpt_layers(GPT_CFG), lm_loss, num_stages=2, layout=layout)
    assert pipe.bounds == [0, 3, 6] and set(pipe.shared_groups) == {"wte"}, pipe.bounds
    load_stage(pipe, init)
    opt = torch.optim.SGD(pipe.stage.parameters(), lr=0.2, momentum=0.9)
    if layout is not None:
        _, opt, _ = zerokit.group_sharded_parallel(
            pipe.stage, opt, level, group=layout.dp_group, segment_size=segment_size
        )
    mine = slice(0, None) if layout is None else slice(layout.dp_rank * 4, layout.dp_rank * 4 + 4)
    losses = [
        pipe.train_batch((x[mine], y[mine]), opt, "1f1b", 2, clip_norm=0.5).item()
        for x, y in batches
    ]
    what = f"GPT pp2 dp{dp} level={level}"
    check(pipe, losses, ref_losses, ref_state, what)
    x, y = batches[0]
    ref.eval()
    with torch.no_grad():
        want = lm_loss(ref(x), y).item()
    got = pipe.eval_batch((x[mine], y[mine]), micro_batches=2).item()
    assert abs(got - want) <= ATOL, f"{what}: eval {got} != {want}"
    if layout is not None:
        return
    # dropout: eval_batch must turn it off (one process: GPT.eval()) and restore train mode
    cfg = GPTConfig(**{**GPT_CFG.__dict__, "explicit_attention": True, "dropout": 0.5})
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    with torch.no_grad():
        want = lm_loss(model(x), y).item()
    pipe = PipelineModule(gpt_layers(cfg), lm_loss, num_stages=2)
    load_stage(pipe, gpt_pipeline_state_dict(model.state_dict(), cfg))
    assert pipe.stage.training
    got = pipe.eval_batch(batches[0], micro_batches=2).item()
    assert abs(got - want) <= ATOL, f"GPT with dropout: eval {got} != {want}"
    assert pipe.stage.training, "eval_batch left the stage in eval mode"
    pipe.stage.eval()
    pipe.eval_batch(batches[0])
    assert not pipe.stage.training, "eval_batch put a stage in eval mode back in train mode"


def test_gpt_as_a_pipeline():
    run_distributed(_gpt, 2, None)


@pytest.mark.slow
def test_gpt_as_a_pipeline_dp2_zero():
    run_distributed(_gpt, 4, "os_g")


@pytest.mark.slow
def test_gpt_as_a_pipeline_dp2_stage3_a_unit_per_layer():
    run_distributed(_gpt, 4, "p_g_os", 1)
