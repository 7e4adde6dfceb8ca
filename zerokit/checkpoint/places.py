"""Where a save writes, and what it may remove: the lock, the temp directory, the debris.

Note: a save replaces only a zerokit checkpoint (a directory holding ``index.json`` of our
format and the files it lists, nothing else) or an empty directory; anything else at the path
(a run directory, a file, a symbolic link) is refused and named. Saves of one path are
serialised by an exclusive ``flock`` on ``<path>.zerokit-lock``, held by rank 0 from before it
looks at the path until the new checkpoint is in place; a second save fails at once and says
who holds the lock. Each save builds in its own ``<path>.zerokit-tmp-<random>``. Under the
lock, every such directory and a ``<path>.zerokit-old`` are debris of a save that died (the
kernel releases a dead process's lock), so they are removed: a symbolic link or file by
unlinking it, never following it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import secrets
import shutil
import socket
import stat
import time

from .dcp_format import METADATA
from .fields import listing
from .index import FORMAT, INDEX_NAME, MAX_INDEX_BYTES, CheckpointError
from .reading import OLD_SUFFIX, kind_of

TMP_INFIX = ".zerokit-tmp-"
LOCK_SUFFIX = ".zerokit-lock"
_DCP_FILE = re.compile(r"^__\d+_\d+\.distcp$")


def _listing(names: list[str], path: str) -> str:  # a directory's name ends in a slash
    return listing(sorted(names), 5, lambda n: n + "/" * os.path.isdir(os.path.join(path, n)))


def why_not_replaceable(path: str) -> str | None:
    """None if a save may replace what is at ``path`` (nothing, an empty directory, a zerokit
    checkpoint, or a DCP checkpoint: ``.metadata`` and ``__<rank>_<n>.distcp`` files only),
    else what is there."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is {kind_of(st.st_mode)}, not a zerokit checkpoint"
    names = os.listdir(path)
    if not names:
        return None
    if METADATA in names and INDEX_NAME not in names:
        others = [n for n in names if n != METADATA and not _DCP_FILE.match(n)]
        if others:
            return f"{path} is a DCP checkpoint that also holds {_listing(others, path)}"
        return None
    if INDEX_NAME not in names:
        return f"{path} is a directory holding {_listing(names, path)}, not a zerokit checkpoint"
    try:
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        with os.fdopen(os.open(os.path.join(path, INDEX_NAME), flags), "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ValueError("not a regular file")
            index = json.loads(f.read(MAX_INDEX_BYTES))
    except (OSError, ValueError):
        index = None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        return f"{path}/{INDEX_NAME} is not a zerokit checkpoint index"
    listed = index["files"] if isinstance(index.get("files"), dict) else {}
    others = [
        n
        for n in names
        if n != INDEX_NAME
        and (n not in listed or not stat.S_ISREG(os.lstat(os.path.join(path, n)).st_mode))
    ]
    if others:
        return f"{path} is a zerokit checkpoint that also holds {_listing(others, path)}"
    return None


def remove(path: str) -> None:
    """Remove ``path``: a real directory with everything in it, anything else by unlinking it
    (a symbolic link is removed, never followed)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)  # rmtree does not follow symbolic links inside
    else:
        os.unlink(path)


def clear_debris(path: str) -> None:
    """Under the lock: recover ``<path>`` from ``.zerokit-old`` if a save died between its two
    renames, then remove every temp directory and old copy left by saves that died."""
    old = path + OLD_SUFFIX
    if not os.path.lexists(path) and os.path.isdir(old) and not os.path.islink(old):
        os.replace(old, path)  # that was the last good checkpoint
    parent, base = os.path.split(path)
    for name in os.listdir(parent or "."):
        if name.startswith(base + TMP_INFIX) or name in (base + ".zerokit-tmp", base + OLD_SUFFIX):
            remove(os.path.join(parent, name))


def write_whole(path: str, data: bytes) -> None:
    """``path`` holds ``data`` or is not there: written beside it, fsynced, renamed."""
    partial = path + ".tmp"
    with open(partial, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


def make_temp(path: str) -> str:
    tmp = f"{path}{TMP_INFIX}{secrets.token_hex(6)}"
    os.mkdir(tmp)  # fails if it exists: never another save's directory
    return tmp


class SaveLock:
    """An exclusive lock on saving to ``path``, for as long as it is held (rank 0 only)."""

    def __init__(self, path: str):
        self.path = path + LOCK_SUFFIX
        self.fd: int | None = None

    def acquire(self) -> SaveLock:
        while True:
            try:
                fd = os.open(
                    self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644
                )
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise CheckpointError(f"{self.path} is a symbolic link; remove it") from None
                raise
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
                os.close(fd)
                raise CheckpointError(
                    f"another save of {self.path.removesuffix(LOCK_SUFFIX)} is in progress "
                    f"({holder}); this save wrote nothing and the checkpoint there is untouched"
                ) from None
            try:  # the file we locked must still be the one at the path (see release)
                same = os.stat(self.path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        info = f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}"
        os.ftruncate(fd, 0)
        os.pwrite(fd, info.encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is None:
            return
        # unlink while still holding it: a waiter that opened the old file finds it unlinked
        # (the inode check above) and retries on a new one
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self.fd)
        self.fd = None
