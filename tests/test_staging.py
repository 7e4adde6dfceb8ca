"""core/staging.py: which released buffers the pool keeps for reuse, and that a buffer it
drops is freed then, though a collective was handed an alias of it."""

import weakref

import torch

from zerokit.core.staging import StagingPool
from zerokit.runtime import teardown

F32 = torch.float32


def _holds(pool: StagingPool, buffer: torch.Tensor) -> bool:
    return any(b is buffer for b in pool.buffers())


def test_a_returned_buffer_is_kept_only_while_a_request_to_come_can_reuse_it():
    pool = StagingPool(torch.device("cpu"))
    pool.expect([(64, F32), (64, F32), (64, F32), (16, F32)])  # three blocks, then the root
    first = pool.acquire(64, F32)
    second = pool.acquire(64, F32)  # one filling while the other's reduction is in flight
    pool.release(first)
    assert pool.acquire(64, F32) is first  # the third block reuses it
    pool.release(second)  # no request of its size is left: dropped, not kept for the root
    assert pool.live_bytes == 64 * 4 and not _holds(pool, second)
    pool.release(first)
    assert pool.live_bytes == 0
    pool.acquire(16, F32)
    assert pool.live_bytes == 16 * 4


def test_without_expected_requests_returned_buffers_are_kept_within_the_bound():
    pool = StagingPool(torch.device("cpu"))  # e.g. no_sync() gradients reduced later
    a, b = pool.acquire(64, F32), pool.acquire(64, F32)
    pool.release(a)
    pool.release(b)
    assert pool.live_bytes == 2 * 64 * 4  # kept: what was in use at once
    pool.acquire(32, F32)  # another size: released buffers go first, oldest first
    assert pool.live_bytes == 64 * 4 + 32 * 4 and _holds(pool, b) and not _holds(pool, a)


def test_a_dropped_buffer_is_freed_at_once_though_a_collective_was_handed_an_alias():
    pool = StagingPool(torch.device("cpu"))
    pool.expect([(64, F32)])
    buffer = pool.acquire(64, F32)
    alias = teardown.hand(buffer.view(4, -1)[0])  # as a reduce of one chunk is given it
    freed = weakref.ref(alias)
    del alias  # the collective finished and its work let go
    pool.release(buffer)  # the last request of its size: dropped
    del buffer
    assert freed() is None  # not held by teardown until the next collective
