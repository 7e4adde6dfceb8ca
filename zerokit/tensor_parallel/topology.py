"""How a tensor is split across the tp ranks (``TPSplit``): the rule tensor-parallel layers,
their state dicts and checkpoints share. The process groups live in ``zerokit.layout``."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TPSplit:
    """How one tensor is split along ``dim`` across the tp ranks.

    The dimension is ``stride`` equal blocks (e.g. a fused q, k, v projection: stride 3), and
    each block is split the same way: equal parts, the last rank taking the remainder. Rank r
    holds part r of every block, side by side.

    >>> split = TPSplit.of(dim=0, size=10, tp_degree=3)
    >>> split.block_sizes, split.local_size(2)
    ((3, 3, 4), 4)
    >>> full = torch.arange(12).view(6, 2)
    >>> qkv = TPSplit.of(dim=0, size=6, tp_degree=2, stride=3)
    >>> [qkv.local(full, r)[:, 0].tolist() for r in range(2)]
    [[0, 4, 8], [2, 6, 10]]
    >>> torch.equal(qkv.assemble([qkv.local(full, r) for r in range(2)]), full)
    True
    """

    dim: int
    block_sizes: tuple[int, ...]  # one block's part per tp rank
    stride: int = 1

    @staticmethod
    def of(dim: int, size: int, tp_degree: int, stride: int = 1, what: str = "") -> TPSplit:
        what = what or f"dimension of size {size}"
        if size % stride:
            raise ValueError(f"{what}: {size} is not a multiple of its {stride} fused blocks")
        block = size // stride
        per_rank = block // tp_degree
        if per_rank == 0:
            raise ValueError(f"{what}: {block} features cannot be split across {tp_degree} ranks")
        sizes = (per_rank,) * (tp_degree - 1) + (block - per_rank * (tp_degree - 1),)
        return TPSplit(dim, sizes, stride)

    @property
    def full_size(self) -> int:
        return sum(self.block_sizes) * self.stride

    def local_size(self, tp_rank: int) -> int:
        return self.block_sizes[tp_rank] * self.stride

    def start(self, tp_rank: int) -> int:
        """Where rank ``tp_rank``'s part begins inside each block."""
        return sum(self.block_sizes[:tp_rank])

    def local(self, full: torch.Tensor, tp_rank: int) -> torch.Tensor:
        """Rank ``tp_rank``'s part of the full tensor (a copy when stride > 1)."""
        blocks = full.chunk(self.stride, dim=self.dim)
        start, size = self.start(tp_rank), self.block_sizes[tp_rank]
        parts = [b.narrow(self.dim, start, size) for b in blocks]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)

    def assemble(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's part, in tp-rank order."""
        per_rank_blocks = [p.chunk(self.stride, dim=self.dim) for p in parts]
        blocks = [
            torch.cat([blocks[b] for blocks in per_rank_blocks], dim=self.dim)
            for b in range(self.stride)
        ]
        return torch.cat(blocks, dim=self.dim)
