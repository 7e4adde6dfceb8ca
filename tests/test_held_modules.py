"""A module the user still holds that zerokit sharded in place (a submodule of the wrapped
model: ``model.blocks[0]``, a backbone) at 'p_g_os': its own ``state_dict()`` gathers what one
process holds, as the model's does, never stage 3's empty parameters. (The LightningModule's
own ``state_dict()``: tests/test_lightning.py.)"""

import copy

import torch
from dist_helpers import run_distributed
from models import VOCAB, global_batches, train_reference, train_sharded

import zerokit
from zerokit.core.state import state_of
from zerokit.models.gpt import GPT, GPTConfig

ATOL = 2e-5
CFG = GPTConfig(vocab_size=VOCAB, block_size=8, n_layer=3, n_head=2, n_embd=8)


def _pair(mixed_precision):
    torch.manual_seed(0)
    ref = GPT(CFG)
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    model, opt, _ = zerokit.group_sharded_parallel(
        model, opt, "p_g_os", mixed_precision=mixed_precision
    )
    return ref, ref_opt, model, opt


def _held_modules(rank, world_size):
    batches = global_batches(2, batch=2 * world_size)
    for mp in (None, zerokit.MixedPrecision(param_dtype=torch.bfloat16)):
        ref, ref_opt, model, opt = _pair(mp)
        train_reference(ref, ref_opt, batches)
        train_sharded(model, opt, batches, rank, world_size)
        full = model.state_dict()  # collective
        held = [g.gathered_numel() for g in state_of(model).groups]
        tol = ATOL if mp is None else 0.05  # bf16 compute: the fp32 masters drift a little
        for name, ref_value in ref.state_dict().items():
            torch.testing.assert_close(full[name], ref_value, atol=tol, rtol=0)
        for prefix, module in model.named_modules():
            if prefix == "":
                continue
            got = module.state_dict()  # collective: every rank calls it
            want = {k[len(prefix) + 1 :]: v for k, v in full.items() if k.startswith(prefix + ".")}
            assert got.keys() == want.keys(), prefix
            for name, value in want.items():  # the fp32 masters too under mixed precision
                assert torch.equal(got[name], value), f"{prefix}.{name}: {got[name].shape}"
        # nothing more stays gathered: the units are freed again after each call
        assert [g.gathered_numel() for g in state_of(model).groups] == held


def test_a_held_submodule_state_dict_is_full():
    run_distributed(_held_modules, 2)
