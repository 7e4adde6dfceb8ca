"""``zerokit plan --ep`` against a real run at world 4, ep 2: the bytes each rank hands to the
dispatch and combine all-to-alls (forward and backward), counted on the wire, and the
experts' and the dense bytes per rank, measured after the steady step's backward.

The real run's routing is forced by a forward hook on each layer's router (its top-k
indices replaced): ``uniform`` (token t's j-th choice is expert (t k + j) mod E: every expert
receives as many) is the plan's ``--moe-imbalance 1``; ``skewed`` (every token to experts
0..k-1, all on ep rank 0) makes ep rank 0 receive every token of its group, ``--moe-imbalance
2``, the busiest rank the plan describes. The plan plays its ranks on meta, routing assumed."""

import collections
import contextlib
import re

import pytest
import torch
import torch.distributed as dist
from counting import patched_collectives
from dist_helpers import run_distributed

import zerokit
from zerokit.memory import measure
from zerokit.moe import apply_expert_parallel, init_expert_groups
from zerokit.tools.plan import PlanConfig, make_plan
from zerokit.tools.plan_moe import builtin_factory, expert_dense_bytes

WORLD, EP, SEQ, EXPERTS, TOP_K = 4, 2, 32, 8, 2


def _force_routing(model, how):
    def hook(router, args, output):
        logits, scores, indices = output
        t = torch.arange(indices.shape[0])[:, None]
        j = torch.arange(indices.shape[1])[None, :]
        forced = (t * TOP_K + j) % EXPERTS if how == "uniform" else j.expand_as(indices)
        return logits, scores, forced.to(indices.dtype)

    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(hook)


def _loss_and_saved_bytes(model, tokens):
    """The loss, and what autograd saves for it, each storage once, the parameters as they are
    when saved left out (at 'p_g_os' a saved weight is a gathered unit's, not a parameter's
    storage between uses): the plan's activations."""
    seen = {}

    def pack(t):
        params = {p.untyped_storage()._cdata for p in model.parameters()}
        if t.untyped_storage()._cdata not in params:
            seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=tokens, labels=tokens).loss
    return loss, sum(seen.values())


def _real_step_equals_plan(rank, world, level, how, report):
    plan = report["moe"]
    torch.manual_seed(0)
    model = builtin_factory(EXPERTS, TOP_K)()
    _force_routing(model, how)
    groups = init_expert_groups(EP)
    apply_expert_parallel(model, groups)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, _ = zerokit.group_sharded_parallel(
        model, opt, level, buffer_max_size=PlanConfig.buffer_max_size,
        segment_size=PlanConfig.segment_size,
    )  # fmt: skip
    phase = ["forward"]
    sent_order = []  # (phase or "counts", bytes handed to all_to_all_single), as issued

    def record(op, tensor, args, kwargs):
        if kwargs.get("group") is groups.ep_group:
            kind = phase[0] if args[0].is_floating_point() else "counts"
            sent_order.append((kind, args[0].numel() * args[0].element_size()))

    tokens = torch.randint(0, 256, (2, world, SEQ), generator=torch.Generator().manual_seed(1))
    for step in range(2):
        sent_order.clear()
        mine = tokens[step, rank : rank + 1]
        with patched_collectives(("all_to_all_single",), record):
            phase[0] = "forward"
            loss, saved = _loss_and_saved_bytes(model, mine)
            phase[0] = "backward"
            loss.backward()
        held = measure(model, opt)
        split = expert_dense_bytes(model, opt, held)
        opt.step()
        opt.zero_grad()
    counted = _counted(sent_order)
    if groups.ep_rank == 0:  # the busiest rank of its ep group: the one the plan describes
        assert counted == plan["all_to_all"], f"rank {rank} ({how}): {counted} vs {plan}"
    elif how == "skewed":  # the idle ep rank sends its tokens, receives none
        assert counted["dispatch_forward"] == plan["all_to_all"]["dispatch_forward"]
        assert counted.get("combine_forward", 0) == 0 < plan["all_to_all"]["combine_forward"]
    # the header: the split model's units (experts on their own group), and its activations
    # (within 2 %: rounding in the received rows' split aside, the same saved tensors)
    state = zerokit.core.state_of(model)
    assert len(state.groups) == report["units"], f"{len(state.groups)} units: {report['units']}"
    assert sum(len(g.buckets) for g in state.groups) == report["buckets"]
    planned_saved = report["ranks"][rank]["memory"]["activations"]
    if groups.ep_rank == 0 or how == "uniform":  # the busiest, as the plan assumes each is
        assert abs(saved - planned_saved) <= 0.02 * saved, f"saved {saved}: {planned_saved}"
    else:  # skewed: the idle ep rank receives no rows, so saves less
        assert saved <= planned_saved, f"rank {rank} saved {saved}, over {planned_saved}"
    planned = {int(r): m for ranks, m in plan["memory_by_ranks"] for r in ranks.split(",")}
    got = {k: split[k] for k in ("experts", "dense")}
    assert planned[rank] == got, f"rank {rank} at {level}: planned {planned[rank]}, held {got}"


def _counted(order) -> dict[str, int]:
    """The counted calls, named as the plan names them: per layer the forward's dispatch then
    combine, the backward's combine then dispatch."""
    got = collections.Counter()
    seen = collections.Counter()
    for kind, nbytes in order:
        if kind == "counts":
            got["counts"] += nbytes
            continue
        names = ("dispatch", "combine") if kind == "forward" else ("combine", "dispatch")
        got[f"{names[seen[kind] % 2]}_{kind}"] += nbytes
        seen[kind] += 1
    return dict(got)


