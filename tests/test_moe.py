"""Expert parallelism (zerokit.moe) composed with every level: a tiny Hugging Face Mixtral,
its experts split over ep ranks (all-to-all dispatch and combine), the experts sharded over
the expert-data-parallel ranks and the dense parameters over all ranks, trains the same
steps as one process holding the whole model on the global batch (AdamW, fp32, 2e-5 on
parameters and losses). World 3 runs ep 3 with 6 experts: ep 2 does not divide 3 ranks (an
ep group must hold every expert once, so ep divides the data-parallel ranks)."""

import pytest
import torch
from dist_helpers import run_distributed
from moe_models import (
    assert_same_as_reference,
    batches,
    reference_copy,
    tiny_moe,
    token_avoiding,
    train_ranks,
    train_reference,
)

import zerokit
from zerokit.moe import ExpertParallelExperts, apply_expert_parallel, init_expert_groups

ATOL = 2e-5
STEPS = 3
LEVELS = ("os", "os_g", "p_g_os")


def _equal(
    rank, world, ep, levels, experts=4, family="mixtral", constant_rows=0, aux=None, token=None
):
    """``aux``: None (the router's aux loss off), else ``apply_expert_parallel``'s mode."""
    tokens = batches(STEPS, 2 * world, constant_rows=constant_rows, token=token)
    groups = init_expert_groups(ep)
    for level in levels:
        what = f"{family} world {world} ep {ep} level {level}"
        model = tiny_moe(family, experts, aux=aux is not None)
        ref = reference_copy(model)
        want = train_reference(ref, tokens)
        apply_expert_parallel(model, groups, aux_loss=aux or "global")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        unused = _count_unused(model)
        model, opt, _ = zerokit.group_sharded_parallel(model, opt, level, segment_size=10)
        got = train_ranks(model, opt, tokens, rank, world)
        if constant_rows and rank == 0:  # the routing this test is about did happen
            assert unused, f"{what}: every expert got tokens from rank 0; nothing uneven"
        for step, (g, w) in enumerate(zip(got, want)):
            assert abs(g - w) <= ATOL, f"{what}: step {step}: loss {g} != {w}"
        assert_same_as_reference(model, ref, ATOL, what)


def _count_unused(model) -> list:
    """(layer, expert) pairs this rank sends no token to, seen by a hook on every split
    experts module."""
    unused = []

    def hook(module, args):
        counts = torch.bincount(args[1].reshape(-1), minlength=module.num_experts)
        unused.extend((id(module), e) for e in range(module.num_experts) if counts[e] == 0)

    for m in model.modules():
        if isinstance(m, ExpertParallelExperts):
            m.register_forward_pre_hook(hook)
    return unused


def test_world2_ep2_every_level():
    run_distributed(_equal, 2, 2, LEVELS)


@pytest.mark.slow  # the fast subset has the harder case: a rank receiving no tokens at all
def test_world2_uneven_routing():
    """Rank 0's rows repeat one token: in the first layer its tokens all choose the same two
    experts, so some expert (and ep rank) receives none of them."""
    run_distributed(_equal, 2, 2, LEVELS, 4, "mixtral", 2)


@pytest.mark.slow
def test_world4_ep2_every_level():
    run_distributed(_equal, 4, 2, LEVELS)


@pytest.mark.slow
def test_world4_ep4_every_level():
    run_distributed(_equal, 4, 4, LEVELS)


@pytest.mark.slow
def test_world3_ep3():
    run_distributed(_equal, 3, 3, LEVELS, 6)


def test_world2_a_rank_receiving_no_tokens():
    """Every token of both ranks is one token that the first layer routes to experts 2 and 3
    only (at the first step): ep rank 0 receives no rows at all there, and its experts' units
    still reduce (zero gradients), as one process leaves those experts untouched."""
    run_distributed(_equal, 2, 2, LEVELS, 4, "mixtral", 0, None, token_avoiding({0, 1}))


