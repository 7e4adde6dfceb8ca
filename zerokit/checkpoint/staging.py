"""An async save's stage: the host memory its snapshot is copied into, kept between saves.

Note: why keep it, and why one block per dtype. A fresh host copy of every primary chunk costs
the first ``async_save`` the allocation and the page faults of all of that memory (on CUDA,
pinning it too) while training waits; the next save of the same model copies into the same
memory, a plain memcpy. The first save makes that memory as cheaply as it can: one block per
dtype (the chunks are views of it), faulted in by the copy itself (no zeroing pass first).
Transparent huge pages (``madvise(MADV_HUGEPAGE)`` on the blocks) were tried and measured
slower: the kernel's zeroing of 2 MiB pages cost the first copy more CPU time than the small
pages' faults (docs/BENCHMARKS.md). ``prewarm`` pays all of it ahead of the first save, when
the caller asks. The blocks are reused only once the previous save has finished
(``protocol.wait_in_flight`` runs first), and made anew when any chunk's shape or dtype
changed (the old ones freed first).
"""

from __future__ import annotations

import torch

from .holdings import Chunk, collect


class StagingBuffers:
    """The host buffers of one process's async saves, in chunk order."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []  # views of ``_blocks``, one per primary chunk
        self._blocks: list[torch.Tensor] = []
        self._made_for: tuple = ()  # (shape, dtype) of each buffer

    @property
    def nbytes(self) -> int:
        """The host memory the staging holds (what ``zerokit plan`` counts for async save)."""
        return sum(b.numel() * b.element_size() for b in self._blocks)

    def fit(self, likes: list[torch.Tensor]) -> bool:
        """Buffers shaped and typed as ``likes``: kept if they are, else made (unfaulted).
        Returns whether they were made now."""
        made_for = tuple((t.shape, t.dtype) for t in likes)
        if made_for == self._made_for:
            return False
        self.buffers, self._blocks, self._made_for = [], [], ()  # freed before the new ones
        pinned = any(t.device.type == "cuda" for t in likes) and torch.cuda.is_available()
        numel: dict[torch.dtype, int] = {}
        for t in likes:
            numel[t.dtype] = numel.get(t.dtype, 0) + t.numel()
        blocks = {dtype: _block(n, dtype, pinned) for dtype, n in numel.items()}
        taken = dict.fromkeys(numel, 0)
        for t in likes:
            at = taken[t.dtype]
            self.buffers.append(blocks[t.dtype][at : at + t.numel()].view(t.shape))
            taken[t.dtype] = at + t.numel()
        self._blocks, self._made_for = list(blocks.values()), made_for
        return True

    def copy(self, chunks: list[Chunk]) -> list[Chunk]:
        """``chunks`` with every primary one's data copied into its buffer (non-primary ones
        empty: nothing of theirs is written)."""
        self.fit([c.tensor for c in chunks if c.primary])
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
        if self.fit([c.tensor for c in collect(model, optimizer).chunks if c.primary]):
            for block in self._blocks:
                block.zero_()  # faulted in now, not during the next copy
        return self.nbytes


def _block(numel: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, pin_memory=pinned)
