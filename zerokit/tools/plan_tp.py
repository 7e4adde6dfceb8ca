"""Tensor parallelism on fake tensors, for ``zerokit plan``'s estimates: the tp model built
for one tp rank with a stand-in layout (no process group behind it), and stand-ins for the
``torch.distributed`` collectives its layers call in a forward, loss and backward (they record
and move nothing). The plan's activation estimate runs that forward; the collectives it
reports come from the dry run (``zerokit.tools.dry_run``), which runs the real layers over real
(stand-in) process groups.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch.distributed as dist

from ..layout import Layout


class StandInGroup:
    """What the tp layers ask of a process group: its size and this rank's place in it."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def stand_in_layout(tp: int, tp_rank: int, dp: int) -> Layout:
    """A ``Layout`` for building tp rank ``tp_rank``'s model: no process group behind it."""
    return Layout(
        dp_degree=dp,
        tp_degree=tp,
        dp_rank=0,
        tp_rank=tp_rank,
        dp_group=StandInGroup(dp, 0),
        tp_group=StandInGroup(tp, tp_rank),
    )


@contextlib.contextmanager
def recording_tp_collectives(out: list[tuple[str, int, int]]) -> Iterator[None]:
    """Within: ``torch.distributed``'s collectives on a ``StandInGroup`` append
    ``(op, group size, bytes of the logical collective)`` to ``out`` and do nothing else.
    Bytes as ``zerokit.tools.plan.Collective`` counts them: an all-reduce's tensor, an all-gather's
    output; an all-to-all's input."""

    def all_reduce(tensor, op=None, group=None, async_op=False):
        out.append(("all_reduce", group.size(), tensor.nbytes))

    def all_gather(parts, tensor, group=None, async_op=False):
        out.append(("all_gather", group.size(), sum(p.nbytes for p in parts)))

    def all_to_all_single(output, input, *args, group=None, **kwargs):
        out.append(("all_to_all", group.size(), input.nbytes))

    def vocab_start(local_vocab, group):  # its values are not needed on fake tensors
        out.append(("all_reduce", group.size(), group.size() * 8))  # an int64 per tp rank
        return 0

    with (
        mock.patch.object(dist, "all_reduce", all_reduce),
        mock.patch.object(dist, "all_gather", all_gather),
        mock.patch.object(dist, "all_to_all_single", all_to_all_single),
        mock.patch("zerokit.tensor_parallel.cross_entropy.vocab_start", vocab_start),
    ):
        yield
