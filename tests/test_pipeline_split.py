"""Unmodified Hugging Face models split into pipeline stages by name (``split_model``): Llama
(embedding tied to the head and not) and GPT-2 (tied) at pp=2 train as the whole model in one
process (``model(ids, labels=ids).loss``, the optimizer over all of it, the global clip) for 5
steps, loss and parameters within 2e-5 (fp32): without ZeRO and at every level over a
data-parallel group of one (2 ranks), and dp 2 x pp 2 at every level (4 ranks, slow); pp=3
with a middle stage holding no tied copy; a rank keeps only its stage's parameters, under the
model's own names, and frees the rest; the checkpoint consolidates into what ``from_pretrained``
loads; Llama tied at pp 2 x tp 2 through ``zerokit.parallelize`` at every level (slow). Bad
split points are refused on every rank, before any collective."""

import gc
import weakref

import pytest
import torch
from dist_helpers import run_distributed
from torch import nn

import zerokit
from zerokit.pipeline.split import Dropped, split_model, stage_bounds
from zerokit.plans.stages import ADAPTERS, LlamaStages, adapter_for

transformers = pytest.importorskip("transformers")

ATOL = 2e-5
STEPS = 5
VOCAB, SEQ = 37, 8
LR, CLIP = 0.1, 0.5


def build(family: str, tied: bool = True, layers: int = 4) -> nn.Module:
    torch.manual_seed(0)
    if family == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
            tie_word_embeddings=tied,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(cfg)
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=layers, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        attn_implementation="eager",  # attends through the causal mask the stages make
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


def batches(batch: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (batch, SEQ), generator=gen) for _ in range(STEPS)]


