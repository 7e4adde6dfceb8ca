"""step_in_backward: each unit stepped as soon as its gradients are reduced, its gradient shard
freed at once. The same training as one process on the global batch (2e-5, fp32, many steps,
awkward models, accumulation, an LR schedule), gradient bytes bounded during backward, and
what it cannot do refused."""

import copy

import pytest
import torch
from dist_helpers import run_distributed
from models import (
    SMALL,
    assert_same_params,
    global_batches,
    local_slice,
    loss_fn,
    make_model,
    make_optimizer,
)
from torch import nn

import zerokit
from zerokit.core.state import state_of

STEPS = 8
ATOL = 2e-5


def _equivalence(rank, world_size):
    batches = global_batches(STEPS, batch=4 * world_size)
    for level in ("os_g", "p_g_os"):
        for model_kind in ("awkward", "gpt"):
            for opt_kind in ("sgd", "adamw"):
                for micro in (1, 2):  # 2: accumulation under no_sync, then one synced backward
                    what = f"{level} {model_kind} {opt_kind} micro={micro} world={world_size}"
                    ref = make_model(model_kind)
                    model = copy.deepcopy(ref)
                    ref_opt, opt = make_optimizer(opt_kind, ref), make_optimizer(opt_kind, model)
                    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, 3, gamma=0.5)
                    model, opt, _ = zerokit.group_sharded_parallel(
                        model, opt, level, step_in_backward=True, **SMALL[level]
                    )
                    sched = torch.optim.lr_scheduler.StepLR(opt, 3, gamma=0.5)
                    for x, y in batches:
                        ref_loss = loss_fn(ref(x), y)
                        ref_loss.backward()
                        ref_opt.step()
                        ref_opt.zero_grad()
                        ref_sched.step()
                        xs, ys = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
                        for m, (xm, ym) in enumerate(zip(xs.chunk(micro), ys.chunk(micro))):
                            loss = loss_fn(model(xm), ym) / micro
                            if m < micro - 1:
                                with model.no_sync():
                                    loss.backward()
                            else:
                                loss.backward()
                        opt.step()
                        opt.zero_grad()
                        sched.step()
                    assert_same_params(model, ref, ATOL, what)
                    if model_kind == "awkward":  # unused everywhere: never stepped (decay)
                        assert torch.equal(model.state_dict()["unused"], ref.unused.detach())


@pytest.mark.parametrize(
    "world_size",
    [1, 2, pytest.param(3, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)],
)
def test_step_in_backward_matches_one_process(world_size):
    run_distributed(_equivalence, world_size)


BLOCKS, DIM = 6, 16


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, DIM)
        self.blocks = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, 11)
        self.probe = None

    def forward(self, idx):
        x = self.emb(idx)
        for i, block in enumerate(self.blocks):
            x = torch.tanh(block(x))
            if self.probe is not None and x.requires_grad:
                x.register_hook(lambda g, i=i: self.probe(i))
        return self.head(x)


def _grad_bytes(state) -> int:
    return sum(t.untyped_storage().nbytes() for t in state.held_tensors()["grads"])


def _gradients_bounded(rank, world_size):
    batches = global_batches(3, batch=2 * world_size)
    for level in ("os_g", "p_g_os"):
        peaks = {}
        # lean: step_in_backward with sync_comm, each reduction finished before backward goes
        # on (the benchmarks' '<level>_lean' runners): still one process's training
        for in_backward, lean in ((False, False), (True, False), (True, True)):
            torch.manual_seed(0)
            model, ref = Stack(), Stack()
            ref.load_state_dict(model.state_dict())
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
            model, opt, _ = zerokit.group_sharded_parallel(
                model, opt, level, step_in_backward=in_backward, sync_comm=lean
            )
            state = state_of(model)
            unit = max(
                sum(b.shard_data.nbytes for b in g.buckets)
                for g in state.groups
                if g is not state.root_group
            )
            held = []
            model.probe = lambda i, held=held, state=state: held.append(_grad_bytes(state))
            for x, y in batches:
                loss_fn(ref(x), y).backward()
                ref_opt.step()
                ref_opt.zero_grad()
                xs, ys = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
                loss_fn(model(xs), ys).backward()
                if in_backward:
                    assert _grad_bytes(state) == 0  # every group stepped and freed its shard
                opt.step()
                opt.zero_grad()
            assert_same_params(model, ref, ATOL, f"{level} step_in_backward={in_backward} {lean=}")
            if lean:  # every earlier group's reduction finished, stepped and freed already
                assert max(held) == 0, (level, held)
                continue
            peaks[in_backward] = max(held)
            if in_backward:
                # at a block's backward: at most the group whose reduction is in flight (1,
                # MAX_GROUPS_IN_FLIGHT) holds a gradient shard; every earlier one was stepped
                # and freed
                assert max(held) <= 1 * unit, (level, held, unit)
        # without it the shards of every block reduced so far are held
        assert peaks[False] >= (BLOCKS - 2) * unit, (level, peaks, unit)


def test_gradients_never_exist_for_the_whole_model():
    run_distributed(_gradients_bounded, 2)


def _refusals(rank, world_size):
    torch.manual_seed(0)
    model = Stack()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="needs sharded gradients"):
        zerokit.group_sharded_parallel(copy.deepcopy(model), opt, "os", step_in_backward=True)
    with pytest.raises(ValueError, match="cannot take a loss scaler"):
        zerokit.group_sharded_parallel(
            copy.deepcopy(model),
            torch.optim.SGD(model.parameters(), lr=0.1),
            "os_g",
            scaler=zerokit.ShardedGradScaler(),
            step_in_backward=True,
        )
    model, opt, _ = zerokit.group_sharded_parallel(model, opt, "p_g_os", step_in_backward=True)
    x, y = global_batches(1, batch=2)[0]
    loss_fn(model(x), y).backward()
    with pytest.raises(RuntimeError, match="no global gradient norm"):
        zerokit.clip_grad_norm_(model, 1.0)
    with pytest.raises(RuntimeError, match="cannot re-evaluate"):
        opt.step(lambda: 0.0)
    opt.step()
    opt.zero_grad()


def test_what_step_in_backward_cannot_do_is_refused():
    run_distributed(_refusals, 1)
