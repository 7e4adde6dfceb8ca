"""The few collectives zerokit needs, chosen per backend, as ``start_*`` / ``finish`` pairs.

Every function takes the process group explicitly and does no communication at world size 1.

Note: on gloo (CPU) the textbook collectives are the slow path. torch 2.13's gloo
``reduce_scatter`` clones its input, runs a full all-reduce and copies one chunk out: twice a
ring reduce-scatter's bytes. Its ``all_gather_into_tensor`` gathers into a temporary list.
Measured on 2 ranks of this machine (``benchmarks/collectives.py``, 16 MB fp32 at 2 and
3 ranks, bytes from ``/proc/net/dev``): reduce_scatter 44 ms and 1.00x the buffer sent per
rank; one in-place reduce per owner 19 ms, 1.00x; all-to-all + a local sum 15 ms, 0.50x;
one send and one receive per peer 9 ms, 0.50x (at 3 ranks: 61, 31, 22, 20 ms; 1.34x, 0.89x,
0.68x, 0.67x). So on gloo a reduce-scatter is one ``isend`` of each peer's chunk and one
``irecv`` of this rank's chunk from each peer into a receive buffer of (N-1) chunks, then a
local sum: the ring's bytes, Psi(N-1)/N per rank, and (N-1)/N of the bucket to receive into
(the staging pool lends it: ``reduce_scatter_scratch_numel``). An all-gather is one broadcast
per rank straight into the full buffer (all_gather_into_tensor 24 ms, broadcasts 15 ms at
13 MB). Other backends (NCCL) use their native reduce-scatter and all-gather.

Note: the order of the gloo sum is defined: each chunk is summed over ranks 0..N-1 in rank
order, in the buffer's dtype (the reduce dtype), then divided by N. At 2 ranks that is the
one addition gloo's reduce made (a + b == b + a exactly), so results are bitwise those of the
per-owner reduce it replaces; at 3 or more ranks gloo's own order was not defined.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..runtime import presence, teardown
from ..runtime.teardown import hand
from .eager import eager
from .stand_in import is_stand_in

# torch 2.13 renamed the flat-tensor collectives and deprecated the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


class Pending:
    """In-flight collective work; ``finish()`` waits for it (bounded: ``presence.wait``) and
    runs the local epilogue once."""

    def __init__(
        self,
        works: list,
        epilogue: Callable[[], None] | None = None,
        group: ProcessGroup | None = None,
    ):
        self._works = works
        self._epilogue = epilogue
        self._group = group

    def then(self, fn: Callable[[], None]) -> Pending:
        """Run ``fn`` after the epilogue, when the work is finished."""
        first = self._epilogue

        def chained() -> None:
            if first is not None:
                first()
            fn()

        self._epilogue = chained
        return self

    @eager
    def finish(self) -> None:
        for work in self._works:
            presence.wait(work, self._group)
        self._works = []
        if self._epilogue is not None:
            epilogue, self._epilogue = self._epilogue, None
            epilogue()


def _is_gloo(group: ProcessGroup, device: torch.device | str = "cpu") -> bool:
    """Does ``group`` run collectives on ``device`` tensors with gloo?

    Decided from the backend the group really holds for the device, not from its name:
    ``init_process_group()`` without a backend makes a group named 'undefined' that runs CPU
    tensors on gloo and CUDA tensors on NCCL.
    """
    try:
        return group._get_backend(torch.device(device)).name() == "gloo"
    except (RuntimeError, AttributeError):  # no backend for that device (or an older torch)
        return dist.get_backend(group) == "gloo"


def communication_device(group: ProcessGroup) -> torch.device:
    """A device whose tensors ``group`` can reduce: the CPU where it has gloo (or is a dry
    run's stand-in), else CUDA."""
    cpu = is_stand_in(group) or _is_gloo(group, "cpu")
    return torch.device("cpu") if cpu else torch.device("cuda")


@eager
def start_all_reduce_mean(tensor: torch.Tensor, group: ProcessGroup) -> Pending:
    """Average ``tensor`` in place across ``group``."""
    size = group.size()
    if size == 1:
        return Pending([])
    work = dist.all_reduce(hand(tensor), group=group, async_op=True)
    return Pending([work], lambda: tensor.div_(size), group)


Ranges = list[tuple[int, int]] | None  # each rank's [start, end) of a flat buffer; None: equal


def _chunks(full: torch.Tensor, size: int, ranges: Ranges) -> list[torch.Tensor]:
    """Each rank's chunk of the 1-D ``full``: equal, or the owner layout's uneven ranges."""
    if ranges is None:
        return list(full.view(size, -1))
    return [full[start:end] for start, end in ranges]


def reduce_scatter_scratch_numel(
    group: ProcessGroup, numel: int, device: torch.device, ranges: Ranges = None
) -> int:
    """Elements of the receive buffer ``start_reduce_scatter_mean`` needs for a ``numel``-element
    buffer on ``device``: (N-1) of this rank's chunk on gloo, none elsewhere (NCCL receives
    into the shard-sized output) or at world size 1."""
    size = group.size()
    if size == 1 or is_stand_in(group) or not _is_gloo(group, device):
        return 0
    if ranges is None:
        return numel // size * (size - 1)
    start, end = ranges[group.rank()]
    return (end - start) * (size - 1)


@eager
def start_reduce_scatter_mean(
    full: torch.Tensor,
    shard: torch.Tensor,
    group: ProcessGroup,
    accumulate: bool,
    *,
    ranges: Ranges = None,
    scratch: torch.Tensor | None = None,
) -> Pending:
    """Average the 1-D ``full`` across ``group`` and write (or add) this rank's chunk to ``shard``.

    ``full`` holds ``group.size()`` equal chunks, or the chunks ``ranges`` gives (uneven: the
    owner layout); it is the collective's scratch: its contents are undefined once the work is
    started, and it must stay alive until ``finish()``. ``scratch``: where gloo receives the
    peers' chunks (``reduce_scatter_scratch_numel`` elements of ``full``'s dtype, alive until
    ``finish()``); None: allocated here.
    """
    size = group.size()
    chunks = _chunks(full, size, ranges)
    if size == 1:
        works, reduced = [], lambda: chunks[0]
    elif _is_gloo(group, full.device):
        works, reduced = _start_peer_reduce_scatter(chunks, group, scratch)
    else:
        out = torch.empty(shard.numel(), dtype=full.dtype, device=full.device)
        if ranges is None:
            works = [_reduce_scatter(hand(out), hand(full), group=group, async_op=True)]
        else:  # uneven chunks: torch's list form (NCCL runs it as grouped reduces)
            chunk_list = teardown.hand_all(chunks)
            works = [dist.reduce_scatter(hand(out), chunk_list, group=group, async_op=True)]
        reduced = lambda: out  # noqa: E731

    def epilogue() -> None:
        total = reduced()  # this rank's summed chunk
        if size > 1:
            total.div_(size)  # in place: the chunk is ours to overwrite
        local = total.to(shard.device)  # offload: the gradient shard is in CPU memory
        shard.add_(local) if accumulate else shard.copy_(local)

    return Pending(works, epilogue, group)


def _start_peer_reduce_scatter(
    chunks: list[torch.Tensor], group: ProcessGroup, scratch: torch.Tensor | None
) -> tuple[list, Callable[[], torch.Tensor]]:
    """gloo: send each peer its chunk, receive this rank's chunk from each peer (ring bytes,
    module note); returns the works and the local sum to run once they finish."""
    size, rank = group.size(), group.rank()
    own = chunks[rank]
    if not own.numel():  # an owner with nothing in this bucket receives nothing
        received = [own] * size
    else:
        need = own.numel() * (size - 1)
        if scratch is None:
            scratch = torch.empty(need, dtype=own.dtype, device=own.device)
        parts = iter(scratch[:need].view(size - 1, -1))
        received = [own if r == rank else next(parts) for r in range(size)]
    works = []
    for k in range(1, size):  # peer rank+k first: every pair exchanges in one step
        to, source = (rank + k) % size, (rank - k) % size
        if chunks[to].numel():
            works.append(dist.isend(hand(chunks[to]), group_dst=to, group=group))
        if own.numel():
            works.append(dist.irecv(hand(received[source]), group_src=source, group=group))

    def rank_order_sum() -> torch.Tensor:
        """Sum over ranks 0..N-1 in rank order into ``own`` (the ranks before this one are
        summed into the first received part, then added to ``own``: a + b == b + a)."""
        if own.numel():
            if rank > 0:
                before = received[0]
                for part in received[1:rank]:
                    before.add_(part)
                own.add_(before)
            for part in received[rank + 1 :]:
                own.add_(part)
        return own

    return works, rank_order_sum


@eager
def start_all_gather_(full: torch.Tensor, group: ProcessGroup, *, ranges: Ranges = None) -> Pending:
    """Fill the 1-D ``full`` in place from every rank's own chunk of it (equal chunks, or the
    uneven ``ranges`` of the owner layout)."""
    size = group.size()
    if size == 1:
        return Pending([])
    chunks = _chunks(full, size, ranges)
    if _is_gloo(group, full.device):
        works = [
            dist.broadcast(hand(chunks[r]), group_src=r, group=group, async_op=True)
            for r in range(size)
            if chunks[r].numel()
        ]
    elif ranges is None:
        own = chunks[group.rank()]
        works = [_all_gather(hand(full), hand(own), group=group, async_op=True)]
    else:  # uneven chunks: torch's list form (NCCL runs it as grouped broadcasts)
        own = chunks[group.rank()]
        chunk_list = teardown.hand_all(chunks)
        works = [dist.all_gather(chunk_list, hand(own), group=group, async_op=True)]
    return Pending(works, group=group)


@eager
def start_all_reduce_(
    tensor: torch.Tensor, group: ProcessGroup, op: dist.ReduceOp = dist.ReduceOp.SUM
) -> Pending:
    """In-place all-reduce, started; ``finish()`` waits for it. A no-op at world size 1."""
    if group.size() == 1:
        return Pending([])
    return Pending([dist.all_reduce(hand(tensor), op=op, group=group, async_op=True)], group=group)


@eager
def all_reduce_(tensor: torch.Tensor, group: ProcessGroup, op: dist.ReduceOp = dist.ReduceOp.SUM):
    """Blocking (bounded) in-place all-reduce; a no-op at world size 1."""
    start_all_reduce_(tensor, group, op).finish()
    return tensor


@eager
def broadcast_(tensor: torch.Tensor, group: ProcessGroup, group_src: int = 0) -> torch.Tensor:
    """Blocking in-place broadcast from the group's rank ``group_src``; a no-op at world size 1."""
    if group.size() > 1:
        work = dist.broadcast(hand(tensor), group_src=group_src, group=group, async_op=True)
        presence.wait(work, group)
    return tensor


@eager
def all_gather_bytes(data: bytes, group: ProcessGroup | None) -> list[bytes]:
    """Every rank's ``data``, in rank order (no pickle: raw bytes in uint8 tensors)."""
    if group is None or group.size() == 1:
        return [data]
    device = communication_device(group)
    length = torch.tensor([len(data)], dtype=torch.long, device=device)
    lengths = teardown.hand_all([torch.empty_like(length) for _ in range(group.size())])
    dist.all_gather(lengths, hand(length), group=group)
    longest = max(int(n) for n in lengths)
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
    gathered = teardown.hand_all([torch.empty_like(mine) for _ in lengths])
    dist.all_gather(gathered, hand(mine), group=group)
    return [bytes(t[: int(n)].cpu().tolist()) for t, n in zip(gathered, lengths)]
