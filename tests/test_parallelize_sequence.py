"""A plan's "sequence" style on unmodified Hugging Face models: the norms (and GPT-2's dropouts
after the row layers) run on each tp rank's block of the sequence, the row layers
reduce-scatter it, and 5 steps at every ZeRO level equal one process on the global batch;
a sequence the tp degree does not divide is refused at run time."""

import pytest
import torch
from dist_helpers import run_distributed
from test_parallelize import assert_trained_alike, batches, build, reference, train

import zerokit
from zerokit import plans
from zerokit import tensor_parallel as tp

SEQUENCE_PLANS = {"llama": plans.llama, "gpt2": plans.gpt2}


def _equivalence(rank, world_size, name, dp=1, levels=None):
    ref_losses, ref_state = reference(name)
    mesh = zerokit.init_mesh(dp=dp, tp=2)
    for level in levels or zerokit.LEVELS:
        model, opt, _ = build(name)
        plan = SEQUENCE_PLANS[name](sequence_parallel=True)
        model, opt = zerokit.parallelize(model, opt, mesh, plan=plan, level=level)
        what = f"{name} dp{dp} tp2 sequence {level}"
        norm = next(p for n, p in model.named_parameters() if "ln_1" in n or "layernorm" in n)
        assert getattr(norm, "sequence_parallel", False), f"{what}: norm not marked"
        assert_trained_alike(model, train(model, opt, mesh), ref_losses, ref_state, what)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_sequence_style_tp2_equals_one_process_at_every_level(name):
    run_distributed(_equivalence, 2, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_sequence_style_dp2_tp2_equals_one_process(name):
    run_distributed(_equivalence, 4, name, 2, ["os", "p_g_os"])


def _refusals(rank, world_size):
    mesh = zerokit.init_mesh(dp=1, tp=2)
    model, opt, _ = build("llama")
    model, opt = zerokit.parallelize(model, opt, mesh, plan=plans.llama(True), level="os_g")
    odd = batches(1, seq=7)[0]
    with pytest.raises(ValueError, match=r"sequence length \(dim 1 .*7 is not divisible by 2"):
        model(input_ids=odd, labels=odd)
    model, opt, _ = build("llama")
    with pytest.raises(ValueError, match=r"'sequence' cannot apply to model.layers.0.mlp of"):
        zerokit.parallelize(
            model, opt, mesh, plan={**plans.llama(), "model.layers.*.mlp": "sequence"}
        )
    with pytest.raises(ValueError, match=r"must lie in one nn.ModuleList of blocks"):
        zerokit.parallelize(model, opt, mesh, plan={**plans.llama(), "model.norm": "sequence"})


def test_sequence_refusals():
    run_distributed(_refusals, 2)


def _dropout(rank, world_size):
    from test_parallelize import gpt2

    from zerokit.tensor_parallel.sequence_plan import SequenceParallelDropout

    mesh = zerokit.init_mesh(dp=1, tp=2)
    cls, config, _ = gpt2()
    config.resid_pdrop = 0.5
    model = cls(config)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = zerokit.parallelize(model, opt, mesh, plan=plans.gpt2(True), level="os")
    x = batches(1)[0]
    with pytest.raises(RuntimeError, match="model_parallel_random_seed"):
        model(input_ids=x, labels=x)  # the tp-distinct stream was never seeded
    tp.model_parallel_random_seed(0, mesh)
    drop = dict(model.named_modules())["transformer.h.0.mlp.dropout"]
    assert isinstance(drop, SequenceParallelDropout)
    before = torch.get_rng_state()
    mask = drop(torch.ones(4, 64))
    assert torch.equal(torch.get_rng_state(), before)  # the replicated stream is untouched
    masks = [torch.empty_like(mask) for _ in range(world_size)]
    torch.distributed.all_gather(masks, mask)
    assert not torch.equal(masks[0], masks[1])  # each block of the sequence its own mask


def test_sequence_dropout_draws_from_the_tp_distinct_stream():
    run_distributed(_dropout, 2)
