"""Optimizers on expert shards. AdamW is every other MoE test's. A whole-parameter optimizer
on split experts is refused by name before anything changes: torch's Adafactor scales each
step by the whole parameter's RMS, which over a rank's E / ep experts is not the model's
(tried: 7.3e-5 from one process after 3 steps at world 4, ep 2), and torch's Muon refuses
3-D parameters itself. Adafactor on the dense parameters beside AdamW on the experts trains
as one process does."""

import pytest
import torch
from dist_helpers import run_distributed
from moe_models import assert_same_as_reference, batches, reference_copy, tiny_moe

import zerokit
from zerokit.moe import apply_expert_parallel, init_expert_groups


def _pair(model):
    """AdamW on the experts, Adafactor on the rest."""
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    dense = [p for n, p in model.named_parameters() if ".experts." not in n]
    return [torch.optim.AdamW(experts, lr=1e-2), torch.optim.Adafactor(dense, lr=1e-2)]


def _mixed(rank, world, level):
    tokens = batches(3, 2 * world)
    model = tiny_moe("mixtral")
    ref = reference_copy(model)
    ref_opts = _pair(ref)
    for t in tokens:
        ref(input_ids=t, labels=t).loss.backward()
        for o in ref_opts:
            o.step()
            o.zero_grad()
    apply_expert_parallel(model, init_expert_groups(2))
    model, opts, _ = zerokit.group_sharded_parallel(model, _pair(model), level, segment_size=10)
    for t in tokens:
        mine = t[2 * rank : 2 * rank + 2]
        model(input_ids=mine, labels=mine).loss.backward()
        for o in opts:
            o.step()
            o.zero_grad()
    assert_same_as_reference(model, ref, 2e-5, f"AdamW + Adafactor world {world} ep 2 {level}")


@pytest.mark.slow
@pytest.mark.parametrize("level", ["os_g", "p_g_os"])
def test_adafactor_dense_adamw_experts(level):
    run_distributed(_mixed, 4, level)


def _refused(rank, world):
    model = tiny_moe("mixtral")
    apply_expert_parallel(model, init_expert_groups(2))
    opt = torch.optim.Adafactor(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="Adafactor reads each parameter whole"):
        zerokit.group_sharded_parallel(model, opt, "os_g")
    assert not hasattr(opt, "_zerokit"), "nothing is changed by a refused call"


def test_whole_parameter_optimizer_on_experts_refused():
    run_distributed(_refused, 2)
