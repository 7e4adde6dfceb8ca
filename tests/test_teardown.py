"""runtime/teardown.py: what gloo's worker is left to release when a collective is over.

The worker drops a finished collective's tensors a moment after ``wait()`` returned, under the
GIL. If its drop is the last reference, it also deallocates the tensor's Python object, which
releases the GIL half-way: when the main thread has begun finalizing meanwhile, the process
aborts. So a handed tensor is held until every other holder let go, then released on the main
thread; and it is an alias that holds no other tensor, whose release could be the last one.
"""

import ctypes
import os
import threading
import time
import weakref

import pytest
import torch

from zerokit.runtime import teardown


def test_a_handed_tensor_is_an_alias_that_holds_no_other_tensor():
    full = torch.zeros(8)
    chunk = full.view(2, 4)[1]
    held = full._use_count()  # the chunk's view holds the full tensor
    handed = teardown.hand(chunk)
    assert full._use_count() == held  # the handed alias does not
    assert handed.shape == chunk.shape and handed.data_ptr() == chunk.data_ptr()
    handed.fill_(1.0)  # what the collective writes lands in the caller's tensor
    assert full.tolist() == [0.0] * 4 + [1.0] * 4


def test_the_last_holder_of_a_handed_tensor_does_not_deallocate_it():
    before = teardown.outstanding()
    handed = teardown.hand(torch.zeros(4))
    worker = handed.view(4)  # a C++ reference to the handed tensor, as gloo's work holds one
    alive = weakref.ref(handed)
    del handed  # the caller is done (Pending.finish returned)
    assert teardown.outstanding() == before + 1  # the worker still holds it
    del worker  # the worker lets go last
    assert alive() is not None  # so it did not deallocate the Python object
    assert teardown.outstanding() == before  # the main thread released it
    assert alive() is None


def _named_spinner(name: bytes, stop: threading.Event) -> None:
    """A thread that the kernel names ``name`` (as torch names gloo's workers) and that stays
    runnable until ``stop`` is set, as a worker still dropping a collective's tensors does."""
    libc = ctypes.CDLL(None)
    libc.prctl(15, ctypes.c_char_p(name), 0, 0, 0)  # PR_SET_NAME: this thread's comm
    while not stop.is_set():
        pass


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux's /proc")
def test_the_exit_waits_while_a_gloo_worker_is_runnable():
    assert teardown.gloo_workers_asleep()  # none here, or all idle
    stop = threading.Event()
    worker = threading.Thread(target=_named_spinner, args=(teardown.GLOO_WORKER.encode(), stop))
    worker.start()
    try:
        time.sleep(0.05)  # it has named itself and spins
        assert not teardown.gloo_workers_asleep()
    finally:
        stop.set()
        worker.join()
    deadline = time.monotonic() + 10  # join() returns before the kernel has ended the thread
    while not teardown.gloo_workers_asleep() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert teardown.gloo_workers_asleep()
