"""Agree or fail fast: collective checks that every rank of a group holds the same values,
and that every rank is there at all, within a bounded time.

``gather(what, value, group)`` returns every rank's bytes, or raises ``CollectiveTimeout`` on
every rank that came, naming the call and the ranks that did not come, after ``timeout``
seconds (argument, else ``$ZEROKIT_COLLECTIVE_TIMEOUT``, else 60) instead of gloo's 30 minutes.
``agree(what, value, group)`` raises the same ``AgreementError`` on every rank when the ranks'
values differ, naming which ranks hold which value.

Note: a plain collective cannot tell "slow" from "absent", and gloo's own timeout names no
rank. So every call first meets in the process group's key-value store: each rank sets
``here/<rank>`` and counts itself in; the last one in writes the verdict ``ok``. A rank that
waits past the timeout writes the verdict ``missing <ranks>`` instead. The verdict key is
written with compare-and-set, so exactly one verdict wins and every rank, including one that
arrives late, reads the same one: all proceed together, or all raise the same error. Only
then do the values travel, by an ordinary all-gather (every rank is known to be in it). Calls
are numbered per group, by a counter per rank kept in the store itself (no state in this
process); every rank of a group makes the same calls in the same order, so the numbers match
(a rank that arrives late reads the old verdict and raises, and stays in step).

A rank that is inside the same work but slow (writing a large shard) is not missing: inside
``with alive(group):`` a thread bumps the rank's heartbeat counter in the store every second,
and a waiter that times out gives more time to the absent ranks whose counter still moves.
So the timeout bounds how long a rank that never came (or died) is waited for, not how long
the work may take.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..runtime import presence, teardown
from ..runtime.timeouts import TIMEOUT_ENV, AgreementError, CollectiveTimeout, collective_timeout
from .collectives import all_gather_bytes
from .stand_in import is_stand_in

_PREFIX = "zerokit/agree"
BEAT_SECONDS = 1.0


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _store():
    return dist.distributed_c10d._get_default_store()  # the store every group is built on


def _beat_key(group: ProcessGroup, rank: int) -> str:
    return f"{_PREFIX}/{group.group_name}/beat/{rank}"


@contextmanager
def alive(group: ProcessGroup | None) -> Iterator[None]:
    """Mark this rank as at work for ``group`` (a heartbeat every second), so that the ranks
    waiting for it in ``gather`` wait on instead of timing out. A no-op at one rank."""
    if not dist.is_initialized():
        yield
        return
    group = group if group is not None else dist.group.WORLD
    if group.size() == 1:
        yield
        return
    store, key, stop = _store(), _beat_key(group, group.rank()), threading.Event()

    def beat() -> None:
        while not stop.wait(BEAT_SECONDS):
            try:
                store.add(key, 1)
            except RuntimeError:  # the store went away: the job is ending
                return

    store.add(key, 1)
    thread = threading.Thread(target=beat, name="zerokit-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _absent(store, key: str, group: ProcessGroup, size: int) -> list[int]:
    """Ranks not arrived at ``key`` whose heartbeat does not move over three beats."""
    missing = [r for r in range(size) if not store.check([f"{key}here/{r}"])]
    before = {r: store.add(_beat_key(group, r), 0) for r in missing}
    try:
        store.wait([f"{key}verdict"], timedelta(seconds=3 * BEAT_SECONDS))
        return []  # decided meanwhile
    except RuntimeError:
        pass
    return [
        r
        for r in missing
        if not store.check([f"{key}here/{r}"]) and store.add(_beat_key(group, r), 0) == before[r]
    ]


def _arrive(what: str, group: ProcessGroup, timeout: float, hint: str = "") -> None:
    """Meet every rank of ``group`` in the store, or raise ``CollectiveTimeout``."""
    if is_stand_in(group):  # a dry run: every rank is this process
        return
    store, size, me = _store(), group.size(), group.rank()
    number = store.add(f"{_PREFIX}/{group.group_name}/calls/{me}", 1)  # this rank's n-th
    key = f"{_PREFIX}/{group.group_name}/{number}/"
    store.set(f"{key}here/{me}", what)
    if store.add(f"{key}count", 1) == size:
        store.compare_set(f"{key}verdict", "", "ok")
    deadline = time.monotonic() + timeout
    while True:
        try:
            store.wait([f"{key}verdict"], timedelta(seconds=max(deadline - time.monotonic(), 0.01)))
            break
        except RuntimeError:  # timed out: whoever is not here, and not at work, is missing
            absent = _absent(store, key, group, size)
            if absent:
                store.compare_set(f"{key}verdict", "", "missing " + json.dumps(absent))
                deadline = time.monotonic() + 1.0  # the verdict is written: read it
            else:  # all here (the last is writing "ok"), or the absent ones are still at work
                deadline = time.monotonic() + timeout
    verdict = store.get(f"{key}verdict").decode()
    if verdict != "ok":
        members = dist.get_process_group_ranks(group)
        absent = json.loads(verdict.removeprefix("missing "))
        missing = [members[r] for r in absent]
        me_global = members[me]
        if me_global in missing:
            message = (
                f"{what}: this rank ({me_global}) arrived after the other ranks had waited "
                f"{timeout:g} s for it and given up; every rank must make the call together"
            )
        else:
            message = (
                f"{what}: {_ranks(missing)} of {size} did not make this call within {timeout:g} s "
                f"({presence.where(group, absent)}; every rank must call it; the timeout is the "
                f"timeout argument or ${TIMEOUT_ENV}){hint}"
            )
        teardown.timed_out(timeout)
        raise CollectiveTimeout(message, missing)
    store.delete_key(f"{key}here/{me}")  # the verdict and count stay: a few bytes per call


def meet(what: str, group: ProcessGroup | None, hint: str = "") -> None:
    """Every rank of ``group`` reaches ``what`` (a user-facing call), or ``CollectiveTimeout``
    on every rank that came, naming the absent ranks (``hint`` appended: what to do). Meets
    in the store only: no collective, nothing paired with another call's collectives. For the
    entry points that are not every step's path (clipping, state dicts, evaluation), so that a
    rank that makes the call alone waits there instead of pairing its collectives with
    another call's on the other ranks."""
    if not dist.is_initialized():
        return
    group = group if group is not None else dist.group.WORLD
    if group.size() > 1:
        _arrive(what, group, collective_timeout(), hint)


