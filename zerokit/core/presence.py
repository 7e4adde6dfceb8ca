"""Bounded waits: every collective zerokit waits for gives up after the collective timeout
(``$ZEROKIT_COLLECTIVE_TIMEOUT``, default 60 s) with an error that names the call and the
ranks that are elsewhere, instead of gloo's 30 minutes with no rank named.

Each entry point (a forward, ``optimizer.step``, ``clip_grad_norm_``, a stage-3 state dict)
first *marks* where this rank is: one key per rank in the process group's store, overwritten
each time (``<count> <call>``), so nothing accumulates. When a wait times out, the marks say
which ranks never reached this call (still before it, or in another call).

Note: a rank that is alive but busy outside zerokit (evaluating on rank 0 only) for longer than
the timeout looks the same as an absent one: raise ``$ZEROKIT_COLLECTIVE_TIMEOUT`` for such
jobs. The message says so.
"""

from __future__ import annotations

import weakref
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import ProcessGroup

from . import teardown
from .timeouts import CollectiveTimeout, collective_timeout

_counts: weakref.WeakKeyDictionary[ProcessGroup, int] = weakref.WeakKeyDictionary()
_where: weakref.WeakKeyDictionary[ProcessGroup, str] = weakref.WeakKeyDictionary()


def _key(group: ProcessGroup, rank: int) -> str:
    return f"zerokit/at/{group.group_name}/{rank}"


def mark(group: ProcessGroup, what: str) -> None:
    """This rank enters ``what``, its next zerokit call on ``group``."""
    if group.size() == 1:
        return
    n = _counts.get(group, 0) + 1
    _counts[group], _where[group] = n, f"{n} {what}"
    dist.distributed_c10d._get_default_store().set(_key(group, group.rank()), _where[group])


def where(group: ProcessGroup, ranks: list[int]) -> str:
    """Where the group's ``ranks`` (group ranks) last were, e.g. "rank 1 is at call #2
    (optimizer.step())"."""
    store, members = dist.distributed_c10d._get_default_store(), dist.get_process_group_ranks(group)
    return "; ".join(_at(members[r], _mark_of(store, group, r)) for r in ranks)


def _mark_of(store, group: ProcessGroup, r: int) -> str:
    try:
        key = _key(group, r)
        return store.get(key).decode() if store.check([key]) else "0 nothing"
    except RuntimeError:  # the store is gone: its host (global rank 0) has left
        return "? (unknown: the job's store is gone, rank 0 has left)"


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
    mine = _where.get(group, "0 (no zerokit call)")
    count, _, call = mine.partition(" ")
    elsewhere = []
    for r, global_rank in enumerate(members):
        if r == group.rank():
            continue
        theirs = _mark_of(store, group, r)
        if theirs != mine:
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
