"""``async_save`` (``checkpoint.background``): a checkpoint written while training goes on, as atomic as ``save``.

Note: what runs where. ``async_save`` is ``save`` (``begin_save``, then ``SaveJob.finish``)
but for its stage, a copy of what each rank writes in host memory of its own (pinned on CUDA),
and its ``Tell`` (``_Job``). Every collective part of ``save`` (errors told to all; the path,
model, optimizer, extra keys and layout agreed; rank 0's lock and temp directory) runs on the
calling thread before ``async_save`` returns, after which training may change the parameters.
``finish`` runs on a writer thread (one per process, at idle priority) doing file I/O only,
never a collective: a background collective beside training's on a gloo group could pair with
training's or wait on the store behind them. So the ranks tell each other by files in the
temp directory: each rank but 0 posts its error or what it wrote (``<rank>.posted.json``; on
a full disk an empty ``<rank>.posted-errno-<n>``, a name taking no data block); rank 0 waits
for every post (naming a rank, and its file, whose writing stopped for the collective
timeout), then publishes or leaves ``<temp>.failed`` saying why; the others wait until the
temp directory is gone and find their file (the same inode) in the checkpoint or raise the
note, so every rank's error is rank 0's. A crash anywhere leaves the previous checkpoint
loadable; the next save clears the debris.
"""

from __future__ import annotations

import _thread
import contextlib
import fcntl
import json
import os
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..runtime.timeouts import collective_timeout
from .agreement import named, raise_any
from .index import CheckpointError
from .inflight import run_in_background, wait_in_flight
from .places import LOCK_SUFFIX
from .protocol import Prepared, SaveJob, begin_save
from .saving import writer_for
from .staging import StagingBuffers

