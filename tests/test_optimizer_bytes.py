"""No extra bytes for a whole-parameter optimizer (issue 31, item 5), measured on real gloo
ranks: in one steady training step (the second: forward, backward, every optimizer's step and
zero_grad), the bytes zerokit's collectives move, summed over the ranks, with Muon for the blocks' matrices beside
AdamW for the rest equal those with AdamW alone over the same parameters, within 5 %, at every
level, world 2 and 3. The owner layout moves no parameter for the step: at 'p_g_os' the step
sends nothing at all (the owner's shard is the whole matrix), below it the step spreads the
updated shards exactly as AdamW's does.

The bytes are counted where torch.distributed is called (every collective zerokit issues on
gloo: the reduce-scatter's sends and receives, a broadcast per rank, the agreement's
all-reduces): each call's
tensors, numel x element size. The 5 % is for padding and bucket edges only: the two runs
bucket the same parameters differently (buckets never mix optimizers), so padding to the
world size differs by a few elements per bucket.
"""

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_distributed
from models import MatrixNet, global_batches, local_slice, loss_fn, make_optimizers

import zerokit

LEVEL_OPTIONS = {"os": {"buffer_max_size": 2000}, "os_g": {"buffer_max_size": 2000},
                 "p_g_os": {"segment_size": 10}}  # fmt: skip
# torch.distributed's collectives zerokit calls -> the tensors a call moves
MOVED = {
    "all_reduce": lambda t, *a, **k: [t],
    "reduce": lambda t, *a, **k: [t],
    "broadcast": lambda t, *a, **k: [t],
    "all_gather": lambda out, *a, **k: list(out),
    "all_gather_into_tensor": lambda out, *a, **k: [out],
    "reduce_scatter": lambda out, parts, *a, **k: list(parts),
    "reduce_scatter_tensor": lambda out, full, *a, **k: [full],
    "isend": lambda t, *a, **k: [t],  # gloo's reduce-scatter: a chunk to each peer
    "irecv": lambda t, *a, **k: [t],  # and each peer's chunk of this rank's shard
}


class ByteCounter:
    """Wraps torch.distributed's collectives (and the flat-tensor aliases zerokit's
    collectives module bound at import) to add up the bytes of each call, by phase."""

    def __init__(self):
        self.phase: str | None = None
        self.bytes: dict[str, int] = {}

    def install(self) -> None:
        """In a forked rank: its patches end with it."""
        from zerokit.core import collectives

        for name, moved in MOVED.items():
            wrapped = self._wrap(getattr(dist, name), moved)
            setattr(dist, name, wrapped)
        for alias, name in (("_reduce_scatter", "reduce_scatter_tensor"),
                            ("_all_gather", "all_gather_into_tensor")):  # fmt: skip
            wrapped = self._wrap(getattr(collectives, alias), MOVED[name])
            setattr(collectives, alias, wrapped)

    def _wrap(self, fn, moved):
        def counting(*args, **kwargs):
            if self.phase is not None:
                n = sum(t.numel() * t.element_size() for t in moved(*args, **kwargs))
                self.bytes[self.phase] = self.bytes.get(self.phase, 0) + n
            return fn(*args, **kwargs)

        return counting


def _adamw_alone(model):
    return [torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)]


def _steady_step_bytes(rank, world, level, kind, counter) -> dict[str, int]:
    torch.manual_seed(0)
    model = MatrixNet()
    optimizers = make_optimizers("muon", model) if kind == "muon" else _adamw_alone(model)
    model, optimizers, _ = zerokit.group_sharded_parallel(
        model, optimizers, level, **LEVEL_OPTIONS[level]
    )
    for t, (x, y) in enumerate(global_batches(2, batch=4 * world)):
        counter.phase, counter.bytes = ("train" if t == 1 else None), {}
        loss = loss_fn(model(local_slice(x, rank, world)), local_slice(y, rank, world))
        loss.backward()
        if t == 1:
            counter.phase = "step"
        for opt in optimizers:
            opt.step()
        for opt in optimizers:
            opt.zero_grad()
    counter.phase = None
    return dict(counter.bytes)


def _same_bytes(rank, world):
    counter = ByteCounter()
    counter.install()
    for level in ("os", "os_g", "p_g_os"):
        muon = _steady_step_bytes(rank, world, level, "muon", counter)
        adamw = _steady_step_bytes(rank, world, level, "adamw", counter)
        what = f"{level} world {world} rank {rank}: Muon+AdamW {muon}, AdamW {adamw}"
        # The world's bytes, summed over ranks: with uneven owner shards a rank receives what
        # its own shard needs (an owner, its whole matrices' gradients), so one rank's count
        # moves with its shard's size while the world's does not.
        counts = [
            sum(muon.values()),
            sum(adamw.values()),
            muon.get("step", 0),
            adamw.get("step", 0),
        ]
        world_counts = torch.tensor(counts, dtype=torch.float64)
        dist.all_reduce(world_counts)  # not counted: counter.phase is None here
        total_m, total_a, step_m, step_a = world_counts.tolist()
        numel = sum(p.numel() for p in MatrixNet().parameters())
        assert total_a > 4 * numel * world, what  # counted
        assert abs(total_m - total_a) <= 0.05 * total_a, what
        assert abs(step_m - step_a) <= 0.05 * max(step_a, 1), what
        if level == "p_g_os":  # nothing gathered for the step: the owner holds the matrix
            assert step_m == 0, what


@pytest.mark.parametrize("world", [2, 3])
def test_muon_beside_adamw_sends_the_bytes_adamw_alone_sends(world):
    run_distributed(_same_bytes, world)
