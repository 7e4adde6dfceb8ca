"""zerokit.parallelize on unmodified Hugging Face models: tensor parallelism by a plan (and
dp x tp) at every ZeRO level trains as one process does on the global batch; its checkpoint
consolidates into a file ``from_pretrained`` loads; bad plans fail alike on every rank."""

import json
import os

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_distributed

import zerokit
from zerokit import plans
from zerokit import tensor_parallel as tp
from zerokit.tools.cli import main as cli

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

STEPS, TOL, VOCAB = 5, 2e-5, 211  # 211: a vocabulary no tp degree divides evenly


def llama(vocab=VOCAB, heads=4, kv_heads=2, intermediate=24):
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=16, intermediate_size=intermediate, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=32,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return transformers.LlamaForCausalLM, config, plans.llama()


def gpt2(vocab=VOCAB):
    config = transformers.GPT2Config(
        vocab_size=vocab, n_embd=16, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=1,
        attn_implementation="eager",  # a pipeline stage attends through the mask it makes
    )  # fmt: skip
    return transformers.GPT2LMHeadModel, config, plans.gpt2()


MODELS = {"llama": llama, "gpt2": gpt2}


def build(name: str, vocab: int = VOCAB):
    cls, config, plan = MODELS[name](vocab)
    torch.manual_seed(0)
    model = cls(config)
    # eps 1e-6, not 1e-8: GPT-2's key bias has a gradient of exactly zero in exact arithmetic
    # (it adds the same q.b_k to every score of a row), so its rounding noise, ~1e-10 and
    # different with any other reduction order, would be what Adam normalises into a step.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6, weight_decay=0.1)
    return model, opt, plan


def batches(n=STEPS, batch=4, seq=8):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (batch, seq), generator=g) for _ in range(n)]


def reference(name: str, steps=STEPS, vocab=VOCAB):
    """One process on the global batch: losses and the final state dict."""
    model, opt, _ = build(name, vocab)
    losses = []
    for x in batches(steps):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def train(model, opt, mesh, steps=STEPS):
    """Each data rank (dp x shard) its slice of every global batch; the loss averaged over
    every rank (tp ranks hold the same loss)."""
    data_ranks = mesh.dp_degree * mesh.sharding_degree
    me = mesh.dp_rank * mesh.sharding_degree + mesh.sharding_rank
    losses = []
    for x in batches(steps):
        n = x.shape[0] // data_ranks
        local = x[me * n : (me + 1) * n]
        loss = model(input_ids=local, labels=local).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    return losses


def _equivalence(
    rank, world_size, name, dp, tp_degree, device_mesh=False, shard=1, levels=None, vocab=VOCAB
):
    ref_losses, ref_state = reference(name, vocab=vocab)
    if shard > 1:  # hybrid sharding: ZeRO over "shard", replicas over "dp"
        mesh = zerokit.init_mesh(dp=dp, tp=tp_degree, shard=shard)
    elif device_mesh:  # torch's DeviceMesh, tp the last (fastest) dim, is taken as the mesh
        from torch.distributed.device_mesh import init_device_mesh

        torch_mesh = init_device_mesh("cpu", (dp, tp_degree), mesh_dim_names=("dp", "tp"))
        mesh = zerokit.layout.as_layout(torch_mesh)
    else:
        mesh = zerokit.init_mesh(dp=dp, tp=tp_degree)
    for level in levels or zerokit.LEVELS:
        model, opt, plan = build(name, vocab)
        given = torch_mesh if device_mesh else mesh
        plan = plan if tp_degree > 1 else None
        model, opt = zerokit.parallelize(model, opt, given, plan=plan, level=level)
        what = f"{name} dp{dp} tp{tp_degree} {level}"
        assert_trained_alike(model, train(model, opt, mesh), ref_losses, ref_state, what)


def assert_trained_alike(model, losses, ref_losses, ref_state, what):
    """Each step's loss and the full parameters, by the model's own names and shapes, equal to
    one process's (TOL)."""
    for step, (got, want) in enumerate(zip(losses, ref_losses)):
        assert abs(got - want) <= TOL, f"{what}: step {step}: loss {got} != {want}"
    full = tp.gather_full_state_dict(model)
    assert set(full) == set(ref_state), what
    for key, want in ref_state.items():
        assert full[key].shape == want.shape, f"{what}: {key}"
        torch.testing.assert_close(full[key], want, atol=TOL, rtol=0, msg=f"{what}: {key}")


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_tp2_by_plan_equals_one_process_at_every_level(name):
    run_distributed(_equivalence, 2, name, 1, 2)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_dp2_tp2_by_plan_equals_one_process_at_every_level(name):
    run_distributed(_equivalence, 4, name, 2, 2, name == "gpt2")


