"""An async save's stage: the host memory its snapshot is copied into, kept between saves,
faulted in on another thread when it is made.

Note: why keep it, one block per dtype, and the faulting thread. Fresh host memory costs its
first writer a page fault per 4 KiB page (about 0.06 s of CPU per 157 MiB here), and the
first ``async_save`` wrote all of it while training waited; the next save of the same model
copies into the same memory, a plain memcpy. So the blocks are kept (one per dtype, the
chunks views of them), and fresh ones are faulted in by a thread of their own
(``madvise(MADV_POPULATE_WRITE)``, Linux >= 5.14: the kernel faults a range in bulk and
changes no byte of it) started when they are made, before the ranks agree: the faults overlap
the agreement's waits, and a copy that catches up with the thread faults the rest itself,
so nothing waits for it. Pinned CUDA memory is faulted in by its allocation. Transparent huge
pages (``madvise(MADV_HUGEPAGE)``) were tried and measured slower: the kernel's zeroing of
2 MiB pages cost the first copy more CPU time than the small pages' faults
(docs/BENCHMARKS.md). ``prewarm`` pays all of it ahead of the first save, when the caller
asks. The blocks are reused only once the previous save has finished
(``protocol.wait_in_flight`` runs first), and made anew when any chunk's shape or dtype
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
    """Host buffers in chunk order, one block per dtype, faulted in on another thread."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []  # views of ``_blocks``, one per chunk
        self._blocks: list[torch.Tensor] = []
        self._made_for: tuple = ()  # (shape, dtype) of each buffer
        self._faulted = threading.Event()  # set once the blocks' faulting thread is done
        self._faulted.set()
        self._faulted_in = os.getpid()  # the process whose thread sets it (not a fork's)

    @property
    def nbytes(self) -> int:
        """The host memory the staging holds (what ``zerokit plan`` counts for async save)."""
        return sum(b.numel() * b.element_size() for b in self._blocks)

    def fit(self, likes: list[tuple[torch.Size, torch.dtype]], pinned: bool = False) -> bool:
        """Buffers of these shapes and dtypes: kept if they are, else made, and their faulting
        begun on another thread. Returns whether they were made now."""
        made_for = tuple(likes)
        if made_for == self._made_for:
            return False
        if self._faulted_in == os.getpid():  # the thread holds the old blocks: freed after it
            self._faulted.wait()
        self.buffers, self._blocks, self._made_for = [], [], ()  # freed before the new ones
        numel: dict[torch.dtype, int] = {}
        for shape, dtype in likes:
            numel[dtype] = numel.get(dtype, 0) + shape.numel()
        blocks = {
            dtype: torch.empty(n, dtype=dtype, pin_memory=pinned) for dtype, n in numel.items()
        }
        taken = dict.fromkeys(numel, 0)
        for shape, dtype in likes:
            at = taken[dtype]
            self.buffers.append(blocks[dtype][at : at + shape.numel()].view(shape))
            taken[dtype] = at + shape.numel()
        self._blocks, self._made_for = list(blocks.values()), made_for
        if not pinned:
            self._faulted, self._faulted_in = threading.Event(), os.getpid()
            # not threading.Thread: its start() waits until the new thread runs (up to 0.16 s
            # measured at this machine's load), on the caller's path
            _thread.start_new_thread(_fault_in, (self._blocks, self._faulted))
        return True

    def fit_chunks(self, chunks: list[Chunk]) -> bool:
        """``fit`` for the primary ones of ``chunks`` (pinned if any is on CUDA)."""
        pinned = torch.cuda.is_available() and any(c.tensor.device.type == "cuda" for c in chunks)
        return self.fit([(c.tensor.shape, c.tensor.dtype) for c in chunks if c.primary], pinned)

    def copy(self, chunks: list[Chunk]) -> list[Chunk]:
        """``chunks`` with every primary one's data copied into its buffer (non-primary ones
        empty: nothing of theirs is written)."""
        self.fit_chunks(chunks)
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
        if self.fit_chunks(collect(model, optimizer).chunks):
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
    """Every page of ``block`` faulted in by the kernel, its contents unchanged; False where
    this is not Linux >= 5.14 (ctypes lets go of the GIL for the call)."""
    if not sys.platform.startswith("linux") or not block.numel():
        return False
    start = block.data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE  # the kernel rounds the end up
    end = block.data_ptr() + block.numel() * block.element_size()
    madvise = ctypes.CDLL(None).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise(start, end - start, _MADV_POPULATE_WRITE) == 0
