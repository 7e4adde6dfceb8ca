"""An async save's stage: the host memory its snapshot is copied into, kept between saves.

Note: why keep it, one block per dtype, faulted in on another thread. Fresh host memory
costs its first writer a page fault per 4 KiB page (about 0.06 s of CPU per 157 MiB here);
the next save of the same model copies into the same memory, a plain memcpy. So the blocks
are kept (the chunks are views of them), and fresh ones are faulted in by a thread of their
own (``madvise(MADV_POPULATE_WRITE)``, Linux >= 5.14: in bulk, no byte changed), started
before the ranks agree: the faults overlap the agreement's waits, and a copy that catches
the thread up faults the rest itself, so nothing waits for it. Pinned CUDA memory is faulted
in by its allocation. Transparent huge pages were measured slower (docs/BENCHMARKS.md).
``prewarm`` pays it all ahead, when asked. The blocks are reused once the previous save has
finished (``protocol.wait_in_flight`` runs first), made anew when a chunk's shape or dtype
changed (the old ones freed first, their faulting finished).
"""

from __future__ import annotations

import _thread
import ctypes
import mmap
import os
import sys
import threading

import torch

from .holdings import Chunk, collect

_MADV_POPULATE_WRITE = 23  # linux/mman.h


class StagingBuffers:
    """The host buffers of one process's async saves, in primary chunk order."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []  # views of ``_blocks``, one per primary chunk
        self._blocks: list[torch.Tensor] = []
        self._made_for: tuple = ()  # (shape, dtype) of each buffer
        self._faulted = threading.Event()  # set once the blocks' faulting thread is done
        self._faulted.set()
        self._faulted_in = os.getpid()  # the process whose thread sets it (not a fork's)

    @property
    def nbytes(self) -> int:
        """The host memory the staging holds (what ``zerokit plan`` counts for async save)."""
        return sum(b.numel() * b.element_size() for b in self._blocks)

    def fit(self, chunks: list[Chunk]) -> bool:
        """Buffers shaped and typed as the primary ``chunks``: kept if they are, else made
        (pinned if a chunk is on CUDA) and their faulting begun. Returns whether made now."""
        likes = [c.tensor for c in chunks if c.primary]
        made_for = tuple((t.shape, t.dtype) for t in likes)
        if made_for == self._made_for:
            return False
        if self._faulted_in == os.getpid():  # the thread holds the old blocks: freed after it
            self._faulted.wait()
        self.buffers, self._blocks, self._made_for = [], [], ()  # freed before the new ones
        pinned = any(t.device.type == "cuda" for t in likes) and torch.cuda.is_available()
        numel: dict[torch.dtype, int] = {}
        for t in likes:
            numel[t.dtype] = numel.get(t.dtype, 0) + t.numel()
        blocks = {d: torch.empty(n, dtype=d, pin_memory=pinned) for d, n in numel.items()}
        taken = dict.fromkeys(numel, 0)
        for t in likes:
            at = taken[t.dtype]
            self.buffers.append(blocks[t.dtype][at : at + t.numel()].view(t.shape))
            taken[t.dtype] = at + t.numel()
        self._blocks, self._made_for = list(blocks.values()), made_for
        if not pinned:
            self._faulted, self._faulted_in = threading.Event(), os.getpid()
            # not threading.Thread: its start() waits until the new thread runs (up to 0.16 s
            # measured at this machine's load), on the caller's path
            try:
                _thread.start_new_thread(_fault_in, (self._blocks, self._faulted))
            except RuntimeError:  # no thread to be had: the copy faults them in itself
                self._faulted.set()
        return True

    def copy(self, chunks: list[Chunk]) -> list[Chunk]:
        """``chunks`` with every primary one's data copied into its buffer (non-primary ones
        empty: nothing of theirs is written)."""
        self.fit(chunks)
        out, position = [], 0
        for c in chunks:
            if c.primary:
                data = self.buffers[position].copy_(c.tensor.detach(), non_blocking=True)
                position += 1
            else:
                data = c.tensor.new_empty(0, device="cpu")
            out.append(Chunk(c.name, c.start, data, c.primary))
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the non-blocking copies have landed
        return out

    def prewarm(self, model, optimizer=None) -> int:
        """Allocate and fault in the buffers the next ``async_save`` of ``model`` and
        ``optimizer`` will copy into; returns their bytes."""
        if self.fit(collect(model, optimizer).chunks):
            self._faulted.wait()
            for block in self._blocks:
                if not _populate(block):
                    block.zero_()  # no bulk faulting here: the zeroing faults them in
        return self.nbytes


def _fault_in(blocks: list[torch.Tensor], done: threading.Event) -> None:
    try:
        for block in blocks:
            _populate(block)
    finally:
        done.set()


def _populate(block: torch.Tensor) -> bool:
    """Every page of ``block`` faulted in by the kernel, its bytes unchanged; False where
    that is not offered (not Linux >= 5.14). ctypes lets go of the GIL for the call."""
    if not sys.platform.startswith("linux") or not block.numel():
        return False
    start = block.data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE  # the kernel rounds the end up
    end = block.data_ptr() + block.numel() * block.element_size()
    madvise = ctypes.CDLL(None).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise(start, end - start, _MADV_POPULATE_WRITE) == 0
