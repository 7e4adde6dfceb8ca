"""Each group reduces its own gradients, counted on the wire: at world 4 with ep 2, a
backward's gradient bytes on the expert-data-parallel group (2 ranks) are exactly the expert
buckets' reduce-scatter, and on the world exactly the dense buckets'; the tokens' all-to-all
runs on the ep group only. (A planted bug reducing the experts over the whole world moves
their bytes to the world group and fails here, as it fails test_moe's equality.)

The counting wraps ``torch.distributed``'s entry points (as test_step_bytes does), recording
each call's group with the bytes it sends.
"""

from __future__ import annotations

import collections
import contextlib

import torch
import torch.distributed as dist
from counting import patched_collectives
from dist_helpers import run_distributed
from moe_models import batches, tiny_moe

import zerokit
from zerokit.core import state_of
from zerokit.moe import apply_expert_parallel, init_expert_groups

_OPS = ("isend", "all_reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all_single")


@contextlib.contextmanager
def counting(names):
    """(op, group's name, bytes of the tensor sent) for every call this rank makes."""
    calls = collections.Counter()

    def record(op, tensor, args, kwargs):
        group = kwargs.get("group") or dist.group.WORLD
        sent = tensor if op != "all_to_all_single" else args[0]  # its input
        calls[(op, names.get(id(group), "other"))] += sent.numel() * sent.element_size()

    with patched_collectives(_OPS, record):
        yield calls


def _run(rank, world, ep, level):
    groups = init_expert_groups(ep)
    model = tiny_moe("mixtral")
    apply_expert_parallel(model, groups)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt, _ = zerokit.group_sharded_parallel(model, opt, level, segment_size=10)
    names = {
        id(dist.group.WORLD): "dense",
        id(groups.expert_dp_group): "experts",
        id(groups.ep_group): "ep",
    }
    tokens = batches(2, 2 * world)
    for step, batch in enumerate(tokens):
        mine = batch[2 * rank : 2 * rank + 2]
        loss = model(input_ids=mine, labels=mine).loss
        with counting(names) if step else contextlib.nullcontext() as calls:
            loss.backward()
        opt.step()
        opt.zero_grad()
    # gloo's reduce-scatter: each peer is sent its chunk of the padded bucket
    want = collections.Counter()
    for b in state_of(model).buckets:
        size = b.group.size()
        name = names[id(b.group)]
        want[("isend", name)] += b.layout.padded_numel * 4 * (size - 1) // size
    got = {k: v for k, v in calls.items() if k[0] == "isend"}
    assert got == dict(want), f"rank {rank} level {level}: sent {got}, expected {dict(want)}"
    assert want[("isend", "experts")] > 0 and want[("isend", "dense")] > 0
    a2a = {k[1] for k in calls if k[0] == "all_to_all_single"}
    assert a2a == {"ep"}, f"the tokens' all-to-all ran on {a2a}"


def test_world4_ep2_each_group_reduces_its_own():
    run_distributed(_run, 4, 2, "os_g")
