"""``async_save`` (``checkpoint.background``): a checkpoint written while training goes on, as atomic as ``save``.

Note: what runs where. On the calling thread, before ``async_save`` returns: every rank
copies what it will write (its primary chunks, its extra state) into host memory of its own
(pinned on CUDA), and the ranks do every collective part of ``save`` (errors told to all, the
path, model, optimizer, extra keys and layout agreed; rank 0 takes the save lock and makes
the temp directory). Training that changes the parameters afterwards cannot change what is
written. In the background (one thread per process) there is file I/O only, never a
collective: a background collective beside training's on a gloo group could pair with
training's or wait on the store behind them. Each rank writes and fsyncs its file, then posts
what it wrote as ``<rank>.posted.json`` in the temp directory; rank 0 waits for every post
(giving up when a rank's file has stopped growing for the collective timeout), removes them,
and finishes the checkpoint as ``save`` does (sealed index or DCP metadata, the two renames),
or removes the temp directory and leaves ``<temp>.failed`` saying why. Every other rank waits
until the temp directory is gone: the checkpoint holds its file (the same inode) or the note
says why not. A crash anywhere leaves the previous checkpoint loadable; the next save clears
the debris. One save at a time per process: a second ``async_save`` (or ``save``) first waits
for the one in flight to finish (its outcome stays with its own future).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..core import alive
from ..runtime.timeouts import collective_timeout
from .agreement import rank, world_group
from .holdings import Chunk
from .index import CheckpointError
from .places import LOCK_SUFFIX, remove
from .protocol import Prepared, SaveJob, begin_save, in_flight, wait_in_flight
from .saving import writer_for

_POLL = 0.02  # seconds between looks at the temp directory
_WRITER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerokit-async-save")


def async_save(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: Mapping[str, Any] | None = None,
    timeout: float | None = None,
    format: str = "zerokit",
) -> Future:
    """``save``, returning once this rank's state is copied to host memory and the ranks have
    agreed; the files are written, sealed and renamed into place in the background.

    Collective, with ``save``'s arguments. Returns a ``concurrent.futures.Future``: its
    ``result()`` is None once the checkpoint is in place, or raises what the save raised (a
    ``CheckpointError`` naming the rank that failed). Parameters and optimizer state may change
    as soon as it returns. A second ``async_save`` (or a ``save``) waits for this one first.
    """
    wait_in_flight()
    path = os.path.abspath(os.fspath(path))
    group = world_group()
    writer = writer_for(format)
    with alive(group):
        job = begin_save("async_save", path, model, optimizer, extra, writer, group, timeout,
                         _snapshot)  # fmt: skip
    future = _WRITER.submit(_Job(job).run)
    in_flight(future)
    return future


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.device.type == "cpu":
        return tensor.detach().clone()
    out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=torch.cuda.is_available())
    return out.copy_(tensor.detach(), non_blocking=True)


def _snapshot(p: Prepared) -> Prepared:
    """What will be written, copied: no view of a live parameter or state is left."""
    if p.h is None:
        return p
    chunks = []
    for c in p.h.chunks:
        data = _host_copy(c.tensor) if c.primary else c.tensor.new_empty(0, device="cpu")
        chunks.append(Chunk(c.name, c.start, data, c.primary))
    p.h.chunks, p.h.optimizer_chunks = chunks, []
    p.extras = {k: (doc, [t.clone() for t in ts]) for k, (doc, ts) in p.extras.items()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # the non-blocking copies have landed
    return p


class _Job:
    """One background save: this rank's file, then rank 0's seal and publish, or the others'
    wait for them (file I/O only: see the module's note)."""

    def __init__(self, job: SaveJob):
        self.job, self.path, self.tmp, self.rank = job, job.path, job.tmp, rank()
        self.ranks = dist.get_world_size() if dist.is_initialized() else 1

    def run(self) -> None:
        info, error = self.job.write_mine()
        if error is not None:
            error = f"rank {self.rank}: {error}"
        _post(self.tmp, self.rank, error, info)
        if self.rank == 0:
            self._finish()
        else:
            self._await(info)
        if error is not None:
            raise CheckpointError(error)

    def _finish(self) -> None:
        committed = False
        try:
            infos = _collect_posts(self.tmp, self.ranks)
            self.job.seal_and_publish(infos)
            committed = True
        except Exception as e:
            why = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
            _note(self.tmp, f"finishing the checkpoint failed: {why}")
            raise CheckpointError(f"finishing the checkpoint failed: {why}") from None
        finally:
            if not committed:
                remove(self.tmp)
            self.job.lock.release()

    def _await(self, info) -> None:
        """Until rank 0 has finished: the checkpoint holds this rank's file, or the note says
        why not."""
        mine = _file_of(info)
        inode = os.stat(os.path.join(self.tmp, mine)).st_ino if mine else None
        while os.path.lexists(self.tmp):
            if not _lock_held(self.path):
                time.sleep(_POLL * 5)  # released between the rename and the look
                if os.path.lexists(self.tmp):
                    raise CheckpointError(
                        "rank 0 stopped before finishing the checkpoint; "
                        "the previous checkpoint is untouched"
                    )
            time.sleep(_POLL)
        if os.path.exists(self.tmp + ".failed"):
            with open(self.tmp + ".failed") as f:
                raise CheckpointError(f.read())
        if mine and os.stat(os.path.join(self.path, mine)).st_ino != inode:
            raise CheckpointError(
                f"{self.path} does not hold this rank's file: another save replaced it"
            )


def _file_of(info: dict | None) -> str | None:
    if not info:
        return None
    return info["file"]["name"] if isinstance(info.get("file"), dict) else info.get("file")


def _post(tmp: str, rank: int, error: str | None, info) -> None:
    partial = os.path.join(tmp, f"{rank}.posting")
    with open(partial, "w") as f:
        json.dump([error, info], f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, os.path.join(tmp, f"{rank}.posted.json"))


def _collect_posts(tmp: str, ranks: int) -> list:
    """Every rank's post, in rank order, each removed; raises naming the ranks that failed or
    whose files stopped growing for the collective timeout."""
    limit, last_size, last_change = collective_timeout(), -1, time.monotonic()
    while True:
        names = set(os.listdir(tmp))
        if all(f"{r}.posted.json" in names for r in range(ranks)):
            break
        size = sum(
            os.path.getsize(os.path.join(tmp, n))
            for n in names
            if os.path.isfile(os.path.join(tmp, n))
        )
        if size != last_size:
            last_size, last_change = size, time.monotonic()
        elif time.monotonic() - last_change > limit:
            absent = [r for r in range(ranks) if f"{r}.posted.json" not in names]
            raise CheckpointError(
                f"ranks {absent} did not finish writing (nothing written for "
                f"{limit:g} s: stopped or killed)"
            )
        time.sleep(_POLL)
    replies = []
    for r in range(ranks):
        where = os.path.join(tmp, f"{r}.posted.json")
        with open(where) as f:
            replies.append(json.load(f))
        os.unlink(where)
    failed = [e for e, _ in replies if e is not None]
    if failed:
        raise CheckpointError("; ".join(failed))
    return [info for _, info in replies]


def _note(tmp: str, message: str) -> None:
    """``<tmp>.failed``: why, for the other ranks (removed as debris by the next save)."""
    try:
        with open(tmp + ".failed", "w") as f:
            f.write(message)
    except OSError:
        pass


def _lock_held(path: str) -> bool:
    import fcntl

    try:
        fd = os.open(path + LOCK_SUFFIX, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
