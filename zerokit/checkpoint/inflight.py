"""This process's save in flight: one at a time, and a failure never lost (the next save
raises a failure no one asked the future for)."""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future

from .index import CheckpointError


class SaveFuture(Future):
    """An async save's outcome; ``seen``: asked, or raised by the next save."""

    def __init__(self, path: str):
        super().__init__()
        self.path, self.seen = path, False

    def result(self, timeout=None):
        self.seen = True
        return super().result(timeout)

    def exception(self, timeout=None):
        self.seen = True
        return super().exception(timeout)


_IN_FLIGHT: list[SaveFuture] = []  # this process's save on the writer thread (at most one)
_IN_FLIGHT_LOCK = threading.Lock()
# a forked child has no writer thread: nothing of its parent's is in flight there
os.register_at_fork(after_in_child=_IN_FLIGHT.clear)


def run_in_background(executor, work, path: str) -> SaveFuture:
    """``work()`` on ``executor``'s thread, its outcome in the returned future, recorded as
    this process's save in flight."""
    future = SaveFuture(path)

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(work())
        except BaseException as e:  # a stopped writer too: the future must not hang
            future.set_exception(e)

    executor.submit(run)
    with _IN_FLIGHT_LOCK:
        _IN_FLIGHT[:] = [future]
    return future


def wait_in_flight() -> None:
    """Wait for this process's background save, if any: one save at a time. Its failure,
    if its future was never asked, is raised here (once)."""
    with _IN_FLIGHT_LOCK:
        pending = list(_IN_FLIGHT)
    for future in pending:
        try:
            error = Future.exception(future)  # waits; not counted as asked
        except BaseException:  # cancelled: nothing more to wait for
            continue
        if error is not None and not future.seen:
            future.seen = True
            raise CheckpointError(
                f"the async_save to {future.path} failed, and its future was not asked: "
                f"{error}; the previous checkpoint there is untouched"
            ) from None
