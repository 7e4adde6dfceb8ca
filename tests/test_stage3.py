"""Level 'p_g_os' specifics: what is gathered when, memory between steps, activation
checkpointing, eval/no_grad, unit policies. Equivalence over many steps is in
test_equivalence.py and test_training_loop.py; here each check also compares with one process."""

import copy
import warnings

import pytest
import torch
from dist_helpers import run_distributed
from models import (
    VOCAB,
    assert_same_params,
    global_batches,
    loss_fn,
    train_reference,
    train_sharded,
)
from torch.utils.checkpoint import checkpoint

import zerokit
from zerokit.core.flat_param import Storage
from zerokit.core.state import state_of
from zerokit.models.gpt import GPT, Block, GPTConfig

ATOL = 2e-5
CFG = GPTConfig(vocab_size=VOCAB, block_size=8, n_layer=3, n_head=2, n_embd=8)


class CheckpointedGPT(GPT):
    def __init__(self, cfg, reentrant: bool):
        super().__init__(cfg)
        self.reentrant = reentrant

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:  # each block's activations recomputed in backward
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return self.lm_head(self.ln_f(x))


def _pair(factory, **wrap_kwargs):
    torch.manual_seed(0)
    ref = factory()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    model, opt, _ = zerokit.group_sharded_parallel(model, opt, "p_g_os", **wrap_kwargs)
    return ref, ref_opt, model, opt


def _unit_names(model):
    return [g.name for g in state_of(model).groups]


