"""A counting group for tests: every call this rank makes to the named ``torch.distributed``
collectives is seen by ``record`` before it runs, so a test can count bytes by op and group."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch.distributed as dist


@contextlib.contextmanager
def patched_collectives(ops: Iterable[str], record: Callable) -> Iterator[None]:
    """``record(op, tensor, args, kwargs)`` on each call to ``dist.<op>``, then the call; the
    originals are put back on exit, whatever happened."""
    originals = {op: getattr(dist, op) for op in ops}

    def wrap(op, fn):
        def counted(tensor, *args, **kwargs):
            record(op, tensor, args, kwargs)
            return fn(tensor, *args, **kwargs)

        return counted

    for op, fn in originals.items():
        setattr(dist, op, wrap(op, fn))
    try:
        yield
    finally:
        for op, fn in originals.items():
            setattr(dist, op, fn)