@pytest.mark.parametrize(
    ("level", "how", "imbalance"),
    [("os_g", "uniform", 1.0), ("p_g_os", "skewed", 2.0)],
)
def test_plan_all_to_all_and_expert_bytes_match_a_real_run(level, how, imbalance):
    report = make_plan(
        PlanConfig(world=WORLD, level=level, ep=EP, moe_imbalance=imbalance, seq=SEQ,
                   experts=EXPERTS, top_k=TOP_K)
    )  # fmt: skip
    memory = [m for _, m in report["moe"]["memory_by_ranks"]]
    assert all(m["experts"]["optimizer"] > 0 and m["dense"]["grads"] > 0 for m in memory)
    run_distributed(_real_step_equals_plan, WORLD, level, how, report)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ep", "3"], "--ep 3 must be at least 2 and divide --world 4"),
        (["--ep", "2", "--moe-imbalance", "2.5"], "at most --ep = 2 .one rank receives all."),
        (["--ep", "2", "--moe-imbalance", "0.5"], "at least 1 .uniform routing."),
        (["--moe-imbalance", "1.5"], "--moe-imbalance needs --ep"),
        (["--ep", "2", "--tp", "2"], "--ep is planned with plain data parallelism only"),
        (["--ep", "4", "--experts", "6"], "--experts 6 must be a multiple of --ep 4"),
    ],
)
def test_bad_ep_arguments_refused_before_anything_is_played(capsys, args, message):
    from zerokit.tools.cli import main

    assert main(["plan", "--world", "4", "--level", "os_g", *args]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_printout_names_the_assumption_and_each_all_to_all(capsys):
    from zerokit.tools.cli import main

    argv = ["plan", "--world", "4", "--level", "os", "--ep", "4", "--moe-imbalance", "3"]
    assert main([*argv, "--experts", "4", "--top-k", "1", "--seq", "8"]) == 0
    out = capsys.readouterr().out
    assert "routing assumed: a rank receives 3 x the mean tokens" in out
    # 8 tokens x top-1 x hidden 64 x 4 bytes x 2 layers sent; 3 x that received
    assert re.search(r"dispatch  forward +4.0 KiB   backward +12.0 KiB", out)
    assert re.search(r"combine   forward +12.0 KiB   backward +4.0 KiB", out)
    assert "expert parallel: tokens' all-to-all (forward)" in out


K = 2


def _real_no_sync_micro_batch_equals_plan(rank, world, links, a2a):
    """A real K-micro-batch step under ``no_sync()`` at 'os_g', routing uniform: the first
    micro-batch sends its tokens' all-to-alls and the units' order agreement, no gradient
    (ring bytes, as the plan counts), and every
    micro-batch hands the all-to-alls the plan's bytes."""
    torch.manual_seed(0)
    model = builtin_factory(EXPERTS, TOP_K)()
    _force_routing(model, "uniform")
    groups = init_expert_groups(EP)
    apply_expert_parallel(model, groups)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, _ = zerokit.group_sharded_parallel(
        model, opt, "os_g", buffer_max_size=PlanConfig.buffer_max_size,
        segment_size=PlanConfig.segment_size,
    )  # fmt: skip
    calls = []  # (op, group size, bytes handed) as issued
    ops = ("all_to_all_single", "all_reduce", "all_gather", "all_gather_into_tensor",
           "reduce_scatter_tensor", "broadcast", "isend", "irecv")  # fmt: skip

    def record(op, tensor, args, kwargs):
        group = kwargs.get("group") or dist.group.WORLD
        sent = args[0] if op == "all_to_all_single" else tensor
        calls.append((op, group.size(), sent.numel() * sent.element_size(), sent.dtype))

    tokens = torch.randint(0, 256, (2, K, world, SEQ), generator=torch.Generator().manual_seed(1))
    for step in range(2):  # the second is the steady step the plan describes
        seen = []
        for m in range(K):
            calls.clear()
            mine = tokens[step, m, rank : rank + 1]
            with patched_collectives(ops, record):
                with model.no_sync() if m < K - 1 else contextlib.nullcontext():
                    model(input_ids=mine, labels=mine).loss.backward()
            seen.append(list(calls))
        opt.step()
        opt.zero_grad()
    first = seen[0]  # no gradient reduced: the tokens' exchange and the units' agreement
    assert {op for op, *_ in first} <= {"all_to_all_single", "all_reduce"}, (rank, first)
    ring = sum(
        round(nbytes * (n - 1) / n * (2 if op == "all_reduce" else 1)) for op, n, nbytes, _ in first
    )
    assert ring == links["no_sync"]["inner_micro_batch"]["within"], (rank, ring, links)
    for m, micro in enumerate(seen):
        handed = sum(b for op, _, b, dtype in micro if op == "all_to_all_single"
                     and dtype.is_floating_point)  # fmt: skip
        assert handed == sum(v for key, v in a2a.items() if key != "counts"), (rank, m)


def test_plan_with_accumulation_equals_a_real_no_sync_step():
    report = make_plan(
        PlanConfig(world=WORLD, level="os_g", ep=EP, seq=SEQ, experts=EXPERTS, top_k=TOP_K,
                   accumulation=K)
    )  # fmt: skip
    assert report["moe"]["micro_batches"] == K
    run_distributed(
        _real_no_sync_micro_batch_equals_plan, WORLD, report["links"], report["moe"]["all_to_all"]
    )
