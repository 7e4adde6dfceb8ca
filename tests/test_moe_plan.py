"""Expert parallelism's plan and its entry points: which experts modules the plan knows, the
refusals (an unknown MoE module, an ep not dividing the experts or dp, ep with tp), ``ep``
and ``aux_loss`` in ``Strategy`` and strategy files, and ``parallelize(strategy=Strategy(
ep=2))`` equal to one process."""

import pytest
import torch
from dist_helpers import run_distributed
from moe_models import (
    assert_same_as_reference,
    batches,
    tiny_moe,
    train_ranks,
)
from torch import nn

import zerokit
from zerokit.moe import EXPERTS_PLAN, find_experts
from zerokit.moe.plan import check_plan


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "olmoe", "deepseek_v3"])
def test_plan_knows_each_family(family):
    model = tiny_moe(family)
    found = find_experts(model)
    assert found and all(type(m).__name__ in EXPERTS_PLAN for _, m in found)
    assert len(found) == (1 if family == "deepseek_v3" else 2)  # DeepSeek's layer 0 is dense


class MyExperts(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(4, 8, 4))


def test_unknown_moe_module_refused_by_name():
    model = nn.Sequential(nn.Linear(4, 4), MyExperts())
    with pytest.raises(
        ValueError, match=r"no expert-parallel plan knows the MoE modules \['1 \(MyExperts\)'\]"
    ):
        find_experts(model)


def test_ep_must_divide_experts_and_dense_model_refused():
    with pytest.raises(ValueError, match="has 4 experts, which ep = 3 does not divide"):
        check_plan(tiny_moe("mixtral"), 3)
    with pytest.raises(ValueError, match="has no experts module the plan knows"):
        check_plan(nn.Linear(2, 2), 2)


def test_strategy_ep_fields(tmp_path):
    assert zerokit.Strategy(dp=4, ep=2).ep == 2
    with pytest.raises(ValueError, match="ep = 3 must divide dp = 4"):
        zerokit.Strategy(dp=4, ep=3)
    with pytest.raises(ValueError, match="aux_loss must be 'global' or 'per_rank'"):
        zerokit.Strategy(dp=2, ep=2, aux_loss="mean")
    path = tmp_path / "strategy.toml"
    path.write_text('dp = 4\nep = 2\naux_loss = "per_rank"\nlevel = "os_g"\n')
    loaded = zerokit.Strategy.load(str(path))
    assert (loaded.ep, loaded.aux_loss, loaded.world_size) == (2, "per_rank", 4)


def _parallelize(rank, world, level):
    tokens = batches(3, 2 * world, constant_rows=1)
    model = tiny_moe("mixtral", aux=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    strategy = zerokit.Strategy(dp=world, ep=2, level=level, segment_size=10)
    model, opt = zerokit.parallelize(model, opt, strategy=strategy)
    got = train_ranks(model, opt, tokens, rank, world, clip=0.5)
    ref2 = tiny_moe("mixtral", aux=True)  # the same initial model
    want = _reference_clipped(ref2, tokens, 0.5)
    for g, w in zip(got, want):
        assert abs(g - w) <= 2e-5, (got, want)
    assert_same_as_reference(model, ref2, 2e-5, f"parallelize ep 2 {level}")


def _reference_clipped(model, tokens_list, clip):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for tokens in tokens_list:
        out = model(input_ids=tokens, labels=tokens)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.item())
    return losses


def test_parallelize_strategy_ep2_clipped():
    """``parallelize`` with ``Strategy(ep=2)``, the aux loss on, ``clip_grad_norm_`` over
    both groups' shards (each element once): one process's clipped steps."""
    run_distributed(_parallelize, 2, "p_g_os")


@pytest.mark.slow
@pytest.mark.parametrize("level", ["os", "os_g"])
def test_parallelize_strategy_ep2_world4(level):
    run_distributed(_parallelize, 4, level)


def _ep_with_tp(rank, world):
    model = tiny_moe("mixtral")
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="not supported yet"):
        zerokit.parallelize(model, opt, strategy=zerokit.Strategy(dp=2, tp=2, ep=2, plan={}))


def test_ep_with_tp_refused():
    run_distributed(_ep_with_tp, 4)
