"""Level 'p_g_os' specifics: what is gathered when, memory between steps, activation
checkpointing, eval/no_grad, unit policies. Equivalence over many steps is in
test_equivalence.py and test_training_loop.py; here each check also compares with one process."""

import contextlib
import copy
import os
import sys
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_distributed
from models import (
    VOCAB,
    assert_same_params,
    global_batches,
    local_slice,
    loss_fn,
    train_reference,
    train_sharded,
)
from torch.utils.checkpoint import checkpoint

import zerokit
from zerokit.core.flat_param import Storage
from zerokit.core.state import state_of
from zerokit.models.gpt import GPT, Block, GPTConfig
from zerokit.runtime.timeouts import CollectiveTimeout

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


_COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "barrier",
)


@contextlib.contextmanager
def _recorded_collectives():
    """Every torch.distributed collective issued inside, as the zerokit function that
    issued it (the caller's name)."""
    calls, saved = [], {name: getattr(dist, name) for name in _COLLECTIVES}

    def recorder(name, fn):
        def call(*args, **kwargs):
            frame = sys._getframe(1)
            while frame.f_code.co_name.startswith("<"):  # a comprehension inside the caller
                frame = frame.f_back
            calls.append((name, frame.f_code.co_name))
            return fn(*args, **kwargs)

        return call

    for name, fn in saved.items():
        setattr(dist, name, recorder(name, fn))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _order_agreed_once(rank, world_size):
    batches = global_batches(3, batch=2 * world_size)
    ref, ref_opt, model, opt = _pair(lambda: GPT(CFG))
    per_forward = []
    for x, y in batches:
        xs, ys = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
        with _recorded_collectives() as calls:
            logits = model(xs)
        per_forward.append(calls)
        loss_fn(logits, ys).backward()
        opt.step()
        opt.zero_grad()
    train_reference(ref, ref_opt, batches)
    assert_same_params(model, ref, ATOL, "order agreed once")
    # the first forward agrees on the units' order (one all-reduce); later ones, in the same
    # order, issue nothing but their gathers (broadcasts into the full buffer on gloo)
    assert ("all_reduce", "start_all_reduce_") in per_forward[0], per_forward[0]
    for calls in per_forward[1:]:
        assert calls and all(f == "start_all_gather_" for _, f in calls), calls


class Swapped(torch.nn.Module):
    """Two blocks of one shape, run in the order ``order`` (set per rank and step)."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
        self.order = (0, 1)

    def forward(self, x):
        for i in self.order:
            x = self.blocks[i](x)
        return x


def _order_changes(rank, world_size, who):
    """The order changes at the second step on ``who`` ("every" rank, or rank 0 only)."""
    os.environ["ZEROKIT_COLLECTIVE_TIMEOUT"] = "3"
    torch.manual_seed(0)
    model = Swapped()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, _ = zerokit.group_sharded_parallel(model, opt, "p_g_os")
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    if who == "every" or rank == 0:
        model.order = (1, 0)
    if who == "every":  # an order that depends on the input, the same on every rank: agreed
        with _recorded_collectives() as calls:
            model(torch.randn(2, 4)).sum().backward()
        assert ("all_reduce", "start_all_reduce_") in calls
        assert state_of(model).agreed_order == state_of(model).prefetch_order
        return
    start = time.monotonic()
    with pytest.raises(CollectiveTimeout) as caught:  # rank 0 waits in the store, named
        model(torch.randn(2, 4)).sum().backward()
    if rank == 0:
        assert "rank 1 of 2 did not" in str(caught.value) and "agreed before" in str(caught.value)
    else:  # rank 1 went on to its backward, whose collective names where rank 0 is
        assert "rank 0 is at call" in str(caught.value) and "another order" in str(caught.value)
    assert time.monotonic() - start < 30
    sys.stdout.flush()
    os._exit(0)  # skip destroy_process_group: the abandoned collective would wait on it


def test_a_forward_in_the_agreed_order_issues_no_collective_beyond_gathers():
    run_distributed(_order_agreed_once, 2)


@pytest.mark.parametrize("who", ["every", "rank 0"])
def test_a_changed_order_is_agreed_or_names_the_ranks_that_kept_the_old_one(who):
    run_distributed(_order_changes, 2, who)
