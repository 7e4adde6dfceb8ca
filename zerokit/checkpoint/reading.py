"""Reading a checkpoint: one directory handle, one mapping per file, nothing followed.

Note: a load must return one checkpoint or an error, even while a save replaces the same path.
So the directory is opened once and every file is opened relative to that handle: a save that
swaps directories mid-load leaves this load reading the directory it started with (or failing
when its files are gone). A file is mapped once, and its sha256, its header and the values
are all read through that one mapping of one open file, never by name again. Entries are
looked at with ``lstat`` and opened with ``O_NOFOLLOW | O_NONBLOCK``: a symbolic link, FIFO or
device inside a checkpoint is refused without being followed or opened, and the message says
nothing about what it points to. The checkpoint directory itself may be a symbolic link
(``latest -> step_1000``); it is resolved once, when it is opened.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import stat
import struct

import torch

from .dcp_format import METADATA
from .index import (
    INDEX_NAME,
    MAX_INDEX_BYTES,
    CheckpointError,
    dtype_from_name,
    parse_index,
    part_numel,
    split_from_json,
)
from .streaming import SAFETENSORS_DTYPES

OLD_SUFFIX = ".zerokit-old"
_MAX_HEADER = 100 << 20
DTYPE_OF = {code: dtype for dtype, code in SAFETENSORS_DTYPES.items()}
_KINDS = {
    stat.S_ISREG: "a regular file",
    stat.S_ISLNK: "a symbolic link",
    stat.S_ISDIR: "a directory",
    stat.S_ISFIFO: "a FIFO",
    stat.S_ISSOCK: "a socket",
    stat.S_ISCHR: "a character device",
    stat.S_ISBLK: "a block device",
}


def resolve(path: str | os.PathLike) -> str:
    """The checkpoint directory; the previous one if a save died between its two renames."""
    path = os.fspath(path).rstrip("/") or "/"
    old = path + OLD_SUFFIX
    if not os.path.lexists(path) and any(
        os.path.isfile(os.path.join(old, name)) for name in (INDEX_NAME, METADATA)
    ):
        return old
    return path


def kind_of(mode: int) -> str:
    return next((kind for test, kind in _KINDS.items() if test(mode)), "a special file")


def open_regular(dir_fd: int, name: str, where: str) -> int:
    """An fd for the regular file ``name`` in ``dir_fd``; anything else is refused unopened."""
    try:
        before = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        gone = os.fstat(dir_fd).st_nlink == 0
        hint = " (the checkpoint was replaced or removed while being read: load again)"
        raise CheckpointError(f"{where}: missing" + (hint if gone else "")) from None
    if not stat.S_ISREG(before.st_mode):
        raise CheckpointError(
            f"{where}: is {kind_of(before.st_mode)}; a checkpoint holds regular files only "
            "(refused without following or opening it)"
        )
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fd = os.open(name, flags, dir_fd=dir_fd)
    now = os.fstat(fd)
    if (now.st_dev, now.st_ino) != (before.st_dev, before.st_ino) or not stat.S_ISREG(now.st_mode):
        os.close(fd)
        raise CheckpointError(f"{where}: replaced while being opened; load again")
    return fd


class ShardFile:
    """One safetensors file, mapped once: hashed, parsed and read through that mapping."""

    def __init__(self, dir_fd: int, name: str, where: str, keep_fd: bool = False):
        self.where = where
        fd = open_regular(dir_fd, name, where)
        self.fd = fd if keep_fd else None  # for ``pread_into``; closed by ``close``
        try:
            self.size = os.fstat(fd).st_size
            self.mm = mmap.mmap(fd, self.size, access=mmap.ACCESS_COPY) if self.size else None
        except BaseException:
            os.close(fd)
            raise
        if not keep_fd:
            os.close(fd)  # the mapping keeps the file
        self.header: dict = {}
        self.data_start = 0

    def verify(self, size: int, sha256: str | None) -> None:
        """Size, sha256 (unless None: ``check_sha256`` later) and header."""
        if self.size != size:
            raise CheckpointError(
                f"{self.where}: {self.size} bytes, the index says {size} (truncated?)"
            )
        if sha256 is not None:
            self.check_sha256(sha256)
        self.header, self.data_start = self.parse_header()

    def check_sha256(self, sha256: str) -> None:
        digest, view = hashlib.sha256(), memoryview(self.mm) if self.mm else memoryview(b"")
        for begin in range(0, self.size, 1 << 26):
            digest.update(view[begin : begin + (1 << 26)])  # hashlib lets go of the GIL
        view.release()
        if digest.hexdigest() != sha256:
            raise CheckpointError(
                f"{self.where}: sha256 does not match the index (corrupted or replaced)"
            )

    def span(self, key: str, lo: int, hi: int) -> tuple[int, int]:
        """Where elements ``[lo, hi)`` of the flattened tensor ``key`` lie in the file: their
        first byte and how many bytes."""
        info = self.header[key]
        itemsize = DTYPE_OF[info["dtype"]].itemsize
        return self.data_start + info["data_offsets"][0] + lo * itemsize, (hi - lo) * itemsize

    def parse_header(self) -> tuple[dict, int]:
        bad = f"{self.where}: not a valid safetensors file"
        if self.size < 8:
            raise CheckpointError(f"{bad}: {self.size} bytes")
        (length,) = struct.unpack("<Q", self.mm[:8])
        if length > min(self.size - 8, _MAX_HEADER):
            raise CheckpointError(f"{bad}: a header of {length} bytes in a file of {self.size}")
        try:
            header = json.loads(bytes(self.mm[8 : 8 + length]).decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise CheckpointError(f"{bad}: {e}") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{bad}: the header is not an object")
        data = self.size - 8 - length
        for key, info in header.items():
            if key == "__metadata__":
                continue
            try:  # a field missing or of another type raises: not ok
                begin, end = info["data_offsets"]
                shape, itemsize = info["shape"], DTYPE_OF[info["dtype"]].itemsize
                ok = isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)
                ok = ok and type(begin) is int and type(end) is int and 0 <= begin <= end <= data
                ok = ok and end - begin == math.prod(shape) * itemsize
            except (TypeError, KeyError, ValueError):
                ok = False
            if not ok:
                raise CheckpointError(f"{bad}: bad header entry for {key!r}")
        return header, 8 + length

    def check_entry(self, key: str, dtype: torch.dtype, shape: list[int], what: str) -> None:
        """The header holds ``key`` as ``dtype`` ``shape``, as the index says."""
        info = self.header.get(key)
        if info is None:
            raise CheckpointError(f"{self.where}: has no {key!r} ({what})")
        if info["shape"] != list(shape) or info["dtype"] != SAFETENSORS_DTYPES[dtype]:
            raise CheckpointError(
                f"{self.where}: {key!r} is {info['dtype']} {info['shape']}, the index says "
                f"{str(dtype).removeprefix('torch.')} {list(shape)} ({what})"
            )

    def pread_into(self, key: str, lo: int, hi: int, out: torch.Tensor) -> None:
        """Elements ``[lo, hi)`` of the flattened tensor ``key`` read by ``pread`` (kept fd)
        straight into ``out`` (1-D, of the file's dtype): one copy by the kernel from the page
        cache, no page faults on the mapping and nothing of the file left mapped in this
        process."""
        offset, nbytes = self.span(key, lo, hi)
        view = memoryview(out.view(torch.uint8).numpy())[:nbytes]
        while view.nbytes:
            n = os.preadv(self.fd, [view], offset)
            if n == 0:
                raise CheckpointError(f"{self.where}: ended early (truncated while being read?)")
            view, offset = view[n:], offset + n

    def close(self) -> None:
        if self.mm is not None:
            self.mm.close()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def read(self, key: str, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the flattened tensor ``key``: a tensor of its own (copied
        out: the mapping can be closed afterwards)."""
        offset, nbytes = self.span(key, lo, hi)
        dtype = DTYPE_OF[self.header[key]["dtype"]]
        if not nbytes:  # torch.frombuffer refuses an empty range
            return torch.empty(0, dtype=dtype)
        raw = torch.frombuffer(self.mm, dtype=torch.uint8, count=nbytes, offset=offset)
        return raw.clone().view(dtype)


def _no_index(directory: str, where: str) -> str:
    """Why a directory without ``index.json`` cannot be read, and what reads it if it can."""
    pretrained = ("model.safetensors", "model.safetensors.index.json")  # save_pretrained's
    if any(os.path.isfile(os.path.join(directory, name)) for name in pretrained):
        return (
            f"{directory}: plain safetensors weights (a save_pretrained folder), not a zerokit "
            "checkpoint (no index.json): load them with "
            "zerokit.checkpoint.load_pretrained(model, path)"
        )
    return f"{where}: no checkpoint index here (not a checkpoint, or an incomplete save)"


class CheckpointReader:
    """A checkpoint opened for reading: its index (checked) and its files (each checked, size,
    sha256 and header, the first time it is used). ``digest`` is the sha256 of the index as
    read: two readers with the same digest read the same checkpoint."""

    def __init__(self, path: str | os.PathLike):
        self.directory = resolve(path)
        try:
            self._dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise CheckpointError(f"{self.directory}: no checkpoint here") from None
        except NotADirectoryError:
            raise CheckpointError(
                f"{self.directory}: not a directory, so not a checkpoint"
            ) from None
        self._files: dict[str, ShardFile] = {}
        self._hashing: list = []  # verify_all's background sha256s, each a Future
        try:
            where = os.path.join(self.directory, INDEX_NAME)
            try:
                fd = open_regular(self._dir_fd, INDEX_NAME, where)
            except CheckpointError as e:
                if str(e).endswith("missing"):
                    raise CheckpointError(_no_index(self.directory, where)) from None
                raise
            with os.fdopen(fd, "rb") as f:
                raw = f.read(MAX_INDEX_BYTES + 1)
            if len(raw) > MAX_INDEX_BYTES:
                raise CheckpointError(f"{where}: larger than {MAX_INDEX_BYTES} bytes")
            self.digest = hashlib.sha256(raw).hexdigest()
            self.index = parse_index(raw, where)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        # a background hash still reading a mapping (an export that failed before waiting for
        # it) would make closing that mapping raise BufferError: let it end first
        for pending in self._hashing:
            pending.cancel() or pending.exception()
        for f in self._files.values():
            f.close()
        self._files.clear()
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def verify_file(self, name: str, hash: bool = True) -> ShardFile:
        """Open a listed file once, checking its size, sha256 (unless ``hash=False``: see
        ``verify_all``) and header against the index."""
        if name in self._files:
            return self._files[name]
        listed = self.index["files"][name]
        shard = ShardFile(self._dir_fd, name, os.path.join(self.directory, name))
        try:
            shard.verify(listed["size"], listed["sha256"] if hash else None)
            for tensor, entry in self.index["tensors"].items():
                dtype = dtype_from_name(entry["dtype"], tensor)
                for pieces in entry["parts"].values():
                    for piece in pieces:
                        if piece["file"] == name:
                            what = f"piece of {tensor}"
                            shard.check_entry(piece["key"], dtype, [piece["numel"]], what)
            for key, value in self.index.get("extra", {}).items():
                for saved in value["values"]:
                    for ref in saved["tensors"]:
                        if ref["file"] == name:
                            dtype = dtype_from_name(ref["dtype"], f"extra {key!r}")
                            shard.check_entry(ref["key"], dtype, ref["shape"], f"extra {key!r}")
        except BaseException:
            shard.close()
            raise
        self._files[name] = shard
        return shard

    def verify_all(self, hash_in_background: bool = False, hash: bool = True, hashed=None):
        """Every file's size and header now (so no tensor can claim bytes its file lacks) and
        its sha256: now, or with ``hash_in_background`` in a thread beside the caller's work
        (hashlib lets go of the GIL); then it returns a function that waits for the hashes
        and raises ``CheckpointError`` if one does not match (call it before publishing).
        ``hash=False``: sizes and headers only. ``hashed``: the files whose sha256 the
        background hashes (default all; several writers each take a share)."""
        for name in self.index["files"]:
            self.verify_file(name, hash=hash and not hash_in_background)
        if not hash_in_background or not hash:
            return lambda: None
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="zerokit-sha256")
        sums = [
            pool.submit(self._files[n].check_sha256, listed["sha256"])
            for n, listed in self.index["files"].items()
            if hashed is None or n in hashed
        ]
        pool.shutdown(wait=False)
        self._hashing = sums
        return lambda: [s.result() for s in sums] and None

    def buffers(self, name: str) -> list[memoryview]:
        """The bytes of an untransformed tensor (no tp split), its pieces in order, as views of
        the mappings: written out without a copy. Files must have been verified."""
        pieces = sorted(self.index["tensors"][name]["parts"].get("0", []), key=lambda p: p["start"])
        views = []
        for piece in pieces:
            shard = self._files[piece["file"]]
            begin, nbytes = shard.span(piece["key"], 0, piece["numel"])
            views.append(memoryview(shard.mm)[begin : begin + nbytes])
        return views

    def read_part(self, name: str, tp_rank: int, start: int, numel: int) -> torch.Tensor:
        """Elements ``[start, start + numel)`` of tp part ``tp_rank`` of ``name``, flattened."""
        entry = self.index["tensors"][name]
        out = torch.empty(numel, dtype=dtype_from_name(entry["dtype"], name))
        for piece in entry["parts"].get(str(tp_rank), []):
            lo, hi = max(start, piece["start"]), min(start + numel, piece["start"] + piece["numel"])
            if lo < hi:
                shard = self.verify_file(piece["file"])
                out[lo - start : hi - start] = shard.read(
                    piece["key"], lo - piece["start"], hi - piece["start"]
                )
        return out

    def read_full(self, name: str) -> torch.Tensor:
        """The whole tensor, tp parts assembled, in its full shape."""
        entry = self.index["tensors"][name]
        split = split_from_json(entry["tp"])
        if split is None:
            return self.read_part(name, 0, 0, part_numel(entry, 0)).view(entry["shape"])
        parts = []
        for t in range(len(split.block_sizes)):
            shape = list(entry["shape"])
            shape[split.dim] = split.local_size(t)
            parts.append(self.read_part(name, t, 0, part_numel(entry, t)).view(shape))
        return split.assemble(parts)

    def read_tensor(self, file: str, key: str) -> torch.Tensor:
        """A whole tensor stored under ``key`` (extra state)."""
        shard = self.verify_file(file)
        shape = shard.header[key]["shape"]
        return shard.read(key, 0, math.prod(shape)).view(shape)