def reference(family: str, tied: bool, layers: int, data) -> tuple[list[float], dict]:
    """One process, the whole model, the global batch: HF's own forward and loss."""
    model = build(family, tied, layers)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for ids in data:
        loss = model(ids, labels=ids).loss
        loss.backward()
        assert torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP) > CLIP  # clip bites
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_split(family, tied, layers, points, layout, level, data, schedule, m):
    model = build(family, tied, layers)
    pipe = split_model(model, points, layout, schedule=schedule, micro_batches=m)
    opt = torch.optim.SGD(pipe.stage.parameters(), lr=LR, momentum=0.9)
    if level is not None:
        _, opt, _ = zerokit.group_sharded_parallel(pipe, opt, level, group=layout.dp_group)
    dp = layout.dp_degree if layout is not None else 1
    rank = layout.dp_rank if layout is not None else 0
    mine = slice(rank * len(data[0]) // dp, (rank + 1) * len(data[0]) // dp)
    losses = [pipe.train_batch((ids[mine], ids[mine]), opt, clip_norm=CLIP).item() for ids in data]
    return pipe, opt, losses


def check(pipe, losses, ref_losses, ref_state, what):
    for step, (got, want) in enumerate(zip(losses, ref_losses)):
        assert abs(got - want) <= ATOL, f"{what}: step {step}: loss {got} != {want}"
    state = pipe.stage.state_dict()  # full tensors, also from a wrapped stage
    assert state, what
    for name, value in state.items():
        torch.testing.assert_close(value, ref_state[name], atol=ATOL, rtol=0, msg=f"{what}: {name}")


def _equivalence(rank, world_size, family, tied, layers, points, dp, levels, schedule, m):
    pp = world_size // dp
    layout = zerokit.init_hybrid_parallel(dp, 1, pp_degree=pp)
    data = batches(4 * dp)
    ref_losses, ref_state = reference(family, tied, layers, data)
    for level in levels:
        what = f"{family} tied={tied} pp{pp} dp{dp} level={level} {schedule} m={m}"
        pipe, _, losses = train_split(
            family, tied, layers, points, layout, level, data, schedule, m
        )
        check(pipe, losses, ref_losses, ref_state, what)
        # this rank holds its stage's blocks only, under the model's names
        blocks = pipe.stage.get_submodule(pipe.stage.adapter.blocks)
        start, end = pipe.bounds[layout.pp_rank], pipe.bounds[layout.pp_rank + 1]
        kept = [i for i, b in enumerate(blocks) if not isinstance(b, Dropped)]
        assert kept == list(range(start, end)), (what, kept)
        names = set(pipe.stage.state_dict())
        embed = "model.embed_tokens.weight" if family == "llama" else "transformer.wte.weight"
        assert (embed in names) == (layout.pp_rank == 0), (what, sorted(names))
        assert ("lm_head.weight" in names) == (layout.pp_rank == pp - 1), (what, sorted(names))


def test_llama_pp2_untied_every_level():
    levels = [None, *zerokit.LEVELS]  # ZeRO over a data-parallel group of one
    run_distributed(_equivalence, 2, "llama", False, 4, ["model.layers.2"], 1, levels, "1f1b", 2)


def test_llama_pp2_tied_every_level():
    levels = [None, *zerokit.LEVELS]
    run_distributed(_equivalence, 2, "llama", True, 3, ["model.layers.1"], 1, levels, "fthenb", 2)


def test_gpt2_pp2_every_level():
    levels = [None, *zerokit.LEVELS]
    run_distributed(_equivalence, 2, "gpt2", True, 4, ["transformer.h.3"], 1, levels, "1f1b", 4)


def test_gpt2_pp3_middle_stage():
    points = ["transformer.h.1", "transformer.h.3"]
    run_distributed(_equivalence, 3, "gpt2", True, 4, points, 1, [None, "p_g_os"], "1f1b", 2)


@pytest.mark.slow
def test_llama_dp2_pp2_every_level():
    points = ["model.layers.2"]
    run_distributed(_equivalence, 4, "llama", True, 4, points, 2, zerokit.LEVELS, "1f1b", 2)


@pytest.mark.slow
def test_gpt2_dp2_pp2_every_level():
    points = ["transformer.h.2"]
    run_distributed(_equivalence, 4, "gpt2", True, 4, points, 2, zerokit.LEVELS, "fthenb", 2)


# -- refusals ----------------------------------------------------------------------------------
def test_bad_split_points():
    model = build("llama", layers=4)
    adapter = adapter_for(model)
    assert stage_bounds(model, adapter, ["model.layers.1", "model.layers.3"], 3) == [0, 1, 3, 4]
    with pytest.raises(ValueError, match=r"2 split point\(s\) make 3 stage.*pp=2.*1 name"):
        stage_bounds(model, adapter, ["model.layers.1", "model.layers.3"], 2)
    with pytest.raises(ValueError, match=r"'model.layer.2'.*no module.*closest: model.layers.2"):
        stage_bounds(model, adapter, ["model.layer.2"], 2)
    with pytest.raises(ValueError, match=r"'model.norm' is not a block of model.layers"):
        stage_bounds(model, adapter, ["model.norm"], 2)
    with pytest.raises(ValueError, match="increasing order"):
        stage_bounds(model, adapter, ["model.layers.3", "model.layers.1"], 3)
    with pytest.raises(ValueError, match="increasing order"):
        stage_bounds(model, adapter, ["model.layers.2", "model.layers.2"], 3)
    with pytest.raises(ValueError, match=r"1 split point\(s\) make 2.*pp=1"):
        split_model(model, ["model.layers.2"])  # one process: one stage
    with pytest.raises(ValueError, match=r"no pipeline stage adapter for Sequential.*"
                       r"GPT2LMHeadModel, LlamaForCausalLM.*ADAPTERS"):  # fmt: skip
        split_model(nn.Sequential(nn.Linear(2, 2)), [])
    assert set(ADAPTERS) == {"LlamaForCausalLM", "GPT2LMHeadModel"}

    class Forgetful(LlamaStages):  # leaves the final norm to every stage
        last = ("lm_head",)

    with pytest.raises(ValueError, match=r"Forgetful places no parameter 'model.norm.weight'"):
        split_model(build("llama", layers=2), [], adapter=Forgetful)


def _refused_everywhere(rank, world_size):
    """Every rank raises, before any collective (a collective would hang the other rank)."""
    layout = zerokit.init_hybrid_parallel(1, 1, pp_degree=2)
    for points, message in [
        (["model.layers.9"], "no module.*closest: model.layers.1, model.layers.0"),
        ([], r"0 split point\(s\) make 1 stage.*pp=2"),
    ]:
        with pytest.raises(ValueError, match=message):
            split_model(build("llama", layers=2), points, layout)
    # no layout: the world's ranks are the stages; eval_batch is the model's loss (eval mode)
    ids = batches(4)[0]
    with torch.no_grad():
        want = build("gpt2", layers=2).eval()(ids, labels=ids).loss.item()
    model = build("gpt2", layers=2)
    other = weakref.ref(model.get_parameter(f"transformer.h.{1 - rank}.mlp.c_fc.weight"))
    pipe = split_model(model, ["transformer.h.1"], micro_batches=2)
    assert (pipe.num_stages, pipe.stage_id) == (2, rank)
    gc.collect()
    assert other() is None, "the other stage's block is still held: its memory is not freed"
    got = pipe.eval_batch((ids, ids)).item()
    assert abs(got - want) <= ATOL, (got, want)


def test_every_rank_refuses_bad_split_points_and_the_world_as_stages():
    run_distributed(_refused_everywhere, 2)


# -- checkpoints -------------------------------------------------------------------------------
def _checkpoint(rank, world_size, family, tied, tmp):
    """Saved from a split model (its stage wrapped at 'p_g_os'), consolidated into one file of
    the model's own names and shapes, which ``from_pretrained`` loads as trained; loaded back
    into a fresh split model, each stage holds what was saved."""
    import os

    import torch.distributed as dist

    layout = zerokit.init_hybrid_parallel(1, 1, pp_degree=2)
    data = batches(4)[:2]
    points = ["model.layers.2"] if family == "llama" else ["transformer.h.2"]
    pipe, opt, _ = train_split(family, tied, 4, points, layout, "p_g_os", data, "1f1b", 2)
    path, hf_dir = os.path.join(tmp, "ckpt"), os.path.join(tmp, "hf")
    zerokit.checkpoint.save(path, pipe, opt)
    if rank == 0:
        zerokit.checkpoint.consolidate(path, os.path.join(tmp, "model.safetensors"))
        os.makedirs(hf_dir)
        os.rename(os.path.join(tmp, "model.safetensors"), os.path.join(hf_dir, "model.safetensors"))
        build(family, tied).config.save_pretrained(hf_dir)
        _, want = reference(family, tied, 4, data)
        cls = type(build(family, tied, 1))
        got = cls.from_pretrained(hf_dir).state_dict()
        assert set(got) == set(want), set(got) ^ set(want)
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, atol=ATOL, rtol=0, msg=name)
    dist.barrier()
    fresh = split_model(build(family, tied), points, layout)
    zerokit.checkpoint.load(path, fresh)
    saved = pipe.stage.state_dict()
    for name, value in fresh.stage.state_dict().items():
        torch.testing.assert_close(value, saved[name], atol=0, rtol=0, msg=f"loaded {name}")


