"""Hybrid accumulation that crosses hosts once per step (``model.defer_replica_sync()``).

Shard groups of S ranks, R replicas (dp R x sharding S). K micro-batches per step: the first
K-1 under ``defer_replica_sync()`` reduce-scatter inside the shard group only, the last
averages the accumulated shard across replicas. Checked against one process on the global
batch (2e-5, fp32), several steps, at S x R = 2 x 2 and 3 x 2 (uneven shards), every level
('os' also with ``whole_grads=True``), AdamW and Adafactor, Muon's owners and torchao's
AdamW8bit on a matrix model; a counting group per process group
shows no byte crosses replicas before the boundary micro-batch and the shard's bytes on it;
the gradient held between micro-batches is 1/S of what ``no_sync()`` holds.
"""

from __future__ import annotations

import contextlib
import importlib.util
import multiprocessing

import pytest
import torch
from counting import patched_collectives
from dist_helpers import run_distributed
from models import (
    SMALL,
    MatrixNet,
    assert_same_params,
    global_batches,
    local_slice,
    loss_fn,
    make_model,
    make_optimizer,
    make_optimizers,
)
from test_optimizers import newton_schulz_in_fp32

import zerokit
from zerokit.core.state import state_of

ATOL = 2e-5
STEPS = 3
_OPS = ("isend", "irecv", "all_reduce", "broadcast", "reduce_scatter", "all_gather")


@contextlib.contextmanager
def counting_by_group():
    """Record (group, op, bytes, floating?) for every collective this rank calls: a counting
    group per process group (``group=None``: the world)."""
    calls: list[tuple[object, str, int, bool]] = []

    def record(op, tensor, args, kwargs):
        tensors = [tensor] if isinstance(tensor, torch.Tensor) else list(tensor)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        calls.append((kwargs.get("group"), op, nbytes, tensors[0].is_floating_point()))

    with patched_collectives(_OPS, record):
        yield calls


def _groups(dp: int, sharding: int):
    layout = zerokit.init_hybrid_parallel(dp, 1, sharding_degree=sharding)
    return layout.sharding_group, layout.dp_group


