"""Bounded waits: every collective zerokit waits for gives up after the collective timeout
(``$ZEROKIT_COLLECTIVE_TIMEOUT``, default 60 s) with an error that names the call and the
ranks that are elsewhere, instead of gloo's 30 minutes with no rank named.

Each entry point (a forward, ``optimizer.step``, ``clip_grad_norm_``, a stage-3 state dict)
first *marks* where this rank is: one key per rank in the process group's store, overwritten
each time (``<count> <call>``), so nothing accumulates. When a wait times out, the marks say
which ranks never reached this call (still before it, or in another call).

A ``Presence`` owns one group's marks for its owner: the ``ShardState`` holds one for its
process group (every mark on the hot path is one store write, no read); a checkpoint call makes
its own for the world group. A new one continues the count the store holds for this rank, so
marks on one group count up whoever makes them. The store is the only record: a wait that
times out reads this rank's own mark back from it.

Note: a rank that is alive but busy outside zerokit (evaluating on rank 0 only) for longer than
the timeout looks the same as an absent one: raise ``$ZEROKIT_COLLECTIVE_TIMEOUT`` for such
jobs. The message says so.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch.distributed import ProcessGroup

from . import teardown
from .timeouts import CollectiveTimeout, collective_timeout

_NOTHING = "0 nothing"
_GONE = "? (unknown: the job's store is gone, rank 0 has left)"


def _key(group: ProcessGroup, rank: int) -> str:
    return f"zerokit/at/{group.group_name}/{rank}"


class Presence:
    """Where this rank is on ``group``: the count and name of its last zerokit call there."""

    def __init__(self, group: ProcessGroup):
        self.group = group
        self._count = 0
        if group.size() > 1:  # continue from the store's record (one read, here only)
            store = dist.distributed_c10d._get_default_store()
            count = _mark_of(store, group, group.rank()).partition(" ")[0]
            self._count = int(count) if count.isdigit() else 0

    def mark(self, what: str) -> None:
        """This rank enters ``what``, its next zerokit call on the group."""
        if self.group.size() == 1:
            return
        self._count += 1
        store = dist.distributed_c10d._get_default_store()
        store.set(_key(self.group, self.group.rank()), f"{self._count} {what}")


def where(group: ProcessGroup, ranks: list[int]) -> str:
    """Where the group's ``ranks`` (group ranks) last were, e.g. "rank 1 is at call #2
    (optimizer.step())"."""
    store, members = dist.distributed_c10d._get_default_store(), dist.get_process_group_ranks(group)
    return "; ".join(_at(members[r], _mark_of(store, group, r)) for r in ranks)


def _mark_of(store, group: ProcessGroup, r: int) -> str:
    try:
        key = _key(group, r)
        return store.get(key).decode() if store.check([key]) else _NOTHING
    except RuntimeError:  # the store is gone: its host (global rank 0) has left
        return _GONE


def _at(global_rank: int, mark: str) -> str:
    n, _, what = mark.partition(" ")
    return f"rank {global_rank} is at call #{n} ({what})"


def wait(work, group: ProcessGroup) -> None:
    """``work.wait()``, bounded by the collective timeout."""
    timeout = collective_timeout()
    try:
        work.wait(timedelta(seconds=timeout))
    except RuntimeError as e:
        # Timed out, or gloo's transport failed because the rank paired with this one left
        # ("Connection reset by peer") or sent another collective ("data size doesn't
        # match"): either way some rank is in another call. Name it, not the socket.
        timed_out = "timed out" in str(e).lower()
        failed = (
            None if timed_out else "the collective failed: a rank in it left or is in another one"
        )
        error = _timed_out(group, timeout, failed)
        teardown.abandoned(error.call)
        teardown.timed_out(timeout)
        raise error from None


def _timed_out(group: ProcessGroup, timeout: float, failed: str | None = None):
    store = dist.distributed_c10d._get_default_store()
    members = dist.get_process_group_ranks(group)
    mine = _mark_of(store, group, group.rank())
    if mine == _NOTHING:
        mine = "0 (no zerokit call)"
    count, _, call = mine.partition(" ")
    elsewhere = []
    for r, global_rank in enumerate(members):
        if r == group.rank():
            continue
        theirs = _mark_of(store, group, r)
        if theirs != mine or theirs == _GONE:
            elsewhere.append((global_rank, _at(global_rank, theirs)))
    if elsewhere:
        detail = "; ".join(text for _, text in elsewhere)
    else:
        detail = (
            "every rank reached it, but the collective did not complete (a rank-dependent branch?)"
        )
    waited = f"waited {timeout:g} s for the other ranks" if failed is None else failed
    message = (
        f"{call} (zerokit call #{count} on this group): {waited}; {detail}. Every rank must "
        "make the same calls in the same order. A rank busy "
        "elsewhere for longer (e.g. evaluating on rank 0 only) needs a larger "
        "$ZEROKIT_COLLECTIVE_TIMEOUT"
    )
    error = CollectiveTimeout(message, [g for g, _ in elsewhere])
    error.call = call
    return error
