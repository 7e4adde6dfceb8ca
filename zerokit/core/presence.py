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


def wait(work, group: ProcessGroup) -> None:
    """``work.wait()``, bounded by the collective timeout."""
    from .agreement import collective_timeout  # agreement imports collectives, which import this

    timeout = collective_timeout()
    try:
        work.wait(timedelta(seconds=timeout))
    except RuntimeError as e:
        if "timed out" not in str(e).lower():
            raise
        raise _timed_out(group, timeout) from None


def _timed_out(group: ProcessGroup, timeout: float):
    from .agreement import CollectiveTimeout

    store = dist.distributed_c10d._get_default_store()
    members = dist.get_process_group_ranks(group)
    mine = _where.get(group, "0 (no zerokit call)")
    count, _, call = mine.partition(" ")
    elsewhere = []
    for r, global_rank in enumerate(members):
        if r == group.rank():
            continue
        theirs = (
            store.get(_key(group, r)).decode() if store.check([_key(group, r)]) else "0 nothing"
        )
        if theirs != mine:
            n, _, what = theirs.partition(" ")
            elsewhere.append((global_rank, f"rank {global_rank} is at call #{n} ({what})"))
    if elsewhere:
        detail = "; ".join(text for _, text in elsewhere)
    else:
        detail = (
            "every rank reached it, but the collective did not complete (a rank-dependent branch?)"
        )
    message = (
        f"{call} (zerokit call #{count} on this group): waited {timeout:g} s for the other "
        f"ranks; {detail}. Every rank must make the same calls in the same order. A rank busy "
        "elsewhere for longer (e.g. evaluating on rank 0 only) needs a larger "
        "$ZEROKIT_COLLECTIVE_TIMEOUT"
    )
    return CollectiveTimeout(message, [g for g, _ in elsewhere])
