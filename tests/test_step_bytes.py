"""Bytes per step on the wire, counted from the calls, not timed: the gradient reduce-scatter
of 'os', 'os_g' and 'p_g_os' sends each rank Psi(N-1)/N bytes (a ring's), on gloo as on NCCL,
and a step of 'os' moves 2Psi(N-1)/N per rank, DDP's (3Psi(N-1)/N with ``whole_grads=True``).

The counting group is gloo itself with ``torch.distributed``'s entry points wrapped: each call
is recorded with the bytes of the tensor it sends (``isend``) or hands to a collective.
"""

from __future__ import annotations

import collections
import contextlib

import pytest
import torch
from counting import patched_collectives
from dist_helpers import run_distributed
from torch import nn

import zerokit
from zerokit.core.state import state_of
from zerokit.memory import paper_bytes_per_step

_OPS = (
    "isend",
    "irecv",
    "reduce",
    "all_reduce",
    "broadcast",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_gather",
    "all_gather_into_tensor",
    "all_to_all_single",
)


@contextlib.contextmanager
def counting():
    """Record (op, bytes of its first tensor argument) for every collective this rank calls."""
    calls: list[tuple[str, int]] = []

    def record(op, tensor, args, kwargs):
        tensors = [tensor] if isinstance(tensor, torch.Tensor) else tensor  # a list form
        calls.append((op, sum(t.numel() * t.element_size() for t in tensors)))

    with patched_collectives(_OPS, record):
        yield calls


def _model() -> nn.Module:
    torch.manual_seed(0)  # sizes no world size divides: the buckets are padded
    return nn.Sequential(
        nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 11), nn.Tanh(), nn.Linear(11, 3)
    )


def _run(rank, world_size, level, out, whole_grads=False):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = zerokit.ShardingConfig(whole_grads=whole_grads)
    model, opt, _ = zerokit.group_sharded_parallel(
        model, opt, level, buffer_max_size=60, config=config
    )
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(rank))
    for step in range(2):  # the second step is recorded
        with counting() if step else contextlib.nullcontext() as calls:
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    buckets = state_of(model).buckets
    padded = sum(b.layout.padded_numel for b in buckets)
    sent = collections.Counter()
    for op, nbytes in calls:
        sent[op] += nbytes
    params = sum(len(b.params) for b in buckets)
    out.put((rank, padded, dict(sent), len(buckets), params))


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_reduce_scatter_sends_ring_bytes(world_size):
    import multiprocessing

    queue = multiprocessing.get_context("fork").SimpleQueue()
    for level in ("os", "os_g", "p_g_os"):
        run_distributed(_run, world_size, level, queue)
        for _ in range(world_size):
            rank, padded, sent, buckets, params = queue.get()
            assert buckets > 1, "several buckets: each is reduced on its own"
            # A ring reduce-scatter: each rank sends every peer that peer's chunk once,
            # Psi (N-1)/N bytes of fp32 gradients, and receives as much; nothing else reduces.
            ring = padded * 4 * (world_size - 1) // world_size
            assert sent.get("isend") == ring, (level, rank, sent, ring)
            assert sent.get("irecv") == ring, (level, rank, sent, ring)
            for op in ("reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all_single"):
                assert op not in sent, (level, rank, sent)
            # The only all-reduce: which parameters hold a gradient, one byte each. At
            # 'os' and 'os_g' the forward also agrees the unit order (two int64s, every step);
            # at 'p_g_os' only when a rank's order changed, so not in this steady step.
            order = 0 if level == "p_g_os" else 16
            assert sent.get("all_reduce") == params + order, (level, rank, sent, params)


@pytest.mark.parametrize("world_size", [2, 3])
def test_stage1_step_sends_ddp_bytes(world_size):
    """A step of 'os' moves what DDP's all-reduce moves, the ZeRO paper's 2Psi(N-1)/N per rank:
    the gradients reduce-scattered, the updated shards all-gathered. ``whole_grads=True``
    all-reduces the gradients instead (2Psi(N-1)/N on a ring) before the same all-gather."""
    import multiprocessing

    queue = multiprocessing.get_context("fork").SimpleQueue()
    for whole, volume in ((False, 2), (True, 3)):
        run_distributed(_run, world_size, "os", queue, whole)
        for _ in range(world_size):
            rank, padded, sent, _, params = queue.get()
            what = (f"whole_grads={whole}", rank, sent)
            psi = padded * 4  # fp32 bytes of every bucket, padding included
            flags = params + 16  # which parameters hold a gradient; the unit order (int64s)
            # gloo all-gathers by one broadcast per rank: every chunk but this rank's comes in
            gathered = sent["broadcast"] - psi // world_size
            # a ring all-reduce sends its tensor's (N-1)/N twice (reduce-scatter, all-gather)
            all_reduced = (sent["all_reduce"] - flags) * 2 * (world_size - 1) // world_size
            moved = sent.get("isend", 0) + all_reduced + gathered
            assert moved == paper_bytes_per_step("os", padded, world_size, 4) * volume // 2, what
            if whole:
                assert "isend" not in sent and sent["all_reduce"] == psi + flags, what
            else:  # the gradients only reduce-scattered: no all-reduce of them
                assert sent["all_reduce"] == flags, what