def test_world2_aux_loss_global():
    """``output_router_logits=True``: the load-balancing loss from the whole batch's routing
    statistics, as one process computes it (the per-rank form, DDP's, is not: see
    GUIDE.md)."""
    run_distributed(_equal, 2, 2, ("os_g",), 4, "mixtral", 0, "global")


@pytest.mark.slow
def test_world4_aux_loss_global_every_level():
    run_distributed(_equal, 4, 2, LEVELS, 4, "mixtral", 2, "global")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe", "deepseek_v3"])
def test_families_world2_ep2(family):
    """The other plans: Qwen3-MoE and OLMoE with their aux loss on, DeepSeek-V3 (a dense
    first layer, a shared expert beside the routed ones, grouped sigmoid routing)."""
    aux = None if family == "deepseek_v3" else "global"
    run_distributed(_equal, 2, 2, LEVELS, 4, family, 0, aux)


def _frozen_experts(rank, world, levels):
    """Experts frozen (an adapter trains the rest): no unit holds them, yet each rank starts
    from its expert group's rank 0's experts, not world rank 0's (which hold other experts);
    a rank not first in its expert group starts apart, dense weights and experts."""
    tokens = batches(STEPS, 2 * world)
    for level in levels:
        model = tiny_moe("mixtral")
        ref = reference_copy(model)
        for name, p in ref.named_parameters():
            p.requires_grad_(".experts." not in name)
        want = train_reference(ref, tokens)
        groups = init_expert_groups(2)
        apply_expert_parallel(model, groups)
        for m in model.modules():
            if isinstance(m, ExpertParallelExperts):
                m.requires_grad_(False)
        if groups.expert_dp_group.rank() != 0:  # it must start from others': dense and experts
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.5)
        trainable = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.1)
        model, opt, _ = zerokit.group_sharded_parallel(model, opt, level, segment_size=10)
        got = train_ranks(model, opt, tokens, rank, world)
        what = f"frozen experts, world {world} ep 2 level {level}"
        for step, (g, w) in enumerate(zip(got, want)):
            assert abs(g - w) <= ATOL, f"{what}: step {step}: loss {g} != {w}"
        assert_same_as_reference(model, ref, ATOL, what)


def test_world2_frozen_experts():
    run_distributed(_frozen_experts, 2, ("os_g", "p_g_os"))


@pytest.mark.slow  # each expert on two ranks: its own group's broadcast is not a no-op here
def test_world4_frozen_experts():
    run_distributed(_frozen_experts, 4, ("p_g_os",))


def _knobs(rank, world, level, knobs, tol):
    """``knobs`` (mixed precision, step_in_backward) with split experts: the losses and
    parameters of one fp32 process on the global batch, within ``tol``."""
    tokens = batches(STEPS, 2 * world, constant_rows=1)
    groups = init_expert_groups(2)
    model = tiny_moe("mixtral")
    ref = reference_copy(model)
    want = train_reference(ref, tokens)
    apply_expert_parallel(model, groups)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model, opt, _ = zerokit.group_sharded_parallel(model, opt, level, segment_size=10, **knobs)
    got = train_ranks(model, opt, tokens, rank, world)
    what = f"world {world} ep 2 level {level} {sorted(knobs)}"
    for step, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= tol * abs(w), f"{what}: step {step}: loss {g} != {w}"
    if tol < 1e-4:
        assert_same_as_reference(model, ref, ATOL, what)


def test_world2_step_in_backward():
    run_distributed(_knobs, 2, "os_g", {"step_in_backward": True}, 1e-6)


@pytest.mark.slow
def test_world2_bf16_step_in_backward():
    """bf16 compute, fp32 masters: tracks the fp32 process within bf16's 3e-2 relative."""
    bf16 = zerokit.MixedPrecision(param_dtype=torch.bfloat16)
    knobs = {"mixed_precision": bf16, "step_in_backward": True}
    run_distributed(_knobs, 2, "p_g_os", knobs, 3e-2)
