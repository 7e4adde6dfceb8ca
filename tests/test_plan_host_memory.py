"""`zerokit plan`'s host-memory rows against the real operations: a first ``async_save``, a
``load`` and a ``consolidate`` run on 2 and 3 gloo ranks at every level, each one's peak host
allocation measured, within 10% of the plan's row for that rank (what the plan leaves out is
the ranks' agreement, a few KiB of JSON sent as byte tensors: 4-7% of these models' staging),
and the staging held after the save and ``consolidate``'s peak equal to it exactly. At tp 2,
an unsplit tensor is written by tp rank 0 alone and ``consolidate`` assembles the split ones.

The measure: the bytes torch's CPU allocator hands out on the calling thread during the
operation, net of what it frees, at their most (the profiler's allocation records with
``profile_memory``: each carries the allocator's running total of what was allocated while
profiling, so memory held from before is not counted and frees of it do not lower the total).
RSS would count page faults of the mapped checkpoint files, the allocator's caching and other
threads; Python objects (the index's JSON) are not tensors and are left out. The writer
thread of an async save only writes what the calling thread staged, so the calling thread is
where the staging is allocated.
"""

import os

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_distributed
from torch import nn
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

import zerokit
from zerokit import LEVELS, group_sharded_parallel
from zerokit.layout import init_hybrid_parallel
from zerokit.models.gpt import GPT, GPTConfig, synthetic_batch
from zerokit.tools.plan import PlanConfig, make_plan

WIDTH = 67  # odd: the shards are uneven at 2 and 3 ranks
ROWS = 6  # the global batch: 3 or 2 rows per rank


class Scaled(nn.Module):
    """A layer with a persistent buffer: a whole tensor, written by shard rank 0 alone."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, 2 * width)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 2 * width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x)) * self.scale


def scaled_mlp():
    """The job's model (``zerokit plan --model test_plan_host_memory:scaled_mlp``)."""
    torch.manual_seed(0)
    model = nn.Sequential(Scaled(WIDTH), nn.Linear(2 * WIDTH, WIDTH))

    def make_batch(step: int, batch: int):
        g = torch.Generator().manual_seed(step)
        return torch.randn(batch, WIDTH, generator=g), torch.randn(batch, WIDTH, generator=g)

    return model, make_batch


def gpt_tp(layout=None):
    """A small GPT for ``--tp`` (the plain one without a layout, its tp twin with one): its
    embedding and MLP split over tp, so ``consolidate`` assembles them."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64,
                    tensor_parallel=layout is not None)  # fmt: skip
    return GPT(cfg, layout)


def peak_allocated(fn) -> int:
    """The most bytes torch's CPU allocator held at once, of those it handed out on this
    thread while ``fn`` ran (see the module's docstring)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    records, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            fields = event.extra_fields
            records.append((event.start_time_ns, fields.alloc_size, fields.total_allocated))
    if not records:
        return 0
    records.sort()
    # the running total goes on from earlier profiling (the last operation's staging, held)
    _, size, total = records[0]
    before = total - size
    return max(0, *(total - before for _, _, total in records))


def _plan(world: int, level: str, model: str = "scaled_mlp", tp: int = 1) -> dict:
    return make_plan(
        PlanConfig(world=world, level=level, model=f"{__name__}:{model}", batch=ROWS, tp=tp)
    )


def _trained(level: str, rank: int, world: int):
    """The plan's job for real: the model wrapped at ``level`` after two AdamW steps."""
    model, make_batch = scaled_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, _ = group_sharded_parallel(model, opt, level)
    per = ROWS // world
    for step in range(2):
        x, y = (t[rank * per : (rank + 1) * per] for t in make_batch(step, ROWS))
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


def _within(measured: int, planned: int, what: str) -> None:
    # within 10% of the measured peak, as issue #44 asks
    assert abs(planned - measured) <= 0.10 * measured, (
        f"{what}: measured {measured}, planned {planned}"
    )


def _trained_tp(level: str, rank: int, world: int):
    """tp over the world: each rank its slices of ``gpt_tp``, ZeRO over nothing else."""
    from zerokit.tensor_parallel import ParallelCrossEntropy

    layout = init_hybrid_parallel(1, world)
    model, loss_fn = gpt_tp(layout), ParallelCrossEntropy(layout=layout)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, _ = group_sharded_parallel(model, opt, level, group=layout.dp_group)
    for step in range(2):
        x, y = synthetic_batch(256, ROWS, 16, seed=step)
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


def _measured_against_plan(rank, world, level: str, plan: dict, root: str, tp=False) -> None:
    """In a fresh process (the async save is its first: the staging is allocated now)."""
    model, opt = (_trained_tp if tp else _trained)(level, rank, world)
    planned = plan["ranks"][rank]["host_memory"]
    what = f"level {level!r}, rank {rank} of {world}"
    path = os.path.join(root, level)
    saved = peak_allocated(lambda: zerokit.checkpoint.async_save(path, model, opt).result())
    _within(saved, planned["async_save"], f"{what}: first async_save")
    held = zerokit.checkpoint.async_save_staging_bytes()
    assert held == planned["async_save"], f"{what}: the staging holds {held}"
    loaded = peak_allocated(lambda: zerokit.checkpoint.load(path, model, opt))
    _within(loaded, planned["load"], f"{what}: load")
    if rank == 0:  # consolidate runs in one process
        out = os.path.join(root, f"{level}.safetensors")
        done = peak_allocated(lambda: zerokit.checkpoint.consolidate(path, out))  # one file
        assert done == planned["consolidate"], f"{what}: consolidate allocated {done}"
    dist.barrier()


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_host_memory_rows_hold_the_measured_peaks(world, tmp_path):
    for level in LEVELS:
        plan = _plan(world, level)
        run_distributed(_measured_against_plan, world, level, plan, str(tmp_path))


@pytest.mark.parametrize(
    "level",
    [pytest.param(level, marks=[] if level == "p_g_os" else pytest.mark.slow) for level in LEVELS],
)
def test_tensor_parallel_rows_hold_the_measured_peaks(level, tmp_path):
    """tp 2: an unsplit tensor is written by tp rank 0 alone, and consolidate assembles the
    split ones (its only allocation)."""
    plan = _plan(2, level, "gpt_tp", tp=2)
    assert plan["ranks"][0]["host_memory"]["consolidate"] > 0
    run_distributed(_measured_against_plan, 2, level, plan, str(tmp_path), True)
