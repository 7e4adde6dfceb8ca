"""Staging buffers for reduce-scatter: a bucket's gradients are copied into one while backward
runs, and its reduction receives into another. Each buffer is exactly its bucket's size.

Note: the pool reuses a released buffer of the same size instead of allocating a fresh one,
because fresh buffers are slow on CPU: a bucket of 32 MiB is at glibc's largest mmap threshold,
so each one is a new mapping and the first write to every 4 KiB page faults (measured at
165 ms per step for 108 MB of gradients on 2 ranks, against 10 ms into reused memory).

The bound, by construction: the pool never holds more bytes than the most its groups had *in
use at once* during this backward (``peak_in_use_bytes``). A released buffer stays for reuse
only while that holds; when a request of another size must allocate, released buffers are
dropped, oldest first, until it holds again (before the new one is allocated). Units of
different sizes therefore cannot pile up released buffers, and what is in use at once is
bounded by the reductions in flight (``ShardState``). The pool is emptied when backward ends:
between steps a rank holds no staging.

Note: a released buffer of a size no request of this backward will ask for again is dropped
at once (``expect``: the state says, as backward begins, which requests its groups will make).
Otherwise the last blocks' buffers would wait for the root unit's request, of another size,
through the embedding's backward: at the capacity peak (benchmarks/big_model.py --capacity).

Note: dropping a buffer frees its memory only once no collective's alias holds it
(``teardown.hand``): the pool lets go of those aliases (``teardown.release_finished``) as it
drops, not at the next collective.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

import torch

from ..runtime import teardown

Key = tuple[int, torch.dtype]  # a request: (elements, dtype)


class StagingPool:
    """Buffers keyed by size; ``live_bytes``/``peak_bytes`` say what backward really held."""

    def __init__(self, device: torch.device):
        self.device = device
        self._free: list[torch.Tensor] = []  # released, oldest first
        self._in_use: dict[int, torch.Tensor] = {}  # id -> buffer
        # requests still to come in this backward, per key; None: not known (keep for reuse)
        self._expected: collections.Counter[Key] | None = None
        self.in_use_bytes = 0  # bytes lent out now
        self.peak_in_use_bytes = 0  # the most lent out at once since ``clear()``
        self.live_bytes = 0  # bytes of every buffer that exists (in use or free)
        self.peak_bytes = 0  # the most ``live_bytes`` since ``reset_peak()``

    def expect(self, requests: Iterable[Key]) -> None:
        """The requests this backward will make (one per bucket to be reduced), until
        ``clear()``. A request beyond them is served as well; it is only not foreseen."""
        self._expected = collections.Counter(requests)

    def acquire(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        match = next(
            (k for k, b in enumerate(self._free) if b.numel() == numel and b.dtype == dtype), None
        )
        nbytes = numel * dtype.itemsize
        if match is not None:
            buffer = self._free.pop(match)
        else:  # drop what the bound requires before allocating, and let go of it at once
            peak = max(self.peak_in_use_bytes, self.in_use_bytes + nbytes)
            while self.live_bytes + nbytes > peak:  # only released buffers can go
                self.live_bytes -= self._free.pop(0).nbytes
            teardown.release_finished()
            buffer = torch.empty(numel, dtype=dtype, device=self.device)
            self.live_bytes += nbytes
        self._in_use[id(buffer)] = buffer
        self.in_use_bytes += nbytes
        self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        if self._expected is not None:
            self._expected[(numel, dtype)] -= 1
            self._drop_unwanted()
        return buffer

    def release(self, buffer: torch.Tensor) -> None:
        self._in_use.pop(id(buffer))
        self.in_use_bytes -= buffer.nbytes
        self._free.append(buffer)
        self._drop_unwanted()

    def _drop_unwanted(self) -> None:
        """Drop the released buffers no request still to come can reuse."""
        if self._expected is None:
            return
        keep = [b for b in self._free if self._expected[(b.numel(), b.dtype)] > 0]
        if len(keep) < len(self._free):
            self.live_bytes -= sum(b.nbytes for b in self._free) - sum(b.nbytes for b in keep)
            self._free = keep
            teardown.release_finished()

    def clear(self) -> None:
        """Drop every free buffer (all must have been released)."""
        assert not self._in_use, "a staging buffer is still in use"
        self._free.clear()
        self._expected = None
        teardown.release_finished()
        self.live_bytes = self.in_use_bytes = self.peak_in_use_bytes = 0

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def buffers(self) -> list[torch.Tensor]:
        """Every buffer that exists now (for memory accounting)."""
        return list(self._in_use.values()) + list(self._free)