@pytest.mark.parametrize("family,tied", [("gpt2", True), ("llama", False)])
def test_checkpoint_consolidates_to_hugging_face_names(family, tied, tmp_path):
    run_distributed(_checkpoint, 2, family, tied, str(tmp_path))


# -- through zerokit.parallelize: pp 2 x tp 2 --------------------------------------------------
def _pp2_tp2(rank, world_size, levels):
    """Llama with its embedding tied to the head, both split by vocabulary over tp and the two
    copies on different stages: the copies' gradients summed across stages per tp slice, the
    global clip counting the tied weight once and each tp slice once."""
    from zerokit import plans
    from zerokit import tensor_parallel as tp

    data = batches(4)
    ref_losses, ref_state = reference("llama", True, 4, data)
    mesh = zerokit.init_mesh(dp=1, tp=2, pp=2)
    for level in levels:
        model = build("llama", True, 4)
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        pipe, opt = zerokit.parallelize(
            model, opt, mesh, plans.llama(), level, ["model.layers.2"], "1f1b", 2
        )
        losses = [pipe.train_batch((ids, ids), opt, clip_norm=CLIP).item() for ids in data]
        what = f"parallelize llama tied pp2 tp2 level={level}"
        for step, (got, want) in enumerate(zip(losses, ref_losses)):
            assert abs(got - want) <= ATOL, f"{what}: step {step}: loss {got} != {want}"
        full = tp.gather_full_state_dict(pipe.stage)  # this stage's tensors, whole
        assert full, what
        for name, value in full.items():
            torch.testing.assert_close(value, ref_state[name], atol=ATOL, rtol=0, msg=name)


@pytest.mark.slow
def test_parallelize_pp2_tp2_tied_llama_every_level():
    run_distributed(_pp2_tp2, 4, zerokit.LEVELS)