@pytest.mark.slow
def test_gpt2_vocabulary_50257_splits_unevenly():
    run_distributed(_equivalence, 2, "gpt2", 1, 2, False, 1, ["p_g_os"], 50257)


@pytest.mark.slow
def test_hybrid_sharding_is_a_mesh_dim():
    run_distributed(_equivalence, 4, "gpt2", 2, 1, False, 2)


# -- the checkpoint of a parallelized model is the Hugging Face model's ------------------------
def _save(rank, world_size, name, path):
    mesh = zerokit.init_mesh(dp=1, tp=2)
    model, opt, plan = build(name)
    model, opt = zerokit.parallelize(model, opt, mesh, plan=plan, level="p_g_os")
    train(model, opt, mesh, steps=2)
    zerokit.checkpoint.save(path, model, opt)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_checkpoint_consolidates_into_what_from_pretrained_loads(name, tmp_path):
    saved, hf = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    run_distributed(_save, 2, name, saved)
    with open(os.path.join(saved, "index.json")) as f:  # the mesh is recorded
        layout = json.load(f)["layout"]
    assert (layout["world_size"], layout["dp_degree"], layout["tp_degree"]) == (2, 1, 2)
    os.makedirs(hf)
    assert cli(["ckpt", "consolidate", saved, os.path.join(hf, "model.safetensors")]) == 0
    cls, config, _ = MODELS[name]()
    config.save_pretrained(hf)
    loaded = cls.from_pretrained(hf)
    _, want = reference(name, steps=2)
    got = loaded.state_dict()
    assert set(got) == set(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, atol=TOL, rtol=0, msg=key)


# -- bad inputs: the same ValueError on every rank, before any collective ----------------------
def _refusals(rank, world_size):
    cases = [
        ({"plan": {"model.layers.*.self_attn.q_prj": "colwise"}}, "q_proj"),
        ({"plan": {"model.layers.*.self_attn": "colwise"}}, "LlamaAttention"),
        ({"plan": {"lm_head": "diagonal"}}, "unknown style 'diagonal'"),
        ({"plan": {"lm_head": "sequence"}}, "sequence.*lm_head of type Linear"),
        ({"plan": {"model.norm": "vocab"}}, "LlamaRMSNorm"),
        ({"plan": None}, "needs a plan"),
        ({"plan": "lama"}, "no built-in plan 'lama'"),
    ]
    mesh = zerokit.init_mesh(dp=1, tp=2)
    for kwargs, needle in cases:
        model, opt, _ = build("llama")
        with pytest.raises(ValueError, match=needle):
            zerokit.parallelize(model, opt, mesh, **kwargs)
    cls, config, plan = llama(kv_heads=1)
    with pytest.raises(
        ValueError, match=r"k_proj: 1 heads \(4 features / head_dim 4\).*tp degree 2"
    ):
        zerokit.parallelize(cls(config), torch.optim.SGD(cls(config).parameters()), mesh, plan=plan)
    cls, config, plan = llama(intermediate=25)
    with pytest.raises(ValueError, match=r"gate_proj: 25 output features .* tp degree 2"):
        zerokit.parallelize(cls(config), torch.optim.SGD(cls(config).parameters()), mesh, plan=plan)
    model, opt, plan = build("llama")
    with pytest.raises(ValueError, match=r"dp \* tp \* pp = 3 \* 1 \* 1 = 3.*world size is 2"):
        zerokit.parallelize(model, opt, strategy=zerokit.Strategy(dp=3))
    with pytest.raises(ValueError, match=r"split_points: 'model.layer.1'.*model.layers.1"):
        strategy = zerokit.Strategy(pp=2, plan=None)
        zerokit.parallelize(model, opt, split_points=["model.layer.1"], strategy=strategy)
    model, opt, plan = build("gpt2")
    plan = {**plan, "lm_head": "replicate"}
    with pytest.raises(ValueError, match="tied weights must be split alike"):
        zerokit.parallelize(model, opt, mesh, plan=plan)
    dist.barrier()  # every rank got here: none was left waiting in a collective


