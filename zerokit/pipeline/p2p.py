"""Point-to-point transfers between neighbouring stages: activations forward, their gradients
backward. Each transfer is a fixed-size header (dtype, shape) then the tensor, so stages need
not know each other's shapes. Sends are asynchronous (kept until ``Mailbox.finish``), receives
block: with sends that never wait, any schedule in which every receive has a matching earlier
send cannot deadlock, and messages between two ranks arrive in the order they were sent.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..runtime.teardown import hand

_MAX_DIMS = 8
_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.bool,
]


class Mailbox:
    """Transfers with the previous and next stage of one pipeline (``pp_group``)."""

    def __init__(self, group: ProcessGroup | None, stage: int, num_stages: int):
        self.group, self.stage, self.num_stages = group, stage, num_stages
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []

    def _global(self, stage: int) -> int:
        return dist.get_global_rank(self.group, stage)

    def send(self, tensor: torch.Tensor, stage: int) -> None:
        tensor = tensor.detach().contiguous()
        if tensor.dim() > _MAX_DIMS:
            raise ValueError(
                f"pipeline transfers support up to {_MAX_DIMS} dims, got {tensor.dim()}"
            )
        header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64)
        header[0], header[1] = _DTYPES.index(tensor.dtype), tensor.dim()
        header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        dst = self._global(stage)
        for t in (header, tensor):
            self._pending.append((dist.isend(hand(t), dst, group=self.group), t))

    def recv(self, stage: int) -> torch.Tensor:
        src = self._global(stage)
        header = torch.empty(2 + _MAX_DIMS, dtype=torch.int64)
        dist.recv(hand(header), src, group=self.group)
        dtype, ndim = _DTYPES[int(header[0])], int(header[1])
        tensor = torch.empty(header[2 : 2 + ndim].tolist(), dtype=dtype)
        dist.recv(hand(tensor), src, group=self.group)
        return tensor

    def finish(self) -> None:
        """Wait for every send (their buffers are held until then)."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
