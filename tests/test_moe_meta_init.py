"""Split experts built on meta (``zerokit.empty_init``): each rank materialises only its own
experts (E / ep of each layer) and one expert's scratch, never a layer's whole expert tensor,
and gets the values one process gives the whole model: ``torch.manual_seed(s);
model.apply(model._init_weights)`` (transformers' own init), exactly; then trains as that
process does (AdamW, 3 steps, 2e-5; at world 3, 5e-5: three ranks' gradients summed in
another order drift further, DDP's own too: 1.2e-5 from one process in test_moe_yardstick's
world-3 case, 2.3e-5 seen here in a weight of an expert, after 3 steps)."""

import pytest
import torch
from dist_helpers import run_distributed
from moe_models import assert_same_as_reference, batches, tiny_moe, train_ranks, train_reference
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import zerokit
from zerokit.moe import ExpertParallelExperts, apply_expert_parallel, init_expert_groups

SEED = 7
LEVELS = ("os", "os_g", "p_g_os")


def _reference(experts, inner):
    ref = tiny_moe("mixtral", experts, inner=inner)
    torch.manual_seed(SEED)
    ref.apply(ref._init_weights)
    return ref


def _meta_split(experts, inner, ep):
    with zerokit.empty_init():
        model = tiny_moe("mixtral", experts, inner=inner)
    apply_expert_parallel(model, init_expert_groups(ep))
    return model


def _equal(rank, world, ep, levels, experts=4):
    tol = 5e-5 if world == 3 else 2e-5
    tokens = batches(3, 2 * world, constant_rows=1)
    for level in levels:
        what = f"meta init world {world} ep {ep} {level}"
        ref = _reference(experts, 24)
        model = _meta_split(experts, 24, ep)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        torch.manual_seed(SEED)  # the init's draws start here, as the reference's do
        model, opt, _ = zerokit.group_sharded_parallel(
            model, opt, level, segment_size=10, init_fn=model._init_weights
        )
        if level != "p_g_os":  # whole parameters: the very values of one process
            assert_same_as_reference(model, ref, 0.0, f"{what}, initial")
        want = train_reference(ref, tokens)
        got = train_ranks(model, opt, tokens, rank, world)
        for g, w in zip(got, want):
            assert abs(g - w) <= tol, f"{what}: {got} != {want}"
        assert_same_as_reference(model, ref, tol, what)


def test_world2_ep2_every_level():
    run_distributed(_equal, 2, 2, LEVELS)


@pytest.mark.slow
def test_world4_ep2():
    run_distributed(_equal, 4, 2, ("os_g", "p_g_os"))


@pytest.mark.slow
def test_world3_ep3():
    run_distributed(_equal, 3, 3, ("os", "p_g_os"), 6)


class _LargestTensor(TorchDispatchMode):
    """The largest storage any operation returns while it is on (bytes)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def _largest(rank, world, level):
    model = _meta_split(4, 1024, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    whole = 4 * 2048 * 16 * 4  # a layer's whole gate_up_proj, fp32: 512 KiB
    with _LargestTensor() as seen:
        zerokit.group_sharded_parallel(model, opt, level, init_fn=model._init_weights)
    split = [m for m in model.modules() if isinstance(m, ExpertParallelExperts)]
    assert split and all(m.num_local_experts == 2 for m in split)
    # the largest: the rank's experts of one layer (2 x (2048 x 16 + 16 x 1024) fp32 = 384
    # KiB) as the experts' bucket, or the 'p_g_os' walk's arena holding them and, the units
    # nesting, their decoder layer's own 3.4 KiB; one expert's scratch: 128 KiB
    assert seen.largest < whole, f"{level}: a {seen.largest} B tensor while wrapping"


@pytest.mark.parametrize("level", ["os_g", "p_g_os"])
def test_a_rank_allocates_its_experts_not_the_layer(level):
    """Experts 1024 wide, 4 per layer: no tensor made while wrapping (every operation's
    output, seen by a dispatch mode) is as large as a layer's whole ``gate_up_proj`` (512 KiB);
    the largest is a rank's experts of one layer, 3/4 of it (with the dense params of their
    layer at 'p_g_os')."""
    run_distributed(_largest, 2, level)


def test_draws_that_chunking_would_change_are_refused_by_name():
    """Experts of 21 values (not a multiple of torch's 16-value blocks): drawn one expert at a
    time they would not be the whole tensor's draw, so the init is refused, naming why; an
    op that reads the experts (not an in-place fill) is refused too. No process group."""
    from zerokit.moe.expert_init import initialize_experts

    template, mine = torch.nn.Module(), torch.nn.Module()
    template.gate_up_proj = torch.nn.Parameter(torch.empty(4, 3, 7, device="meta"))
    mine.gate_up_proj = torch.nn.Parameter(torch.zeros(2, 3, 7))
    mine.num_experts, mine.first_expert, mine.num_local_experts = 4, 2, 2
    names = ("gate_up_proj",)

    def draws(m):
        torch.nn.init.normal_(m.gate_up_proj)

    with pytest.raises(ValueError, match=r"multiple of 16 values \(here cpu, 21\)"):
        initialize_experts(mine, template, names, draws)

    def reads(m):
        torch.nn.init.zeros_(m.gate_up_proj)
        m.gate_up_proj.sum()

    with pytest.raises(ValueError, match="may only fill them in place"):
        initialize_experts(mine, template, names, reads)

    initialize_experts(mine, template, names, lambda m: torch.nn.init.ones_(m.gate_up_proj))
    assert torch.equal(mine.gate_up_proj.detach(), torch.ones(2, 3, 7))  # no draw: any size