def test_bad_plans_and_degrees_fail_alike_on_every_rank():
    run_distributed(_refusals, 2)


# -- the strategy file and the data sampler ----------------------------------------------------
def test_strategy_loads_from_toml_json_and_yaml(tmp_path):
    want = zerokit.Strategy(dp=2, tp=2, level="os_g", plan="llama", micro_batches=4)
    (tmp_path / "s.toml").write_text(
        'dp = 2\ntp = 2\nlevel = "os_g"\nplan = "llama"\nmicro_batches = 4\n'
    )
    (tmp_path / "s.json").write_text(
        '{"dp": 2, "tp": 2, "level": "os_g", "plan": "llama", "micro_batches": 4}'
    )
    (tmp_path / "s.yaml").write_text("dp: 2\ntp: 2\nlevel: os_g\nplan: llama\nmicro_batches: 4\n")
    for ext in ("toml", "json", "yaml"):
        assert zerokit.Strategy.load(str(tmp_path / f"s.{ext}")) == want, ext
    (tmp_path / "p.toml").write_text('tp = 2\n[plan]\n"model.layers.*.mlp.up_proj" = "colwise"\n')
    assert zerokit.Strategy.load(str(tmp_path / "p.toml")).plan == {
        "model.layers.*.mlp.up_proj": "colwise"
    }
    (tmp_path / "bad.toml").write_text("dp = 2\ntensor = 2\n")
    with pytest.raises(ValueError, match=r"unknown strategy keys \['tensor'\]"):
        zerokit.Strategy.load(str(tmp_path / "bad.toml"))
    with pytest.raises(ValueError, match="level must be one of"):
        zerokit.Strategy(level="zero3")
    with pytest.raises(TypeError):
        zerokit.Strategy(2, 2)  # keyword-only


def test_sampler_splits_over_dp_only():
    data = list(range(10))
    seen = {}
    for dp_rank in range(2):
        for tp_rank in range(2):
            layout = zerokit.Layout(2, 2, dp_rank, tp_rank, None, None)
            seen[dp_rank, tp_rank] = list(zerokit.data.sampler(data, layout, seed=3))
    assert seen[0, 0] == seen[0, 1] and seen[1, 0] == seen[1, 1]  # tp ranks: the same batches
    assert sorted(seen[0, 0] + seen[1, 0]) == data  # dp ranks: each index once


