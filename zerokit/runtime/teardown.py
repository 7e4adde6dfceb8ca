"""How a process that used zerokit's collectives ends: cleanly after success, at once after an
abandoned collective.

Note (why the end of a script could abort): gloo runs each collective on a worker thread of
its own, which still holds the collective's work, and so the tensors it was given, for a
moment after ``wait()`` has returned in Python. Letting go of a tensor that has a Python object
takes the GIL: torch 2.13 holds a strong reference to a tensor's Python object while C++ holds
the tensor, and drops it when the C++ count falls back to one. If that was the last reference,
the worker also deallocates the Python object, and torch's tensor deallocation releases the
GIL and takes it back half-way. If the main thread has meanwhile reached interpreter
finalization, the worker is terminated inside ``take_gil`` while unwinding a ``noexcept``
destructor: "terminate called without an active exception", exit status -6, after every result
was delivered.

So the worker must never be the one that deallocates a tensor's Python object, and the exit
must know when the worker has dropped its reference. Every tensor zerokit hands to a collective
is a fresh alias (``detach()``: same memory, no reference to the tensor it aliases) that this
module holds until the worker has let go: then the alias's Python reference count is back to
what this module alone holds, which the worker's drop (a bare ``Py_DECREF`` under the GIL, no
code run, no GIL released) has made so. Only then does the main thread drop it, at the next
``hand`` or at exit (``atexit`` runs while the interpreter is still intact, and waits, the GIL
released, until every alias is released). Watching the aliases' deaths instead (a weakref, a
``WeakSet``) is not enough: the death is recorded at the start of the deallocation, before its
GIL release (1 exit in 40 to 150 still aborted so on a loaded 2-core machine).

The user's own collectives (``dist.all_reduce(total)`` to print a loss) race the same way, and
zerokit cannot hold their tensors: plain torch with DDP aborts so too (2 exits in 40 on a loaded
2-core machine; pytorch/pytorch#190489, open). And ``destroy_process_group()`` does not join the
workers while anything (a wrapped model) still holds the group. So the exit also waits until
every gloo worker thread of this process (``pt_gloo_runloop`` in ``/proc/self/task``) has been
asleep for several checks in a row while this thread kept the GIL released: a worker that has
something left to drop is runnable, or wakes as soon as the GIL is free.

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
import os
import sys
import time

import torch
import torch.distributed as dist

#: how long the exit waits for gloo's workers to let go of finished collectives
SETTLE_SECONDS = 5.0
#: how many checks in a row (``QUIET_PAUSE`` s apart) must find every gloo worker asleep
QUIET_CHECKS = 3
QUIET_PAUSE = 0.002
#: the name torch gives gloo's worker threads
GLOO_WORKER = "pt_gloo_runloop"


class _ProcessExit:
    """What this process's exit must wait for. Process-wide by nature (``atexit`` is), so one
    instance per process; it holds no process group."""

    def __init__(self):
        # the handed tensors, by id, held here until no one else holds them
        self.handed: dict[int, torch.Tensor] = {}
        self.abandoned: list[str] = []  # the calls whose collectives were given up
        self.registered = False
        self.wait: float | None = None  # set once this process has raised CollectiveTimeout


_exit = _ProcessExit()
_EXIT_KEY = "zerokit/exit"
#: the longest a rank that timed out waits at exit for the others to report theirs
MAX_EXIT_WAIT = 20.0


def hand(tensor: torch.Tensor) -> torch.Tensor:
    """A fresh alias of ``tensor`` to give to a collective (same memory), held until gloo's
    worker and the caller both let go of it."""
    alias = tensor.detach()
    _hold(alias)
    return alias


def hand_all(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``hand`` for tensors made for the collective alone (no alias needed)."""
    for t in tensors:
        _hold(t)
    return tensors


def _hold(tensor: torch.Tensor) -> None:
    _register()
    release_finished()
    _exit.handed[id(tensor)] = tensor


def _refs(held: dict[int, torch.Tensor], key: int) -> int:
    return sys.getrefcount(held[key])


#: what ``_refs`` reads for a tensor that only its dict holds (interpreters count differently)
_ALONE = _refs({0: torch.empty(0)}, 0)


def release_finished() -> None:
    """Drop, on this (the main) thread, the handed tensors that nobody else holds any more: no
    C++ holder (gloo's worker has dropped its reference, which it does under the GIL) and no
    Python one. Called as tensors are handed, and by owners that drop a buffer (the staging
    pool), so its memory is freed at once, not at the next collective."""
    held = _exit.handed
    for key in [k for k in held if held[k]._use_count() == 1 and _refs(held, k) == _ALONE]:
        del held[key]


def outstanding() -> int:
    """How many handed tensors someone (gloo's worker or Python) still holds."""
    release_finished()
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
    deadline, quiet = time.monotonic() + SETTLE_SECONDS, 0
    while quiet < QUIET_CHECKS and time.monotonic() < deadline:
        quiet = quiet + 1 if not outstanding() and gloo_workers_asleep() else 0
        time.sleep(QUIET_PAUSE)  # releases the GIL: a worker may need it to drop a tensor


def gloo_workers_asleep() -> bool:
    """Whether every gloo worker thread of this process is asleep (waiting for work, or for the
    GIL, which this thread then releases). True where ``/proc`` cannot tell."""
    tasks = "/proc/self/task"
    try:
        threads = os.listdir(tasks)
    except OSError:  # no /proc (not Linux): the handed tensors alone are waited for
        return True
    for thread in threads:
        try:
            with open(f"{tasks}/{thread}/comm") as comm:
                if comm.read().strip() != GLOO_WORKER:
                    continue
            with open(f"{tasks}/{thread}/stat") as stat:
                state = stat.read().rpartition(")")[2].split()[0]  # the name may hold spaces
        except (OSError, IndexError):  # the thread ended meanwhile
            continue
        if state in ("R", "D"):  # runnable or inside the kernel; "Z": ended a moment ago
            return False
    return True


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
