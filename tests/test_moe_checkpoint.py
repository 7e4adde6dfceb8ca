"""Split experts saved at one ep, level and world, loaded at another: ``full_state_dict``
gathers the experts into the model's own [E, ...] parameters (what one process holds, and
what ``from_pretrained`` loads), ``load_full_state_dict`` cuts them per rank. Trained 2 SGD
steps at (world 4, ep 2, 'p_g_os'), then 2 more at ep 4 ('os_g'), at ep 1 (2 ranks, 'os'):
one process's 4 steps (SGD: no optimizer state to carry), 2e-5."""

import os

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_distributed
from moe_models import batches, tiny_moe

import zerokit
import zerokit.checkpoint
from zerokit.moe import (
    apply_expert_parallel,
    full_state_dict,
    init_expert_groups,
    load_full_state_dict,
)

ATOL = 2e-5


def _train(model, opt, tokens_list, rank, world):
    for tokens in tokens_list:
        per = tokens.shape[0] // world
        mine = tokens[rank * per : (rank + 1) * per]
        model(input_ids=mine, labels=mine).loss.backward()
        opt.step()
        opt.zero_grad()


def _wrapped(ep, level, state=None):
    """A fresh model, its experts split over ep of the world's ranks, loaded from ``state``."""
    model = tiny_moe("mixtral")
    apply_expert_parallel(model, init_expert_groups(ep))
    if state is not None:
        load_full_state_dict(model, state)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt, _ = zerokit.group_sharded_parallel(model, opt, level, segment_size=10)
    return model, opt


def _round_trip(rank, world, tmp):
    tokens = batches(4, 4)
    ref = tiny_moe("mixtral")
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    _train(ref, ref_opt, tokens, 0, 1)
    model, opt = _wrapped(2, "p_g_os")
    _train(model, opt, tokens[:2], rank, world)
    saved = full_state_dict(model)
    if rank == 0:  # what from_pretrained loads: the plain model's own state dict
        plain = tiny_moe("mixtral", seed=1)
        plain.load_state_dict(saved)
        plain.save_pretrained(tmp)
    dist.barrier()
    import transformers

    loaded = transformers.MixtralForCausalLM.from_pretrained(tmp).state_dict()
    for k, v in saved.items():
        torch.testing.assert_close(loaded[k], v, atol=0, rtol=0)
    model, opt = _wrapped(4, "os_g", saved)  # ep 2 -> ep 4
    _train(model, opt, tokens[2:], rank, world)
    _same(full_state_dict(model), ref.state_dict(), "ep 2 -> ep 4")
    new = dist.new_group([0, 1])  # ep 2 -> ep 1 at world 2: the first two ranks alone
    if rank < 2:
        model = tiny_moe("mixtral")
        model.load_state_dict(saved)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        model, opt, _ = zerokit.group_sharded_parallel(model, opt, "os", group=new)
        _train(model, opt, tokens[2:], rank, 2)
        _same(model.state_dict(), ref.state_dict(), "ep 2 -> ep 1")


def _same(got, want, what):
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(
            got[k], want[k], atol=ATOL, rtol=0, msg=lambda m, k=k: f"{what}: {k}: {m}"
        )


def test_save_ep2_load_ep4_and_ep1_and_from_pretrained(tmp_path):
    run_distributed(_round_trip, 4, str(tmp_path))


def _sharded_save_refused(rank, world, path):
    model, opt = _wrapped(2, "os_g")
    with pytest.raises(NotImplementedError, match=r"zerokit\.moe\.full_state_dict"):
        zerokit.checkpoint.save(path, model, opt)
    assert not os.path.exists(path), "nothing written"


def test_sharded_save_of_split_experts_refused(tmp_path):
    run_distributed(_sharded_save_refused, 2, str(tmp_path / "ckpt"))


def _unwrap(rank, world):
    model, opt = _wrapped(2, "p_g_os")
    _train(model, opt, batches(1, 2 * world), rank, world)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model, opt = zerokit.unwrap(model, opt)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], atol=0, rtol=0)
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape[0] == 2  # this rank's 2 of 4 experts, whole again


def test_unwrap_gives_back_this_ranks_experts():
    run_distributed(_unwrap, 2)