_POLL = 0.02  # seconds between looks at the temp directory
_WRITERS: dict[int, ThreadPoolExecutor] = {}  # pid -> its writer thread (see _writer)
_STAGING = StagingBuffers()  # this process's async-save host memory, reused between saves


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
    ``result()`` is None once the checkpoint is in place, or raises what the save raised (the
    same ``CheckpointError`` on every rank, naming the rank that failed and its file).
    Parameters and optimizer state may change as soon as it returns. A second ``async_save``
    (or a ``save``) waits for this one first, and raises its failure if no one asked the
    future for it.
    """
    writer = writer_for(format)
    staged = begin_save(
        "async_save", path, model, optimizer, extra, writer, timeout, _snapshot, _fill
    )
    with staged as job:
        pass  # agreed and copied: the rest is the writer thread's
    return run_in_background(_writer(), _Job(job).run, job.path)


def _writer() -> ThreadPoolExecutor:
    """This process's writer thread. Per pid: a process forked after an async save inherits
    an executor whose thread did not come with it, and work given to it would never run."""
    pid = os.getpid()
    if pid not in _WRITERS:
        _WRITERS.clear()
        _WRITERS[pid] = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="zerokit-async-save", initializer=_yield_to_training
        )
        # its thread started by another: Thread.start waits until the new thread runs (0.17 s
        # measured on this loaded machine), which the first save's caller would wait
        _thread.start_new_thread(_WRITERS[pid].submit, (int,))
    return _WRITERS[pid]


def _yield_to_training() -> None:
    """The writer thread runs when a core is idle (Linux's SCHED_IDLE, this thread only):
    where the ranks fill every core, the save takes longer instead of the steps beside it.
    ``ZEROKIT_ASYNC_SAVE_PRIORITY=normal`` keeps it at the process's priority."""
    if os.environ.get("ZEROKIT_ASYNC_SAVE_PRIORITY", "idle") != "idle":
        return
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: the calling thread
    except (AttributeError, OSError):  # not Linux, or not allowed: the normal priority
        pass


def _snapshot(p: Prepared) -> Prepared:
    """The stage: this process's staging buffers fitted (reused between saves; the chunks are
    copied into them once the ranks agree), the extra state copied; no view of a live
    parameter or state is left once ``async_save`` returns."""
    if p.h is None:
        return p
    _STAGING.fit(p.h.chunks)
    _writer()  # started now, while the ranks agree
    p.h.optimizer_chunks = []
    p.extras = {k: (doc, [t.clone() for t in ts]) for k, (doc, ts) in p.extras.items()}
    return p


def _fill(p: Prepared) -> None:
    """The copy into the staging, once the ranks agreed: its faulting overlapped the
    agreement (see staging's note)."""
    p.h.chunks = _STAGING.copy(p.h.chunks)


def prewarm_async_save(model: nn.Module, optimizer=None) -> int:
    """Allocate (and fault in; pinned on CUDA) the host memory the next ``async_save`` of
    ``model`` and ``optimizer`` copies into, so the first save blocks no longer than the next
    ones; returns its bytes. Optional: without it the first save allocates that memory."""
    wait_in_flight()
    return _STAGING.prewarm(model, optimizer)


def async_save_staging_bytes() -> int:
    """The host memory this process's async saves hold between saves (their staging)."""
    return _STAGING.nbytes


_ERRNO = ".posted-errno-"  # <rank>.posted-errno-<n>: a post that needs no space on disk


class _Job:
    """An async save's ``Tell``: ``SaveJob.finish`` on the writer thread, told by files (see
    the module's note)."""

    stops = BaseException  # a writer thread that stops: nothing above it would hear

    def __init__(self, job: SaveJob):
        self.job, self.tmp, self.rank = job, job.tmp, job.rank
        self.ranks = dist.get_world_size() if dist.is_initialized() else 1
        self.error, self.inode = None, None  # this rank's own failure, its file's inode

    def run(self) -> None:
        self.job.finish(self)

    def written(self, error: str | None, shard: dict | None) -> list:
        if self.rank == 0:
            replies = self._told(lambda: [[error, shard], *_collect_posts(self.job, self.ranks)])
            return [s for _, s in replies]
        mine = os.path.join(self.tmp, self.job.writer.file_of(self.rank))
        if error is None and os.path.exists(mine):
            self.inode = os.stat(mine).st_ino
        self.error = error
        _post(self.tmp, self.rank, [error, shard], self.job.errno)
        return []

    def committed(self, error: str | None) -> None:
        if self.rank == 0:
            self._told(lambda: [[error, None]] + [[None, None]] * (self.ranks - 1))
            return
        path = self.job.path
        while os.path.lexists(self.tmp):  # until rank 0 has published or given up
            if not _lock_held(path):
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
        if self.error is not None:  # reached only if rank 0's note was lost
            raise CheckpointError(f"rank {self.rank}: {self.error}")
        mine = os.path.join(path, self.job.writer.file_of(self.rank))
        if self.inode is not None and os.stat(mine).st_ino != self.inode:
            raise CheckpointError(
                f"{path} does not hold this rank's file: another save replaced it"
            )

    def _told(self, replies) -> list:
        """Rank 0: ``raise_any`` of every rank's reply, as ``Together`` would; its failure
        left as the note for the others first."""
        try:
            return raise_any(replies())
        except CheckpointError as e:
            why = str(e)
        except Exception as e:
            why = f"finishing the checkpoint failed: {named(e)}"
        _note(self.tmp, why)
        raise CheckpointError(why)


def _post(tmp: str, rank: int, reply: list, errno: int | None) -> None:
    """``<rank>.posted.json``: this rank's reply. Where that cannot be written (the disk is
    full), an empty file whose name carries the errno: a name takes no data block."""
    partial = os.path.join(tmp, f"{rank}.posting")
    try:
        with open(partial, "w") as f:
            json.dump(reply, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, os.path.join(tmp, f"{rank}.posted.json"))
    except OSError as e:
        try:
            marker = os.path.join(tmp, f"{rank}{_ERRNO}{errno or e.errno or 0}")
            os.close(os.open(marker, os.O_CREAT | os.O_WRONLY))
        except OSError:  # the temp directory is gone (rank 0 gave up): _await says why
            pass


def _collect_posts(job: SaveJob, ranks: int) -> list:
    """The replies of ranks 1.., in order, each post removed once read; raises naming the
    ranks that posted nothing while the temp directory stopped growing for the timeout."""
    limit, last_size, last_change = collective_timeout(job.timeout), -1, time.monotonic()
    while True:
        names = set(os.listdir(job.tmp))
        absent = [r for r in range(1, ranks) if not any(n.startswith(f"{r}.posted") for n in names)]
        if not absent:
            return [_posted(job, names, r) for r in range(1, ranks)]
        files = [os.path.join(job.tmp, n) for n in names]
        size = sum(os.path.getsize(f) for f in files if os.path.isfile(f))
        if size != last_size:
            last_size, last_change = size, time.monotonic()
        elif time.monotonic() - last_change > limit:
            who = f"rank {absent[0]}" if len(absent) == 1 else f"ranks {absent}"
            files = ", ".join(os.path.join(job.path, job.writer.file_of(r)) for r in absent)
            raise CheckpointError(
                f"{who} did not finish writing (nothing written for "
                f"{limit:g} s: stopped or killed): {files}"
            )
        time.sleep(_POLL)


def _posted(job: SaveJob, names: set[str], r: int) -> list:
    """Rank ``r``'s reply (its post removed), or its errno marker's."""
    if f"{r}.posted.json" in names:
        where = os.path.join(job.tmp, f"{r}.posted.json")
        with open(where) as f:
            reply = json.load(f)
        os.unlink(where)
        return reply
    marker = next(n for n in names if n.startswith(f"{r}{_ERRNO}"))
    n = int(marker[len(f"{r}{_ERRNO}") :])
    file = os.path.join(job.path, job.writer.file_of(r))
    return [f"writing its shard failed: {file}: OSError: [Errno {n}] {os.strerror(n)}", None]


def _note(tmp: str, message: str) -> None:
    """``<tmp>.failed``: why, for the other ranks (removed as debris by the next save); the
    temp directory's files removed first, to make room for it on a full disk."""
    with contextlib.suppress(OSError):
        for name in os.listdir(tmp):
            os.unlink(os.path.join(tmp, name))
    with contextlib.suppress(OSError), open(tmp + ".failed", "w") as f:
        f.write(message)


def _lock_held(path: str) -> bool:
    try:
        fd = os.open(path + LOCK_SUFFIX, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
