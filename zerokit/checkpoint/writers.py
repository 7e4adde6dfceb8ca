"""A Hugging Face style set of safetensors files, written by several writers at once.

Note: a file's bytes depend only on the plan (``plan_files``: which tensors in which file,
the same on every writer), never on who wrote it, so the set is the same byte for byte
whatever the number of writers. Writers are the ranks of a group or processes forked from
this one; a failure on any of them is raised on every one and nothing is published.
"""

from __future__ import annotations

import json
import multiprocessing
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from .index import CheckpointError
from .places import make_temp, remove, write_whole

HF_INDEX = "model.safetensors.index.json"
ALIASES_KEY = "zerokit_aliases"  # tied names, stored once: in the index and each file's metadata


@dataclass(frozen=True)
class SetFile:
    """One file of the set: its name and the tensors it holds, in order."""

    name: str
    tensors: tuple[str, ...]
    nbytes: int


def plan_files(sizes: dict[str, int], max_shard_size: int) -> list[SetFile]:
    """Tensors (``name -> bytes``, in order) packed into files of at most ``max_shard_size``
    bytes (a larger tensor gets a file of its own), named ``model-0000i-of-0000n``."""
    groups, size = [[]], 0
    for name, nbytes in sizes.items():
        if groups[-1] and size + nbytes > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    n = len(groups)
    return [
        SetFile(f"model-{i + 1:05d}-of-{n:05d}.safetensors", tuple(g), sum(sizes[t] for t in g))
        for i, g in enumerate(groups)
    ]


def owners(files: list[SetFile], writers: int) -> list[int]:
    """The writer of each file: largest first, to the writer with the fewest bytes so far
    (ties to the lower writer), so that no writer waits long for another."""
    load, owner = [0] * writers, [0] * len(files)
    for i in sorted(range(len(files)), key=lambda i: (-files[i].nbytes, i)):
        owner[i] = min(range(writers), key=lambda w: (load[w], w))
        load[owner[i]] += files[i].nbytes
    return owner


def hf_index(files: list[SetFile], total: int, aliases: dict[str, str]) -> str:
    """The set's ``model.safetensors.index.json`` (``aliases``: tied names stored once)."""
    weight_map = {t: f.name for f in files for t in f.tensors}
    meta = {"total_size": total, ALIASES_KEY: aliases}
    return json.dumps({"metadata": meta, "weight_map": weight_map}, indent=1)


@dataclass(frozen=True)
class Writers:
    """Who writes the set: the ranks of ``group`` (every rank calls ``write_set``), or else
    ``count`` local processes (this one and ``count - 1`` forked from it)."""

    group: object = None
    count: int = 1

    def size(self) -> int:
        return dist.get_world_size(self.group) if self.group is not None else self.count

    def rank(self) -> int:
        return dist.get_rank(self.group) if self.group is not None else 0

    def from_writer0(self, value):
        """Writer 0's ``value`` on every rank of the group (as it is without one)."""
        if self.group is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]


def write_set(
    output: str,
    files: list[SetFile],
    write_file: Callable[[str, SetFile], None],
    finish: dict[str, str],
    writers: Writers,
    start_check: Callable[[int], Callable[[], None]] = lambda writer: lambda: None,
) -> list[str]:
    """Write ``files`` (``write_file(path, file)`` writes one) split across ``writers``, then
    writer 0 writes ``finish`` (``name -> text``: the index, config files) and publishes them
    all into the directory ``output``. ``start_check(writer)`` starts that writer's share of
    a check that runs beside the writing (the source's sha256s) and returns its wait; a
    mismatch fails the set as a write would. Returns the paths written (on every writer). On
    any failure every writer raises the same ``CheckpointError`` and nothing is left of the
    set."""
    count, rank = writers.size(), writers.rank()
    owner = owners(files, count)
    tmp = None
    if rank == 0:
        try:
            tmp = make_temp(output)
        except OSError as e:
            tmp = CheckpointError(f"writer 0 could not make a temp directory beside {output}: {e}")
    tmp = _raised(writers.from_writer0(tmp))  # every rank of a group must see it
    try:
        if writers.group is not None:
            failures = [None] * count
            failure = _write_own(tmp, files, owner, rank, write_file, start_check)
            dist.all_gather_object(failures, failure, group=writers.group)
        else:
            failures = _write_forked(tmp, files, owner, write_file, start_check)
        _raise_first(failures, output)
        published = _publish(tmp, output, files, finish) if rank == 0 else None
        return _raised(writers.from_writer0(published))
    finally:
        if rank == 0:
            remove(tmp)