def _checks(rank, world_size):
    batches = global_batches(5, batch=2 * world_size)

    # Activation checkpointing inside units, both implementations: equal to one process.
    for reentrant in (False, True):
        ref, ref_opt, model, opt = _pair(lambda r=reentrant: CheckpointedGPT(CFG, r))
        train_reference(ref, ref_opt, batches)
        train_sharded(model, opt, batches, rank, world_size)
        assert_same_params(model, ref, ATOL, f"checkpoint reentrant={reentrant}")

    ref, ref_opt, model, opt = _pair(lambda: GPT(CFG))
    train_reference(ref, ref_opt, batches)
    train_sharded(model, opt, batches, rank, world_size)
    state = state_of(model)

    # Between steps every rank holds 1/N of the model: no full buffer has storage; the shards
    # and AdamW state (exp_avg + exp_avg_sq) are each padded_numel / N per bucket, i.e.
    # (P + padding) / N elements with padding < N per bucket; and zero_grad(set_to_none=True)
    # freed the gradient shards, as torch's contract says (FSDP2 frees them too). fp32 AdamW:
    # 4 (param) + 8 (state) = 12 bytes x (P + padding) / N.
    buckets = state.buckets
    assert all(
        b.storage is Storage.SHARDED and b.data.untyped_storage().nbytes() == 0 for b in buckets
    )
    n_params = sum(p.numel() for p in ref.parameters())
    padded = sum(b.layout.padded_numel for b in buckets)
    assert padded - n_params < world_size * len(buckets)
    shard_elems = sum(b.shard_data.numel() for b in buckets)
    grad_elems = sum(g.numel() for g in state.grads_to_scale())
    state_elems = sum(v.numel() for s in opt.state.values() for k, v in s.items() if k != "step")
    assert shard_elems == padded // world_size and grad_elems == 0
    assert state_elems == 2 * sum(p.numel() for g in opt.param_groups for p in g["params"])
    assert state_elems <= 2 * padded // world_size

    # During a forward, full parameters alive at once: the root unit (gathered for the whole
    # forward) + the running unit + the one prefetched after it; never more.
    groups = state.groups
    root = sum(b.layout.padded_numel for b in state.root_group.buckets)
    largest = max(
        sum(b.layout.padded_numel for b in g.buckets) for g in groups if g is not state.root_group
    )
    seen = []  # gathered elements as each block starts (after zerokit's own pre-hook)
    probes = [
        block.register_forward_pre_hook(lambda m, a: seen.append(state.gathered_numel()))
        for block in model.blocks
    ]
    x, y = batches[0]
    loss_fn(model(x), y).backward()
    for probe in probes:
        probe.remove()
    assert seen and 0 < max(seen) <= root + 2 * largest
    assert state.gathered_numel() == 0  # everything freed when backward ended
    opt.zero_grad()

    # A unit's full parameters are freed before its last gradient is staged: the last delivery
    # ends every use of them, and staging it beside them would hold both at the peak.
    gathered_at_last = {}  # unit -> whether its full parameters were alive at its last take
    for group in groups:
        take, ends = group.gradients.take, group

        def recording(b, i, param, accumulated, take=take, group=ends):
            if group._missing_total == 1:  # the unit's last parameter (counted down after)
                gathered_at_last[group.name] = any(
                    bu.storage is Storage.GATHERED for bu in group.buckets
                )
            return take(b, i, param, accumulated)

        group.gradients.take = recording
    loss_fn(model(x), y).backward()
    for group in groups:
        del group.gradients.take
    assert set(gathered_at_last) == {g.name for g in groups}, gathered_at_last
    assert not any(gathered_at_last.values()), gathered_at_last
    opt.zero_grad()

    # The root unit's gradients arrive over the whole backward (ln_f's first, the embeddings'
    # last): its staging buffer is borrowed only when it is reduced, not held all the while.
    root_staged = []  # as each block's backward begins
    probes = [
        block.register_full_backward_pre_hook(
            lambda m, g: root_staged.append(
                any(s is not None for s in state.root_group.gradients._staged)
            )
        )
        for block in model.blocks
    ]
    loss_fn(model(x), y).backward()
    for probe in probes:
        probe.remove()
    assert len(root_staged) == len(model.blocks) and not any(root_staged), root_staged
    opt.zero_grad()

    # A parameter read outside its unit's forward raises; it never reads freed memory.
    weight = model.blocks[1].fc.weight
    assert weight.numel() == 0
    with pytest.raises(RuntimeError):
        weight @ torch.ones(CFG.n_embd, 1)

    # eval + no_grad: gathered and freed unit by unit, nothing left gathered or pending, and
    # the output equals one process's.
    model.eval()
    ref.eval()
    with torch.no_grad():
        out, ref_out = model(x), ref(x)
    torch.testing.assert_close(out, ref_out, atol=ATOL, rtol=0)
    assert state.gathered_numel() == 0 and all(g.phase.value == "idle" for g in groups)
    model.train()

    # Units by wrap class; a wrap policy matching nothing warns and keeps one root unit.
    _, _, wrapped, _ = _pair(lambda: GPT(CFG), config=zerokit.ShardingConfig(wrap=(Block,)))
    assert _unit_names(wrapped) == [
        "<root>",
        "blocks.0",
        "blocks.1",
        "blocks.2",
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ref, ref_opt, model, opt = _pair(
            lambda: GPT(CFG), config=zerokit.ShardingConfig(wrap=(torch.nn.GRU,))
        )
    assert any("matches no module" in str(w.message) for w in caught)
    assert _unit_names(model) == ["<root>"]
    train_reference(ref, ref_opt, batches)
    train_sharded(model, opt, batches, rank, world_size)
    assert_same_params(model, ref, ATOL, "single root unit")

    # exclude_layer keeps a layer whole on every rank, between steps too; still equivalent.
    ref, ref_opt, model, opt = _pair(lambda: GPT(CFG), exclude_layer=[Block])
    train_reference(ref, ref_opt, batches)
    train_sharded(model, opt, batches, rank, world_size)
    torch.testing.assert_close(
        model.blocks[0].fc.weight, ref.blocks[0].fc.weight, atol=ATOL, rtol=0
    )
    assert_same_params(model, ref, ATOL, "exclude_layer")


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_stage3_gathers_frees_and_matches_single_process(world_size):
    run_distributed(_checks, world_size)


def _held_modules(rank, world_size):
    """A submodule the user still holds (``model.blocks[0]``, a backbone) is sharded in place
    at 'p_g_os': its own ``state_dict()`` gathers what one process holds, as the model's does
    (fp32 masters under mixed precision), never stage 3's empty parameters."""
    batches = global_batches(2, batch=2 * world_size)
    for mp in (None, zerokit.MixedPrecision(param_dtype=torch.bfloat16)):
        ref, ref_opt, model, opt = _pair(lambda: GPT(CFG), mixed_precision=mp)
        train_reference(ref, ref_opt, batches)
        train_sharded(model, opt, batches, rank, world_size)
        full = model.state_dict()  # collective
        tol = ATOL if mp is None else 0.05  # bf16 compute: the masters drift a little
        for name, ref_value in ref.state_dict().items():
            torch.testing.assert_close(full[name], ref_value, atol=tol, rtol=0)
        for prefix, module in model.named_modules():
            if prefix == "":
                continue
            got = module.state_dict()  # collective: every rank calls it
            want = {k[len(prefix) + 1 :]: v for k, v in full.items() if k.startswith(prefix + ".")}
            assert got.keys() == want.keys(), prefix
            for name, value in want.items():
                assert torch.equal(got[name], value), f"{prefix}.{name}: {got[name].shape}"
        # nothing stays gathered: the units are freed again after each call
        assert state_of(model).groups[1].gathered_numel() == 0


def test_a_held_submodule_state_dict_is_full():
    run_distributed(_held_modules, 2)
