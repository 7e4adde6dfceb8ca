"""step_in_backward with gradient accumulation (issue 42, item 2).

With ``step_in_backward=True`` every synchronised backward is an optimizer step. Accumulation
under ``no_sync()`` (every backward but the last) is therefore the same training as the loop
without step_in_backward: AdamW's step count is the number of optimizer steps and the
parameters equal one process's. Accumulation where every backward reduces would step at each
micro-batch (AdamW counting 2 per step, the model drifting from one process), so the second
backward before ``optimizer.step()`` is refused by name, before it changes anything, and
training goes on from the step already taken once the user closes it.
"""

import contextlib
import copy

import pytest
import torch
from dist_helpers import run_distributed
from models import SMALL, assert_same_params, global_batches, local_slice, loss_fn, make_model

import zerokit

STEPS, MICRO = 3, 2
ATOL = 2e-5  # fp32, as tests/test_step_in_backward.py: summation order differs, nothing else


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)


def _step_counts(opt) -> set[int]:
    """AdamW's ``step`` over every piece this rank steps (one process: every parameter)."""
    return {int(s["step"]) for s in opt.state.values() if "step" in s}


def _micro_batches(x, y, rank, world):
    xs, ys = local_slice(x, rank, world), local_slice(y, rank, world)
    return list(zip(xs.chunk(MICRO), ys.chunk(MICRO)))


def _accumulate(model, opt, batch, rank, world, no_sync: bool) -> None:
    """One optimizer step of MICRO micro-batches; under ``no_sync()`` all but the last."""
    micro = _micro_batches(*batch, rank, world)
    for m, (xm, ym) in enumerate(micro):
        loss = loss_fn(model(xm), ym) / MICRO
        quiet = no_sync and m < len(micro) - 1
        with model.no_sync() if quiet else contextlib.nullcontext():
            loss.backward()
    opt.step()
    opt.zero_grad()


def _one_process(ref, batches, first_micro_only=False):
    """The reference: AdamW on each global batch in one process. ``first_micro_only``: the
    first step sees only every rank's first micro-batch (what a refused second backward
    leaves: the step the first backward took), the later steps the whole batch."""
    opt = _adamw(ref)
    for t, (x, y) in enumerate(batches):
        if t == 0 and first_micro_only:
            world = x.shape[0] // (MICRO * 2)  # 2 rows per micro-batch per rank, below
            firsts = [_micro_batches(x, y, r, world)[0] for r in range(world)]
            xm, ym = torch.cat([f[0] for f in firsts]), torch.cat([f[1] for f in firsts])
            (loss_fn(ref(xm), ym) / MICRO).backward()
        else:
            loss_fn(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    return opt


def _wrap(model, level, step_in_backward):
    model, opt, _ = zerokit.group_sharded_parallel(
        model, _adamw(model), level, step_in_backward=step_in_backward, **SMALL[level]
    )
    return model, opt


def _under_no_sync(rank, world):
    batches = global_batches(STEPS, batch=MICRO * 2 * world)
    for level in ("os_g", "p_g_os"):
        ref = make_model("gpt")
        plain, model = copy.deepcopy(ref), copy.deepcopy(ref)
        ref_opt = _one_process(ref, batches)
        plain, plain_opt = _wrap(plain, level, step_in_backward=False)
        model, opt = _wrap(model, level, step_in_backward=True)
        for batch in batches:
            _accumulate(plain, plain_opt, batch, rank, world, no_sync=True)
            _accumulate(model, opt, batch, rank, world, no_sync=True)
        what = f"{level}, world {world}, accumulation under no_sync()"
        assert _step_counts(opt) == _step_counts(plain_opt) == _step_counts(ref_opt) == {STEPS}
        assert_same_params(model, plain, ATOL, what + ", step_in_backward vs without")
        assert_same_params(model, ref, ATOL, what + ", step_in_backward vs one process")


def _without_no_sync(rank, world):
    batches = global_batches(STEPS, batch=MICRO * 2 * world)
    for level in ("os_g", "p_g_os"):
        what = f"{level}, world {world}, accumulation without no_sync()"
        ref, ref_late = make_model("gpt"), make_model("gpt")
        plain, model = copy.deepcopy(ref), copy.deepcopy(ref)
        ref_opt = _one_process(ref, batches)
        late_opt = _one_process(ref_late, batches, first_micro_only=True)
        # without step_in_backward every backward reduces and adds: one process's training
        plain, plain_opt = _wrap(plain, level, step_in_backward=False)
        for batch in batches:
            _accumulate(plain, plain_opt, batch, rank, world, no_sync=False)
        assert _step_counts(plain_opt) == _step_counts(ref_opt) == {STEPS}
        assert_same_params(plain, ref, ATOL, what + ", without step_in_backward")
        # with it the first backward stepped; the second is refused before it does anything
        model, opt = _wrap(model, level, step_in_backward=True)
        (x0, y0), (x1, y1) = _micro_batches(*batches[0], rank, world)
        (loss_fn(model(x0), y0) / MICRO).backward()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        second = loss_fn(model(x1), y1) / MICRO
        with pytest.raises(RuntimeError, match=r"step_in_backward.*model\.no_sync\(\)"):
            second.backward()
        assert _step_counts(opt) == {1}, what  # the refused backward stepped nothing
        for key, value in model.state_dict().items():
            assert torch.equal(value, before[key]), f"{what}: {key} changed by the refusal"
        opt.step()  # closes the step the first backward took; then training goes on
        opt.zero_grad()
        for batch in batches[1:]:
            _accumulate(model, opt, batch, rank, world, no_sync=True)
        assert _step_counts(opt) == _step_counts(late_opt) == {STEPS}
        assert_same_params(model, ref_late, ATOL, what + ", going on after the refusal")


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_accumulation_under_no_sync_steps_once_per_step(world):
    run_distributed(_under_no_sync, world)


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_accumulation_without_no_sync_is_refused_at_the_second_backward(world):
    run_distributed(_without_no_sync, world)
