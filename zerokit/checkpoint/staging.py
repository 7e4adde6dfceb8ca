"""An async save's stage: the host memory its snapshot is copied into, kept between saves.

Note: why keep it. A fresh host copy of every primary chunk costs the first ``async_save`` the
allocation and the page faults of all of that memory (on CUDA, pinning it too) while training
waits; the next save of the same model copies into the same buffers, which is a plain memcpy.
``prewarm`` pays that once, ahead of the first save, when the caller asks. Buffers are reused
only once the previous save has finished (``protocol.wait_in_flight`` runs first), and
replaced where a tensor's shape or dtype changed.
"""

from __future__ import annotations

import torch

from .holdings import Chunk, collect


class StagingBuffers:
    """The host buffers of one process's async saves, in chunk order."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []

    @property
    def nbytes(self) -> int:
        """The host memory the staging holds (what ``zerokit plan`` counts for async save)."""
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def buffer(self, position: int, like: torch.Tensor) -> torch.Tensor:
        """The buffer for the ``position``-th primary chunk, shaped and typed as ``like``."""
        if position < len(self.buffers):
            held = self.buffers[position]
            if held.shape == like.shape and held.dtype == like.dtype:
                return held
        pinned = like.device.type == "cuda" and torch.cuda.is_available()
        fresh = torch.empty(like.shape, dtype=like.dtype, pin_memory=pinned)
        fresh.zero_()  # faulted in now, not during the next copy
        if position < len(self.buffers):
            self.buffers[position] = fresh
        else:
            self.buffers.append(fresh)
        return fresh

    def copy(self, chunks: list[Chunk]) -> list[Chunk]:
        """``chunks`` with every primary one's data copied into its buffer (non-primary ones
        empty: nothing of theirs is written)."""
        out, position = [], 0
        for c in chunks:
            if c.primary:
                data = self.buffer(position, c.tensor).copy_(c.tensor.detach(), non_blocking=True)
                position += 1
            else:
                data = c.tensor.new_empty(0, device="cpu")
            out.append(Chunk(c.name, c.start, data, c.primary))
        del self.buffers[position:]  # a smaller model: what it no longer needs is freed
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the non-blocking copies have landed
        return out

    def prewarm(self, model, optimizer=None) -> int:
        """Allocate (and fault in) the buffers the next ``async_save`` of ``model`` and
        ``optimizer`` will copy into; returns their bytes."""
        position = 0
        for c in collect(model, optimizer).chunks:
            if c.primary:
                self.buffer(position, c.tensor)
                position += 1
        return self.nbytes