def _optimizer(kind: str, model):
    if kind == "adafactor":
        return torch.optim.Adafactor([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return make_optimizer(kind, model)


def _reference(opt_kind: str, batches):
    ref = make_model("awkward")
    opt = _optimizer(opt_kind, ref)
    for x, y in batches:
        loss_fn(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    return ref


def _replica_bytes(calls, replicas) -> tuple[int, int]:
    """(calls, floating-point bytes) that crossed the replica group."""
    mine = [c for c in calls if c[0] is replicas]
    return len(mine), sum(n for _, _, n, floating in mine if floating)


def _train(model, opt, batches, rank, world, k, replicas, defer=True):
    """K micro-batches per step; returns the replica group's (calls, bytes) per micro-batch."""
    seen = []
    for x, y in batches:
        xs, ys = local_slice(x, rank, world).chunk(k), local_slice(y, rank, world).chunk(k)
        for m in range(k):
            last = m == k - 1
            scope = model.defer_replica_sync() if defer and not last else contextlib.nullcontext()
            with counting_by_group() as calls, scope:
                (loss_fn(model(xs[m]), ys[m]) / k).backward()
            seen.append((last, _replica_bytes(calls, replicas)))
        opt.step()
        opt.zero_grad()
    return seen


CASES = [(level, False) for level in ("os", "os_g", "p_g_os")] + [("os", True)]


def _matches_one_process(rank, world, sharding, k, opt_kinds, cases=CASES):
    group, replicas = _groups(world // sharding, sharding)
    batches = global_batches(STEPS, batch=k * world * 2)
    for opt_kind in opt_kinds:
        ref = _reference(opt_kind, batches)
        for level, whole in cases:
            what = f"S={sharding} R={world // sharding} k={k} {level} whole={whole} {opt_kind}"
            model = make_model("awkward")
            model, opt, _ = zerokit.group_sharded_parallel(
                model,
                _optimizer(opt_kind, model),
                level,
                group=group,
                dp_group=replicas,
                config=zerokit.ShardingConfig(whole_grads=whole),
                **SMALL[level],
            )
            seen = _train(model, opt, batches, rank, world, k, replicas)
            assert_same_params(model, ref, ATOL, what)
            shard_bytes = sum(b.shard_data.numel() * 4 for b in state_of(model).buckets)
            for last, (ncalls, nbytes) in seen:
                if last:  # the whole accumulated shard, averaged once (fp32)
                    assert nbytes == shard_bytes, (what, nbytes, shard_bytes)
                else:  # nothing at all, not even the control values, crosses replicas
                    assert ncalls == 0, (what, "a deferred micro-batch crossed replicas")


def test_defer_matches_one_process_2x2():
    run_distributed(_matches_one_process, 4, 2, 3, ("adamw",))


@pytest.mark.slow
def test_defer_matches_one_process_2x2_adafactor():
    run_distributed(_matches_one_process, 4, 2, 2, ("adafactor",))


@pytest.mark.slow
def test_defer_matches_one_process_3x2_uneven():
    run_distributed(_matches_one_process, 6, 3, 4, ("adamw", "adafactor"))


def _families(rank, world, sharding, k, kinds):
    """Muon (its owners step whole matrices; Newton-Schulz in fp32 so a last-bit difference
    in a reduced gradient stays one) and torchao's AdamW8bit, K micro-batches a step, the
    first K-1 deferred, every level."""
    group, replicas = _groups(world // sharding, sharding)
    batches = global_batches(STEPS, batch=k * world * 2)
    with newton_schulz_in_fp32():
        for kind in kinds:
            for level in ("os", "os_g", "p_g_os"):
                what = f"S={sharding} R={world // sharding} k={k} {level} {kind}"
                torch.manual_seed(0)
                ref, model = MatrixNet(), MatrixNet()
                model.load_state_dict(ref.state_dict())
                ref_opts = make_optimizers(kind, ref)
                model, opts, _ = zerokit.group_sharded_parallel(
                    model, make_optimizers(kind, model), level, group=group, dp_group=replicas,
                    **SMALL[level],
                )  # fmt: skip
                for x, y in batches:
                    loss_fn(ref(x), y).backward()
                    for opt in ref_opts:
                        opt.step()
                        opt.zero_grad()
                    xs, ys = (
                        local_slice(x, rank, world).chunk(k),
                        local_slice(y, rank, world).chunk(k),
                    )
                    for m in range(k):
                        deferred = m < k - 1
                        with model.defer_replica_sync() if deferred else contextlib.nullcontext():
                            (loss_fn(model(xs[m]), ys[m]) / k).backward()
                    for opt in opts:
                        opt.step()
                    for opt in opts:
                        opt.zero_grad()
                assert_same_params(model, ref, ATOL, what)


@pytest.mark.slow
def test_defer_matches_one_process_2x2_muon_and_low_bit():
    kinds = ("muon",) + (("adamw8bit",) if importlib.util.find_spec("torchao") else ())
    run_distributed(_families, 4, 2, 2, kinds)


def _memory(rank, world, out):
    """Gradient bytes held between micro-batches: the sharded gradient under the deferral,
    autograd's full ``.grad`` under ``no_sync()``."""
    group, replicas = _groups(2, 2)
    x, y = global_batches(1, batch=world * 2)[0]
    x, y = local_slice(x, rank, world), local_slice(y, rank, world)
    held = {}
    for level in ("os_g", "p_g_os"):
        for mode in ("defer", "no_sync"):
            model = make_model("awkward")
            model, opt, _ = zerokit.group_sharded_parallel(
                model, make_optimizer("adamw", model), level, group=group, dp_group=replicas
            )
            scope = model.defer_replica_sync() if mode == "defer" else model.no_sync()
            with scope:
                loss_fn(model(x), y).backward()
            state = state_of(model)
            grads = state.held_tensors()["grads"] + [
                p.grad
                for p in model.parameters()
                if type(p.grad) is torch.Tensor  # not a placeholder
            ]
            unique = {t.untyped_storage().data_ptr(): t for t in grads if t.numel()}
            held[(level, mode)] = sum(t.numel() * t.element_size() for t in unique.values())
            padded = sum(b.layout.padded_numel for b in state.buckets) * 4
            if mode == "defer":  # 1/S of every bucket, padding included (S = 2)
                assert held[(level, mode)] == padded // 2, (level, held)
            loss_fn(model(x), y).backward()  # the boundary: then a step is allowed
            opt.step()
    out.put(held)


def test_deferred_gradients_stay_sharded():
    queue = multiprocessing.get_context("fork").SimpleQueue()
    run_distributed(_memory, 4, queue)
    for _ in range(4):
        held = queue.get()
        for level in ("os_g", "p_g_os"):
            # no_sync holds every trainable parameter's full gradient (the tied weight once);
            # the deferral holds one of S = 2 shards of the padded buckets: about half
            assert held[(level, "defer")] * 2 <= held[(level, "no_sync")] + 2 * 4 * 16, held


def _rules(rank, world):
    """Misuse is refused, ``zero_grad`` drops the accumulation, the integrations' switch."""
    group, replicas = _groups(2, 2)
    batches = global_batches(2, batch=world * 4)
    x, y = local_slice(batches[0][0], rank, world), local_slice(batches[0][1], rank, world)
    model = make_model("awkward")
    model, opt, _ = zerokit.group_sharded_parallel(
        model, make_optimizer("adamw", model), "os_g", group=group, dp_group=replicas
    )
    with model.defer_replica_sync():
        loss_fn(model(x), y).backward()
    for call in (opt.step, lambda: zerokit.clip_grad_norm_(model, 1.0)):
        with pytest.raises(RuntimeError, match="defer_replica_sync"):
            call()
    opt.zero_grad()  # drops it: a step is allowed again (on nothing)
    opt.step()
    # no_sync() nested inside the deferral: held whole, reduced by the next deferred backward
    ref = _reference("adamw", [batches[1]])
    model = make_model("awkward")
    model, opt, _ = zerokit.group_sharded_parallel(
        model, make_optimizer("adamw", model), "os_g", group=group, dp_group=replicas
    )
    model.requires_replica_sync = False  # FSDP2's set_requires_all_reduce(False)
    xs, ys = local_slice(batches[1][0], rank, world), local_slice(batches[1][1], rank, world)
    with model.no_sync():
        (loss_fn(model(xs[:2]), ys[:2]) / 2).backward()
    model.requires_replica_sync = True
    (loss_fn(model(xs[2:]), ys[2:]) / 2).backward()
    # after the boundary the clip sees one process's gradient (a bound it does not reach)
    one = make_model("awkward")
    loss_fn(one(batches[1][0]), batches[1][1]).backward()
    want = torch.nn.utils.clip_grad_norm_(one.parameters(), 1e9)
    torch.testing.assert_close(zerokit.clip_grad_norm_(model, 1e9), want, atol=1e-6, rtol=1e-5)
    opt.step()
    assert_same_params(model, ref, ATOL, "no_sync inside the deferral")
    # the integrations' switch: no_sync() and require_backward_grad_sync defer the replica step
    model.no_sync_defers_replica_sync = True
    model.zero_grad()
    with model.no_sync(), counting_by_group() as calls:
        loss_fn(model(x), y).backward()
    assert _replica_bytes(calls, replicas)[0] == 0 and state_of(model).replica_sync.owed
    assert any(c[0] is group for c in calls), "reduce-scattered in the shard group"
    model.require_backward_grad_sync = False  # accelerate's and Lightning's switch
    assert model.requires_replica_sync is False
    model.require_backward_grad_sync = True
    loss_fn(model(x), y).backward()
    opt.step()
    model.zero_grad()
    from zerokit.integrations.fabric import _NoSync  # fabric.no_backward_sync's control

    with _NoSync().no_backward_sync(model, True), counting_by_group() as calls:
        loss_fn(model(x), y).backward()
    assert _replica_bytes(calls, replicas)[0] == 0 and state_of(model).replica_sync.owed
    loss_fn(model(x), y).backward()
    opt.step()
    # step_in_backward: each synchronised backward steps, so it cannot defer
    model = make_model("awkward")
    model, opt, _ = zerokit.group_sharded_parallel(
        model,
        make_optimizer("adamw", model),
        "os_g",
        group=group,
        dp_group=replicas,
        step_in_backward=True,
    )
    with model.defer_replica_sync(), pytest.raises(RuntimeError, match="step_in_backward"):
        loss_fn(model(x), y).backward()


def test_misuse_zero_grad_no_sync_and_integration_switch():
    run_distributed(_rules, 4)


def _without_replicas(rank, world):
    """No replica group: the deferral changes nothing (the same script runs on one host)."""
    batches = global_batches(2, batch=world * 4)
    ref = _reference("adamw", batches)
    model = make_model("awkward")
    model, opt, _ = zerokit.group_sharded_parallel(model, make_optimizer("adamw", model), "os_g")
    _train(model, opt, batches, rank, world, 2, None)
    assert_same_params(model, ref, ATOL, "deferral without replicas")


def test_without_replicas_it_is_a_no_op():
    run_distributed(_without_replicas, 2)


# -- zerokit plan --accumulation against a counting group per process group ------------------
PLAN_MODEL, PLAN_SEQ, PLAN_BUFFER, PLAN_K = "verify_models:tiny_gpt", 8, 600, 3
_HELPERS = {  # zerokit's collective helpers: (op as the plan names it, where the group is)
    "start_all_reduce_mean": ("all_reduce", 1),
    "start_all_reduce_": ("all_reduce", 1),
    "all_reduce_": ("all_reduce", 1),
    "start_reduce_scatter_mean": ("reduce_scatter", 2),
    "start_all_gather_": ("all_gather", 1),
    "broadcast_": ("broadcast", 1),
}


def _count_helpers(calls: list):
    """Wrap the helpers wherever zerokit imported them: (group, op, bytes of the whole
    tensor) per logical collective, the plan's unit."""
    import sys

    from zerokit.core import collectives

    for name, (op, at) in _HELPERS.items():
        original = getattr(collectives, name)

        def counted(*args, _fn=original, _op=op, _at=at, **kwargs):
            group = kwargs["group"] if "group" in kwargs else args[_at]
            if group is not None and group.size() > 1 and not getattr(counted_depth, "n", 0):
                calls.append((group, _op, args[0].numel() * args[0].element_size()))
            counted_depth.n = getattr(counted_depth, "n", 0) + 1
            try:
                return _fn(*args, **kwargs)
            finally:
                counted_depth.n -= 1

        for module in list(sys.modules.values()):
            if module.__name__.startswith("zerokit") and getattr(module, name, None) is original:
                setattr(module, name, counted)


class _Depth:
    n = 0


counted_depth = _Depth()


def _links(calls, replicas) -> dict[str, int]:
    from zerokit.tools.plan import Collective

    out = {"within": 0, "across": 0}
    for group, op, nbytes in calls:
        sent = round(Collective(op, group.size(), nbytes, "").sent)
        out["across" if group is replicas else "within"] += sent
    return out


def _real_links_equal_plan(rank, world, plans):
    from zerokit.tools.workload import build_workload, load_factory

    calls: list = []
    _count_helpers(calls)
    group, replicas = _groups(2, 2)
    for level, links in plans.items():
        for mode, planned in links.items():
            torch.manual_seed(0)
            work = build_workload(
                load_factory(PLAN_MODEL), batch=2 * world, seq=PLAN_SEQ, per_rank=2
            )
            opt = torch.optim.AdamW(work.model.parameters(), lr=1e-3)
            model, opt, _ = zerokit.group_sharded_parallel(
                work.model,
                opt,
                level,
                group=group,
                dp_group=replicas,
                buffer_max_size=PLAN_BUFFER,
            )
            scope = {"every": contextlib.nullcontext, "defer": model.defer_replica_sync}.get(
                mode, model.no_sync
            )
            x, y = (t[2 * rank : 2 * rank + 2] for t in work.make_batch(0, 2 * world))
            for _step in range(2):  # the second is the steady one the plan describes
                seen = []
                for m in range(PLAN_K):
                    calls.clear()
                    with scope() if m < PLAN_K - 1 else contextlib.nullcontext():
                        work.loss_fn(model(x), y).backward()
                    seen.append(_links(calls, replicas))
                opt.step()
                opt.zero_grad()
            what = f"{level} {mode} rank {rank}"
            assert seen[0] == planned["inner_micro_batch"], (what, seen, planned)
            assert seen[-1] == planned["last_micro_batch"], (what, seen, planned)


def test_plan_links_equal_a_counting_group_per_process_group():
    from zerokit.tools.plan import PlanConfig, make_plan

    plans = {}
    for level in ("os", "os_g", "p_g_os"):
        report = make_plan(PlanConfig(
            world=4, level=level, model=PLAN_MODEL, sharding_degree=2, batch=8, seq=PLAN_SEQ,
            buffer_max_size=PLAN_BUFFER, accumulation=PLAN_K,
        ))  # fmt: skip
        links = report["links"]
        # the deferral crosses hosts once: 1/K of reducing every micro-batch's replica bytes
        every, defer = links["every"]["per_step"], links["defer"]["per_step"]
        assert defer["across"] * PLAN_K == every["across"] and defer["within"] == every["within"]
        plans[level] = links
    run_distributed(_real_links_equal_plan, 4, plans)
