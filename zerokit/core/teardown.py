"""How a process that used zerokit's collectives ends: cleanly after success, at once after an
abandoned collective.

Note (why the end of a script could abort): gloo runs each collective on a worker thread of
its own, which still holds the collective's work, and so the tensors it was given, for a
moment after ``wait()`` has returned in Python. Letting go of a tensor that has a Python object
takes the GIL (torch 2.13 keeps a tensor's Python object alive while C++ holds the tensor, and
releases it when the C++ count falls back to one), even if Python still uses the tensor. If the
main thread has meanwhile reached interpreter finalization, the worker is terminated inside
``take_gil`` while unwinding a ``noexcept`` destructor: "terminate called without an active
exception", exit status -6, after every result was delivered. So every tensor zerokit hands to
a collective is a fresh alias (``detach()``: same memory, its own Python object, no reference
to the tensor it aliases) recorded here; its Python object dies exactly when the last holder,
Python or gloo's worker, lets go. At exit (``atexit`` runs while the interpreter is still
intact) the main thread waits, the GIL released, until every handed tensor has died: then no
worker holds one, nor will take the GIL for one.

Two details make "has died" mean "the worker is done with the GIL". The death is recorded by a
weakref callback that is a C function (``deque.append``): a Python callback runs bytecode on
the worker, which may hand the GIL to the waiting main thread between recording the death and
finishing the release (the eval loop's switch request), and the main thread, seeing nothing
left, began finalizing while the worker still had to take the GIL back (1 exit in about 50
aborted that way). And the alias is a ``detach()``, not a view: a view holds the tensor it
views, so the worker's release could free that tensor too, and whatever Python callbacks
watched it would run on the worker after the view's death was recorded.

Note (why a timed-out collective ends the process at once): gloo has no abort. A collective
that timed out stays queued in the worker, which would wait for it up to the process group's
own timeout (30 minutes by default) when the group is destroyed at exit. So after a
``CollectiveTimeout`` the exit handler flushes the standard streams and leaves with
``os._exit(1)`` instead of finalizing; the other ranks, which time out too, do the same,
so no rank is left reading from a closed connection. A rank that timed out first waits (at
most ``MAX_EXIT_WAIT`` s, never past its collective timeout) until every rank has reported
its own error or left, each leaving word in the store: torchrun stops every rank as soon as
one fails, and each rank's error should be printed, not only the first one's.
"""

from __future__ import annotations

import atexit
import collections
import os
import sys
import time
import weakref

import torch
import torch.distributed as dist

#: how long the exit waits for gloo's workers to let go of finished collectives
SETTLE_SECONDS = 5.0


class _ProcessExit:
    """What this process's exit must wait for. Process-wide by nature (``atexit`` is), so one
    instance per process; it holds no process group."""

    def __init__(self):
        # the handed tensors not known dead, by id of their weakref (which must stay alive for
        # its callback to run); the weakrefs of those that died, appended by whichever thread
        # let go last, and forgotten by the main thread
        self.handed: dict[int, weakref.ref] = {}
        self.died: collections.deque[weakref.ref] = collections.deque()
        self.abandoned: list[str] = []  # the calls whose collectives were given up
        self.registered = False
        self.wait: float | None = None  # set once this process has raised CollectiveTimeout


_exit = _ProcessExit()
_EXIT_KEY = "zerokit/exit"
#: the longest a rank that timed out waits at exit for the others to report theirs
MAX_EXIT_WAIT = 20.0


def hand(tensor: torch.Tensor) -> torch.Tensor:
    """A fresh alias of ``tensor`` to give to a collective (same memory), watched until gloo's
    worker and Python both drop it."""
    alias = tensor.detach()
    _watch(alias)
    return alias


def hand_all(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``hand`` for tensors made for the collective alone (no alias needed)."""
    for t in tensors:
        _watch(t)
    return tensors


def _watch(tensor: torch.Tensor) -> None:
    _register()
    _forget_died()
    ref = weakref.ref(tensor, _exit.died.append)  # a C callback: no bytecode on gloo's worker
    _exit.handed[id(ref)] = ref


def _forget_died() -> None:
    """Drop the records of the handed tensors that died (main thread only)."""
    while _exit.died:
        _exit.handed.pop(id(_exit.died.popleft()), None)


def outstanding() -> int:
    """How many handed tensors are still alive (held by Python or by a gloo worker)."""
    _forget_died()
    return len(_exit.handed)


def abandoned(call: str) -> None:
    """A collective of ``call`` was given up: this process must not wait for it at exit."""
    _register()
    _exit.abandoned.append(call)


def timed_out(timeout: float) -> None:
    """This process raised ``CollectiveTimeout``: at exit it waits (bounded) for the other
    ranks to leave or report theirs, so that under torchrun, which stops every rank as soon
    as one fails, each rank's own error is printed."""
    _register()
    _exit.wait = min(timeout, MAX_EXIT_WAIT)


def _register() -> None:
    if not _exit.registered:
        atexit.register(_at_exit)
        _exit.registered = True


def _at_exit() -> None:
    _leave_word()
    if _exit.abandoned:
        print(
            f"zerokit: leaving without destroying the process group: a collective of "
            f"{_exit.abandoned[0]} timed out and is still queued in gloo, which cannot abort it",
            file=sys.stderr,
        )
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    deadline = time.monotonic() + SETTLE_SECONDS
    while outstanding() and time.monotonic() < deadline:
        time.sleep(0.001)  # releases the GIL: the worker may need it to drop the tensors


def _leave_word() -> None:
    """Say in the store that this rank is leaving; after a timeout, wait for the others."""
    if not dist.is_initialized():
        return
    try:
        store, me, size = _store(), dist.get_rank(), dist.get_world_size()
        store.set(f"{_EXIT_KEY}/{me}", "done" if _exit.wait is None else "timed out")
        if _exit.wait is None:
            return
        deadline = time.monotonic() + _exit.wait
        keys = [f"{_EXIT_KEY}/{r}" for r in range(size)]
        while not store.check(keys) and time.monotonic() < deadline:
            time.sleep(0.05)
    except RuntimeError:  # the store is gone: the job is over
        pass


def _store():
    return dist.distributed_c10d._get_default_store()
