"""Flat parameter storage: one bucket's contiguous buffer, the parameter views into it, and
the pieces of it that this rank's optimizer updates.

After construction every parameter of the bucket *is* a view of ``FlatParamBucket.data``
(``param.data`` is re-pointed), so gathering the flat buffer updates the model in place and the
optimizer's in-place update of a piece writes straight into the parameter.
"""

from __future__ import annotations

import torch
from torch import nn

from .layout import BucketLayout


class FlatParamBucket:
    """Owns one bucket's flat parameter buffer and hands out views of buffers laid out like it.

    ``data`` is the full flat buffer the parameters are views of; ``shard_data`` is this rank's
    shard, which the optimizer's pieces are views of. Here (levels 'os', 'os_g') the shard is a
    view of ``data``; level 'p_g_os' keeps it as a tensor of its own (see ``stage3.py``).
    """

    def __init__(
        self,
        layout: BucketLayout,
        params: list[nn.Parameter],
        rank: int,
        compute_dtype: torch.dtype | None = None,
        master_device: torch.device | None = None,
    ):
        assert len(params) == len(layout.slots)
        self.layout = layout
        self.params = params
        self.pieces = layout.pieces(rank)
        self.shard_start, self.shard_end = layout.shard_range(rank)
        full = torch.zeros(layout.padded_numel, dtype=layout.dtype, device=layout.device)
        with torch.no_grad():
            for i, param in enumerate(params):
                self.slot_view(full, i).copy_(param)
        # The master shard is taken before any cast: it keeps the parameters' exact values.
        cast = compute_dtype not in (None, layout.dtype)
        device = master_device or layout.device  # offload: the master shard lives in CPU memory
        self.shard_data = self._make_shard(full, own=cast or device != full.device, device=device)
        self.data = full.to(compute_dtype) if cast else full
        del full
        for i, param in enumerate(params):
            param.data = self.slot_view(self.data, i)  # the parameter now lives in the bucket
        # What this rank's optimizer updates: 1-D views of its shard, one per parameter piece.
        self.param_pieces = self.piece_views(self.shard_data)

    def _make_shard(self, full: torch.Tensor, own: bool, device: torch.device) -> torch.Tensor:
        """The master shard: a view of the full buffer, or (mixed precision, offload) a tensor
        of its own."""
        return self.shard(full).to(device, copy=True) if own else self.shard(full)

    @property
    def separate_masters(self) -> bool:
        """Do the masters differ from the compute copy in dtype or device (mixed precision,
        offload)? Then they are a tensor apart that must be copied into it after a step."""
        return (self.data.dtype, self.data.device) != (
            self.shard_data.dtype,
            self.shard_data.device,
        )

    def refresh_compute_shard(self) -> None:
        """After a step: cast the updated master shard into the compute copy (mixed precision)."""
        if self.separate_masters:
            self.shard(self.data).copy_(self.shard_data)

    def slot_view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Slot ``i`` of a full-size buffer laid out like ``data``, shaped like its parameter."""
        slot = self.layout.slots[i]
        return flat[slot.offset : slot.end].view(slot.shape)

    def shard(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a full-size buffer."""
        return flat[self.shard_start : self.shard_end]

    def piece_views(self, shard: torch.Tensor) -> list[torch.Tensor]:
        """1-D views of this rank's pieces inside a shard-size buffer."""
        views = []
        for piece in self.pieces:
            start = self.layout.slots[piece.slot].offset + piece.start - self.shard_start
            views.append(shard[start : start + piece.numel])
        return views
