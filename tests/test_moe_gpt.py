"""zerokit's GPT with an MoE option (``GPTConfig(n_experts=, top_k=)``) under expert
parallelism: its experts split over ep ranks by ``zerokit.moe``'s plan (the same 3-D layout
as Hugging Face's), the experts sharded over the expert-data-parallel ranks and the dense
parameters over all, trains the same steps as one process holding the whole model on the
global batch (AdamW, fp32, 2e-5 on losses and parameters)."""

import copy

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_distributed

import zerokit
from zerokit.models import GPT, GPTConfig
from zerokit.models.gpt import lm_loss
from zerokit.moe import ExpertParallelExperts, apply_expert_parallel, init_expert_groups

ATOL = 2e-5
STEPS = 3
CFG = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16, n_experts=4,
                top_k=2, expert_dim=24)  # fmt: skip


def _batches(world: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (2 * world, 7), generator=gen) for _ in range(STEPS)]


def _step(model, opt, tokens) -> torch.Tensor:
    loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _equal(rank, world, ep, levels, cfg=CFG):
    batches = _batches(world)
    groups = init_expert_groups(ep)
    for level in levels:
        what = f"GPT-MoE world {world} ep {ep} level {level}"
        torch.manual_seed(0)
        model = GPT(cfg)
        ref = copy.deepcopy(model)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
        want = [_step(ref, ref_opt, tokens).item() for tokens in batches]
        split = apply_expert_parallel(model, groups)
        assert len(split) == cfg.n_layer, f"{what}: every block's experts split"
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        model, opt, _ = zerokit.group_sharded_parallel(model, opt, level, segment_size=10)
        per = batches[0].shape[0] // world
        for step, tokens in enumerate(batches):
            loss = _step(model, opt, tokens[rank * per : (rank + 1) * per])
            dist.all_reduce(loss)
            got = loss.item() / world
            assert abs(got - want[step]) <= ATOL, f"{what}: step {step}: {got} != {want[step]}"
        _same_parameters(model, ref, what)


def _same_parameters(model, ref, what):
    """Every parameter: a rank's experts against the same experts of the reference."""
    got, want = model.state_dict(), ref.state_dict()
    assert got.keys() == want.keys(), what
    split = {n: m for n, m in model.named_modules() if isinstance(m, ExpertParallelExperts)}
    for name, value in want.items():
        owner = name.rpartition(".")[0]
        if owner in split:
            first, n = split[owner].first_expert, split[owner].num_local_experts
            value = value[first : first + n]
        torch.testing.assert_close(
            got[name], value, atol=ATOL, rtol=0, msg=lambda m, k=name: f"{what}: {k}: {m}"
        )


def test_world2_ep2():
    run_distributed(_equal, 2, 2, ("os_g", "p_g_os"))


def test_world4_ep2_and_ep4():
    run_distributed(_equal, 4, 2, ("p_g_os",))
    run_distributed(_equal, 4, 4, ("p_g_os",))


@pytest.mark.slow
def test_world4_every_level_8_experts():
    """(Not top-1: its one weight, renormalised, is exactly 1, so the router's gradient is
    analytically zero and its float noise, which Adam scales to full steps, differs with
    summation order.)"""
    cfg = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16, n_experts=8,
                    top_k=2)  # fmt: skip
    for ep in (2, 4):
        run_distributed(_equal, 4, ep, ("os", "os_g", "p_g_os"), cfg)


def test_the_plan_knows_the_gpt_experts_layout():
    """The 3-D layout Hugging Face uses: [E, 2I, H] and [E, H, I]."""
    experts = GPT(CFG).blocks[0].moe.experts
    assert tuple(experts.gate_up_proj.shape) == (4, 48, 16)
    assert tuple(experts.down_proj.shape) == (4, 16, 24)
    assert "GPTExperts" in zerokit.moe.EXPERTS_PLAN


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n_experts": 4, "top_k": 5}, "top_k must be between 1 and n_experts"),
        ({"n_experts": 4, "tensor_parallel": True}, "split the experts with zerokit.moe"),
    ],
)
def test_bad_moe_config_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**kwargs)


def test_the_value_free_path_equals_the_routed_one():
    """``zerokit plan``'s dry run (meta or fake tensors) takes the path with no
    value-dependent shape: every expert on every token, weighted; the same output."""
    torch.manual_seed(0)
    experts = GPT(CFG).blocks[0].moe.experts
    hidden = torch.randn(10, 16)
    index = torch.stack([torch.randperm(4)[:2] for _ in range(10)])  # [T, k], distinct
    weights = torch.softmax(torch.randn(10, 2), dim=-1)
    routed = experts(hidden, index, weights)
    torch.testing.assert_close(experts._every_expert(hidden, index, weights), routed)
    assert experts(hidden.to("meta"), index.to("meta"), weights.to("meta")).shape == (10, 16)


def gpt_moe():
    """A factory for ``zerokit plan --model test_moe_gpt:gpt_moe``."""
    return GPT(CFG)


def test_plan_splits_the_gpt_experts():
    from zerokit.tools.plan import PlanConfig, make_plan

    report = make_plan(PlanConfig(world=4, level="os_g", ep=2, seq=7, model="test_moe_gpt:gpt_moe"))
    assert report["moe"]["experts_per_rank"] == 2
    assert report["units"] == 1 + 2 * CFG.n_layer  # root, each block, each block's experts
