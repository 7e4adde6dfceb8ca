"""``async_save`` (``checkpoint.background``): a checkpoint written while training goes on, as atomic as ``save``.

Note: what runs where. ``async_save`` is ``save``'s protocol (its prologue, ``saving.begun``,
then the same ``SaveJob``) with the write, seal and publish on a writer thread. On the calling
thread, before ``async_save`` returns: every rank copies what it will write (its primary
chunks, its extra state) into host memory of its own (pinned on CUDA), and the ranks do every
collective part of ``save`` (errors told to all, the path, model, optimizer, extra keys and
layout agreed; rank 0 takes the save lock and makes the temp directory). Training that changes
the parameters afterwards cannot change what is written. On the writer thread (one per
process) there is file I/O only, never a collective: a background collective beside
training's on a gloo group could pair with training's or wait on the store behind them. Each
rank but 0 writes and fsyncs its file, then posts its error or what it wrote as
``<rank>.posted.json`` (on a full disk, an empty ``<rank>.posted-errno-<n>``); rank 0 waits
for every post (naming a rank, and its file, whose writing has stopped for the collective
timeout), removes them, and seals and publishes as ``save`` does, or clears the temp directory
and leaves ``<temp>.failed`` saying why. Every other rank waits until the temp directory is
gone: the checkpoint holds its file (the same inode) or the note says why not, and that note
is every rank's error. A crash anywhere leaves the previous checkpoint loadable; the next save
clears the debris. One save at a time per process: a second ``async_save`` (or ``save``) first
waits for the one in flight; if it failed and its future was never asked, that save raises
its error instead of going ahead.
"""

from __future__ import annotations

import _thread
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
from .agreement import rank
from .index import CheckpointError
from .inflight import run_in_background, wait_in_flight
from .places import LOCK_SUFFIX, remove
from .protocol import Prepared, SaveJob
from .saving import begun
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
    prologue = begun("async_save", path, model, optimizer, extra, timeout, format, _snapshot)
    with prologue as (job, _):  # agreed, its staging faulted in meanwhile (see staging's note)
        job.p.h.chunks = _STAGING.copy(job.p.h.chunks)
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


def prewarm_async_save(model: nn.Module, optimizer=None) -> int:
    """Allocate (and fault in; pinned on CUDA) the host memory the next ``async_save`` of
    ``model`` and ``optimizer`` copies into, so the first save blocks no longer than the next
    ones; returns its bytes. Optional: without it the first save allocates that memory."""
    wait_in_flight()
    return _STAGING.prewarm(model, optimizer)


def async_save_staging_bytes() -> int:
    """The host memory this process's async saves hold between saves (their staging)."""
    return _STAGING.nbytes


class _Job:
    """One background save: this rank's file, then rank 0's seal and publish, or the others'
    wait for them (file I/O only: see the module's note)."""

    def __init__(self, job: SaveJob):
        self.job, self.path, self.tmp, self.rank = job, job.path, job.tmp, rank()
        self.ranks = dist.get_world_size() if dist.is_initialized() else 1

    def run(self) -> None:
        """Every rank ends with the same outcome: rank 0's (its own, or its note)."""
        try:
            info, error = self.job.write_mine()
        except BaseException as e:  # the writer stopped short of its own error handling
            name = os.path.join(self.path, self.job.writer.file_of(self.rank))
            info, error = None, f"its writer thread stopped writing {name}: {type(e).__name__}: {e}"
        if error is not None:
            error = f"rank {self.rank}: {error}"
        if self.rank == 0:
            self._finish([error, info])
        else:
            _post(self.tmp, self.rank, error, info, self.job.errno)
            self._await(info)
        if error is not None:  # reached only if rank 0's note was lost: this rank's own
            raise CheckpointError(error)

    def _finish(self, own: list) -> None:
        committed = False
        try:
            infos = _collect_posts(self.tmp, self.ranks, self.job, own)
            self.job.seal_and_publish(infos)
            committed = True
        except Exception as e:
            why = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"
            _clear_files(self.tmp)  # room for the note on a full disk
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


_ERRNO = ".posted-errno-"  # <rank>.posted-errno-<n>: a post that needs no space on disk


def _post(tmp: str, rank: int, error: str | None, info, errno: int | None) -> None:
    """``<rank>.posted.json``: this rank's error or what it wrote. Where that cannot be
    written (the disk is full), an empty file whose name carries the errno: a name takes no
    data block, so rank 0 still hears why."""
    partial = os.path.join(tmp, f"{rank}.posting")
    try:
        with open(partial, "w") as f:
            json.dump([error, info], f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, os.path.join(tmp, f"{rank}.posted.json"))
    except OSError as e:
        try:
            os.close(
                os.open(
                    os.path.join(tmp, f"{rank}{_ERRNO}{errno or e.errno or 0}"),
                    os.O_CREAT | os.O_WRONLY,
                )
            )
        except OSError:  # the temp directory is gone (rank 0 gave up): _await says why
            pass


def _posted(tmp: str, names: set[str], r: int, job: SaveJob) -> list | None:
    """Rank ``r``'s reply if it posted one (its file removed), else None."""
    if f"{r}.posted.json" in names:
        where = os.path.join(tmp, f"{r}.posted.json")
        with open(where) as f:
            reply = json.load(f)
        os.unlink(where)
        return reply
    marker = next((n for n in names if n.startswith(f"{r}{_ERRNO}")), None)
    if marker is None:
        return None
    n = int(marker[len(f"{r}{_ERRNO}") :])
    file = os.path.join(job.path, job.writer.file_of(r))
    return [
        f"rank {r}: writing its shard failed: {file}: OSError: [Errno {n}] {os.strerror(n)}",
        None,
    ]


def _collect_posts(tmp: str, ranks: int, job: SaveJob, own: list) -> list:
    """Every rank's post (rank 0's ``own``, the others' files, each removed), in rank order;
    raises naming the ranks that failed or whose files stopped growing for the timeout."""
    limit, last_size, last_change = collective_timeout(job.timeout), -1, time.monotonic()
    while True:
        names = set(os.listdir(tmp))
        if all(f"{r}.posted.json" in names or any(n.startswith(f"{r}{_ERRNO}") for n in names)
               for r in range(1, ranks)):  # fmt: skip
            break
        size = sum(
            os.path.getsize(os.path.join(tmp, n))
            for n in names
            if os.path.isfile(os.path.join(tmp, n))
        )
        if size != last_size:
            last_size, last_change = size, time.monotonic()
        elif time.monotonic() - last_change > limit:
            absent = [
                r for r in range(1, ranks) if not any(n.startswith(f"{r}.posted") for n in names)
            ]
            files = ", ".join(os.path.join(job.path, job.writer.file_of(r)) for r in absent)
            who = f"rank {absent[0]}" if len(absent) == 1 else f"ranks {absent}"
            raise CheckpointError(
                f"{who} did not finish writing (nothing written for "
                f"{limit:g} s: stopped or killed): {files}"
            )
        time.sleep(_POLL)
    names = set(os.listdir(tmp))
    replies = [own] + [_posted(tmp, names, r, job) for r in range(1, ranks)]
    failed = [e for e, _ in replies if e is not None]
    if failed:
        raise CheckpointError("; ".join(failed))
    return [info for _, info in replies]


def _clear_files(tmp: str) -> None:
    try:
        for name in os.listdir(tmp):
            os.unlink(os.path.join(tmp, name))
    except OSError:
        pass


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