def test_sampler_under_zerokit_launch_reads_the_strategy(tmp_path, monkeypatch):
    """``zerokit launch --strategy`` (dp 2 x tp 2): ``sampler(data)`` with no mesh gives each
    rank what the strategy's mesh gives it; outside a launch it says what to pass."""
    data = list(range(10))
    (tmp_path / "s.toml").write_text("dp = 2\ntp = 2\n")
    monkeypatch.setenv("ZEROKIT_STRATEGY", str(tmp_path / "s.toml"))
    monkeypatch.setenv("WORLD_SIZE", "4")
    for rank in range(4):
        monkeypatch.setenv("RANK", str(rank))
        layout = zerokit.Layout(2, 2, rank // 2, rank % 2, None, None)  # init_mesh's order
        want = list(zerokit.data.sampler(data, layout, seed=3))
        assert list(zerokit.data.sampler(data, seed=3)) == want, rank
    monkeypatch.delenv("ZEROKIT_STRATEGY")
    with pytest.raises(TypeError, match=r"ZEROKIT_STRATEGY.*init_hybrid_parallel"):
        zerokit.data.sampler(data)


LAUNCHED = """
import os
import torch, torch.distributed as dist, zerokit
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
ref = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
ref.load_state_dict(model.state_dict())
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
model, opt = zerokit.parallelize(model, opt)  # the strategy comes from $ZEROKIT_STRATEGY
for step in range(3):
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
    for m, o in ((model, opt), (ref, ref_opt)):
        m(x).square().mean().backward()
        o.step()
        o.zero_grad()
with torch.no_grad():
    x = torch.randn(5, 6)
    assert torch.allclose(model(x), ref(x), atol=1e-6), "launched run differs from one process"
line = f"rank {dist.get_rank()} tp {zerokit.Strategy.from_env().tp} ok\\n"
os.write(1, line.encode())  # one write: the ranks share the pipe, print's pieces interleave
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_launch_hands_the_strategy_to_every_rank(tmp_path):
    script, strategy = tmp_path / "train.py", tmp_path / "strategy.toml"
    script.write_text(LAUNCHED)
    strategy.write_text('tp = 2\nlevel = "os_g"\n[plan]\n"0" = "colwise"\n"2" = "rowwise"\n')
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "zerokit", "launch", "--strategy", str(strategy), str(script)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 0 tp 2 ok" in done.stdout and "rank 1 tp 2 ok" in done.stdout, done.stdout
    bad = subprocess.run([*cmd[:-1], "--nproc", "3", str(script)], capture_output=True, text=True)
    assert bad.returncode == 2 and "world size is 3" in bad.stderr, bad.stderr


def _by_strategy(rank, world_size):
    ref_losses, ref_state = reference("llama")
    model, opt, _ = build("llama")
    strategy = zerokit.Strategy(tp=2, level="os_g", plan="llama", recompute=True)
    model, opt = zerokit.parallelize(model, opt, strategy=strategy)  # it builds the mesh
    mesh = next(m.layout for m in model.modules() if isinstance(m, tp.TensorParallelLayer))
    assert model.model.layers[0].gradient_checkpointing  # recompute=True reached the model
    model.train()  # Hugging Face recomputes only in training mode
    losses = train(model, opt, mesh)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TOL, (losses, ref_losses)
    full = tp.gather_full_state_dict(model)
    for key, want in ref_state.items():
        torch.testing.assert_close(full[key], want, atol=TOL, rtol=0, msg=key)


def test_a_strategy_builds_the_mesh_and_recomputes_as_one_process():
    run_distributed(_by_strategy, 2)


# -- pipeline stages by split points, with and without tp --------------------------------------
SPLIT = {"llama": ["model.layers.1"], "gpt2": ["transformer.h.1"]}


def _pipelined(rank, world_size, name, tp_degree, levels):
    ref_losses, ref_state = reference(name)
    for level in levels:
        model, opt, plan = build(name)
        strategy = zerokit.Strategy(pp=2, tp=tp_degree, level=level, plan=plan, micro_batches=2)
        pipe, opt = zerokit.parallelize(model, opt, split_points=SPLIT[name], strategy=strategy)
        what = f"{name} pp2 tp{tp_degree} {level}"
        # the loss exists on the last stage; train_batch returns it (broadcast) on every rank
        losses = [pipe.train_batch((x, x), opt).item() for x in batches()]
        for step, (got, want) in enumerate(zip(losses, ref_losses)):
            assert abs(got - want) <= TOL, f"{what}: step {step}: loss {got} != {want}"
        full = tp.gather_full_state_dict(pipe.stage)  # this stage's tensors, whole
        assert full, what
        for key, value in full.items():
            torch.testing.assert_close(
                value, ref_state[key], atol=TOL, rtol=0, msg=f"{what}: {key}"
            )


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_pp2_by_split_points_equals_one_process(name):
    run_distributed(_pipelined, 2, name, 1, ["os_g"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_pp2_tp2_every_level_equals_one_process(name):
    run_distributed(_pipelined, 4, name, 2, list(zerokit.LEVELS))


def _parallel_loss(rank, world_size, name):
    """The plan's parallel loss: the head keeps each tp rank's vocabulary part of the logits
    (uneven: 211 = 106 + 105) and ``ParallelCrossEntropy`` takes the loss from the parts; the
    same training as one process with the model's own loss on whole logits."""
    ref_losses, ref_state = reference(name)
    mesh = zerokit.init_mesh(dp=1, tp=2)
    loss_fn = tp.ParallelCrossEntropy(layout=mesh)
    for level in zerokit.LEVELS:
        model, opt, _ = build(name)
        plan = {"llama": plans.llama, "gpt2": plans.gpt2}[name](parallel_loss=True)
        model, opt = zerokit.parallelize(model, opt, mesh, plan=plan, level=level)
        losses = []
        for step, x in enumerate(batches()):
            logits = model(input_ids=x).logits
            if step == 0:
                parts = [0, 0]
                dist.all_gather_object(parts, logits.shape[-1])
                assert sorted(parts) == [105, 106], parts  # each rank its part of the 211
            loss = loss_fn(logits[:, :-1], x[:, 1:])  # next-token targets, as HF shifts them
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert_trained_alike(model, losses, ref_losses, ref_state, f"{name} parallel loss {level}")


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_a_parallel_loss_keeps_the_logits_split(name):
    run_distributed(_parallel_loss, 2, name)
