"""zerokit.parallelize on unmodified Hugging Face models: tensor parallelism by a plan (and
dp x tp) at every ZeRO level trains as one process does on the global batch; its checkpoint
consolidates into a file ``from_pretrained`` loads; bad plans fail alike on every rank."""

import os

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_distributed

import zerokit
from zerokit import plans
from zerokit import tensor_parallel as tp
from zerokit.cli import main as cli

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

STEPS, TOL, VOCAB = 5, 2e-5, 211  # 211: a vocabulary no tp degree divides evenly


def llama(vocab=VOCAB, heads=4, kv_heads=2):
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=32,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return transformers.LlamaForCausalLM, config, plans.llama()


def gpt2(vocab=VOCAB):
    config = transformers.GPT2Config(
        vocab_size=vocab, n_embd=16, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel, config, plans.gpt2()


MODELS = {"llama": llama, "gpt2": gpt2}


def build(name: str):
    cls, config, plan = MODELS[name]()
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


def reference(name: str, steps=STEPS):
    """One process on the global batch: losses and the final state dict."""
    model, opt, _ = build(name)
    losses = []
    for x in batches(steps):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def train(model, opt, mesh, steps=STEPS):
    """Each dp rank its slice of every global batch; the loss averaged over dp."""
    losses = []
    for x in batches(steps):
        n = x.shape[0] // mesh.dp_degree
        local = x[mesh.dp_rank * n : (mesh.dp_rank + 1) * n]
        loss = model(input_ids=local, labels=local).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=mesh.dp_group)
        losses.append(mean.item() / mesh.dp_degree)
    return losses


def _equivalence(rank, world_size, name, dp, tp_degree):
    ref_losses, ref_state = reference(name)
    mesh = zerokit.init_mesh(dp=dp, tp=tp_degree)
    for level in zerokit.LEVELS:
        model, opt, plan = build(name)
        model, opt = zerokit.parallelize(model, opt, mesh, plan=plan, level=level)
        what = f"{name} dp{dp} tp{tp_degree} {level}"
        losses = train(model, opt, mesh)
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
    run_distributed(_equivalence, 4, name, 2, 2)