def gather(
    what: str, value: bytes, group: ProcessGroup | None, timeout: float | None = None
) -> list[bytes]:
    """Every rank's ``value`` in group-rank order (collective over ``group``; the world if
    None). Raises ``CollectiveTimeout`` on every rank that came if some rank does not come
    within ``timeout`` seconds, and ``AgreementError`` if the ranks are in different calls.
    Nothing to do without a process group or at one rank."""
    if not dist.is_initialized():
        return [value]
    group = group if group is not None else dist.group.WORLD
    if group.size() == 1:
        return [value]
    _arrive(what, group, collective_timeout(timeout))
    tagged = what.encode() + b"\0" + value
    gathered = [t.partition(b"\0") for t in all_gather_bytes(tagged, group)]
    calls = [w.decode() for w, _, _ in gathered]
    if len(set(calls)) > 1:
        members = dist.get_process_group_ranks(group)
        raise AgreementError(
            "the ranks are in different collective calls: "
            + "; ".join(f"rank {members[r]}: {c}" for r, c in enumerate(calls))
        )
    return [v for _, _, v in gathered]


def describe_bytes(value: bytes) -> str:
    """A short, printable account of a value: the text if it is short text, else its hash."""
    try:
        text = value.decode()
        if len(text) <= 200 and text.isprintable():
            return repr(text)
    except UnicodeDecodeError:
        pass
    return f"<{len(value)} bytes, sha256 {hashlib.sha256(value).hexdigest()[:12]}>"


def agree_all(
    what: str,
    fields: Mapping[str, bytes],
    group: ProcessGroup | None,
    timeout: float | None = None,
    describe: Callable[[bytes], str] = describe_bytes,
) -> None:
    """Check that every rank holds the same value for every field (one all-gather); raise
    ``AgreementError`` on every rank naming each field that differs and which ranks hold what.
    Every rank must pass the same field names."""
    names = sorted(fields)
    payload = json.dumps({n: fields[n].hex() for n in names}).encode()
    values = [json.loads(v) for v in gather(what, payload, group, timeout)]
    members = (
        dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        if len(values) > 1
        else [0]
    )
    problems = []
    for name in sorted({n for v in values for n in v}):
        held: dict[str | None, list[int]] = {}
        for r, v in enumerate(values):
            held.setdefault(v.get(name), []).append(members[r])
        if len(held) > 1:
            # the value most ranks hold first, then the others, each with its ranks
            order = sorted(held.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
            shown = [
                f"{_ranks(r)}: {'nothing' if h is None else describe(bytes.fromhex(h))}"
                for h, r in order
            ]
            problems.append(f"{name} differs ({'; '.join(shown)})")
    if problems:
        raise AgreementError(f"{what}: the ranks must agree, but " + "; ".join(problems))


def agree(
    what: str, value: bytes, group: ProcessGroup | None, timeout: float | None = None
) -> None:
    """Check that every rank of ``group`` passes the same ``value``; raise ``AgreementError``
    on every rank, naming the ranks that differ, if not (and ``CollectiveTimeout`` if a rank
    does not come)."""
    agree_all(what, {"the value": value}, group, timeout)