def _raised(outcome):
    """Writer 0's outcome as every writer was told it: a ``CheckpointError`` is raised."""
    if isinstance(outcome, CheckpointError):
        raise outcome
    return outcome


def _write_own(tmp, files, owner, writer, write_file, start_check) -> tuple | None:
    """This writer's files, and its share of the check: ``None``, or what failed
    ``(writer, file, error)`` (a file name of ``None``: the check)."""
    wait = start_check(writer)
    for file, w in zip(files, owner):
        if w != writer:
            continue
        try:
            write_file(os.path.join(tmp, file.name), file)
        except Exception as e:  # every writer must hear of it: raised after the agreement
            return (writer, file.name, f"{type(e).__name__}: {e}")
    try:
        wait()
    except Exception as e:
        return (writer, None, str(e))
    return None


def _write_forked(tmp, files, owner, write_file, start_check) -> list:
    """Writers 1.. forked (they inherit the open source), writer 0 this process; each
    child sends back what ``_write_own`` returned. A child that dies unheard is a failure."""
    count = max(owner, default=0) + 1
    ctx = multiprocessing.get_context("fork")  # before any thread: the check starts after
    children = []
    for writer in range(1, count):
        receive, send = ctx.Pipe(duplex=False)
        child = ctx.Process(
            target=_child, args=(send, tmp, files, owner, writer, write_file), daemon=True
        )
        child.start()
        send.close()
        children.append((writer, child, receive))
    failures = [_write_own(tmp, files, owner, 0, write_file, start_check)]
    for writer, child, receive in children:
        try:
            failures.append(receive.recv())
        except EOFError:  # named by the first file it had to write
            first = next((f.name for f, w in zip(files, owner) if w == writer), None)
            failures.append((writer, first, "the writer died"))
        child.join()
        if failures[-1] is None and child.exitcode != 0:
            failures[-1] = (writer, None, f"the writer exited with {child.exitcode}")
    return failures


def _child(send, tmp, files, owner, writer, write_file) -> None:
    try:
        send.send(_write_own(tmp, files, owner, writer, write_file, lambda w: lambda: None))
    finally:
        send.close()
        os._exit(0)  # no interpreter teardown: the parent owns the temp directory and files


def _raise_first(failures: list, output: str) -> None:
    failed = [f for f in failures if f is not None]
    if not failed:
        return
    writer, fname, error = failed[0]
    what = f"writing {fname}" if fname else "checking the source"
    others = f" (and {len(failed) - 1} other writer(s))" if len(failed) > 1 else ""
    raise CheckpointError(
        f"writer {writer} failed {what} for {output}{others}: {error}; nothing was published"
    )


def _publish(tmp: str, output: str, files: list[SetFile], finish: dict[str, str]) -> list:
    """Writer 0: the index and config files, then everything into ``output`` (renamed whole
    when it does not exist yet; else file by file, the index last). Returns the paths, or
    the error for every writer to raise."""
    try:
        for name, text in finish.items():
            write_whole(os.path.join(tmp, name), text.encode())
        names = [f.name for f in files] + list(finish)
        if not os.path.lexists(output):
            os.rename(tmp, output)  # the cleanup after finds no temp directory: nothing to do
        else:
            for name in sorted(names, key=lambda n: n == HF_INDEX):
                os.replace(os.path.join(tmp, name), os.path.join(output, name))
        return [os.path.join(output, name) for name in names]
    except OSError as e:
        return CheckpointError(f"writer 0 failed publishing {output}: {e}")
