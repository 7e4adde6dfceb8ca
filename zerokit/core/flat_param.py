"""Flat parameter storage: one bucket's contiguous buffer, the parameter views into it, the
pieces of it this rank's optimizer updates, and (level 'p_g_os') its gathering and freeing.

After construction every parameter of the bucket *is* a view of ``FlatParamBucket.data``
(``param.data`` is re-pointed), so gathering the flat buffer updates the model in place and the
optimizer's in-place update of a piece writes straight into the parameter.
"""

from __future__ import annotations

import enum

import torch
from torch import nn
from torch.distributed import ProcessGroup

from .bucket_layout import BucketLayout
from .collectives import Pending, start_all_gather_


class Storage(enum.Enum):
    SHARDED = "sharded"  # only this rank's shard exists
    GATHERING = "gathering"  # an all-gather into the full buffer is in flight
    GATHERED = "gathered"  # full parameters usable


class FlatParamBucket:
    """Owns one bucket's flat parameter buffer and hands out views of buffers laid out like it.

    ``data`` is the full flat buffer the parameters are views of; ``shard_data`` is this rank's
    shard, which the optimizer's pieces are views of. With full parameters kept (levels 'os',
    'os_g') the shard is a view of ``data``; with ``shard_params`` (level 'p_g_os') or a
    separate master copy (mixed precision, offload) it is a tensor of its own.

    Note: freeing resizes the full buffer's *storage* to zero rather than dropping the tensor.
    Autograd keeps views of weights for backward (``weight.t()`` in a linear layer); those views
    share the storage, so memory really is freed between forward and backward, and gathering
    again refills the same storage before backward reads them. While sharded, each parameter
    points at an empty tensor: code that reads a parameter outside its unit's forward never
    reads freed memory (a module call there is refused by name first: ``NotGatheredError``,
    ``core/hooks.py``; a bare tensor read meets torch's shape error).
    """

    def __init__(
        self,
        layout: BucketLayout,
        params: list[nn.Parameter],
        group: ProcessGroup,
        *,
        compute_dtype: torch.dtype | None = None,
        master_device: torch.device | None = None,
        shard_params: bool = False,
        initial_shard: torch.Tensor | None = None,
        replica_group: ProcessGroup | None = None,
    ):
        assert len(params) == len(layout.slots)
        self.layout = layout
        self.params = params
        self.group = group
        # optimizer state sharded over replicas too (layout.replicas > 1): this rank steps its
        # sub-shard only, and the replicas spread their updated sub-shards after a step
        self.replica_group = replica_group if layout.replicas > 1 else None
        assert layout.replicas == 1 or (replica_group and replica_group.size() == layout.replicas)
        replica = self.replica_group.rank() if self.replica_group is not None else None
        self.pieces = layout.pieces(group.rank(), replica)
        self.replica_ranges = layout.sub_ranges(group.rank())  # None: equal sub-shards
        self.shard_start, self.shard_end = layout.shard_range(group.rank())
        # every rank's chunk for the collectives: None where the shards are equal
        self.ranges = None if layout.even else layout.shard_ranges()
        device = master_device or layout.device  # offload: the master shard lives in CPU memory
        if initial_shard is not None:
            # a model built on meta (zerokit/meta_init.py): this rank initialised its shard
            # unit by unit; the full buffer is never filled here, only freed by reshard below
            assert shard_params and initial_shard.numel() == self.shard_end - self.shard_start
            self.shard_data = initial_shard.to(device)
            self.data = torch.empty(
                layout.padded_numel, dtype=compute_dtype or layout.dtype, device=layout.device
            )
        else:
            self._fill_from_params(params, compute_dtype, device, shard_params)
        for i, param in enumerate(params):
            param.data = self.slot_view(self.data, i)  # the parameter now lives in the bucket
        # What this rank's optimizer updates: 1-D views of its shard, one per parameter piece.
        self.param_pieces = self.piece_views(self.shard_data)
        self.storage = Storage.GATHERED
        self._nbytes = self.data.untyped_storage().nbytes()
        self._empty = self.data.new_empty(0)
        self._pending: Pending | None = None
        self.shards_params = shard_params
        if shard_params:
            self.reshard()

    def _fill_from_params(self, params, compute_dtype, device, shard_params) -> None:
        layout = self.layout
        full = torch.zeros(layout.padded_numel, dtype=layout.dtype, device=layout.device)
        with torch.no_grad():
            for i, param in enumerate(params):
                self.slot_view(full, i).copy_(param)
        # The master shard is taken before any cast: it keeps the parameters' exact values.
        cast = compute_dtype not in (None, layout.dtype)
        own = shard_params or cast or device != full.device
        self.shard_data = self.shard(full).to(device, copy=True) if own else self.shard(full)
        self.data = full.to(compute_dtype) if cast else full

    # -- views ---------------------------------------------------------------------------------
    @property
    def separate_masters(self) -> bool:
        """Do the masters differ from the compute copy in dtype or device (mixed precision,
        offload)? Then they are a tensor apart that must be copied into it after a step."""
        return (self.data.dtype, self.data.device) != (
            self.shard_data.dtype,
            self.shard_data.device,
        )

    def slot_view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Slot ``i`` of a full-size buffer laid out like ``data``, shaped like its parameter."""
        slot = self.layout.slots[i]
        return flat[slot.offset : slot.end].view(slot.shape)

    def shard(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a full-size buffer."""
        return flat[self.shard_start : self.shard_end]

    def use_pieces(self, pieces) -> None:
        """Step (and show checkpoints) ``pieces`` of this rank's shard: the whole shard's for
        a checkpoint where the optimizer state is sharded over replicas (``whole_shards``)."""
        self.pieces = tuple(pieces)
        self.param_pieces = self.piece_views(self.shard_data)

    def piece_views(self, shard: torch.Tensor) -> list[torch.Tensor]:
        """Views of this rank's pieces inside a shard-size buffer: 1-D, or shaped like the
        parameter where its optimizer steps it whole (``Slot.whole``: Muon needs a matrix)."""
        views = []
        for piece in self.pieces:
            slot = self.layout.slots[piece.slot]
            start = slot.offset + piece.start - self.shard_start
            view = shard[start : start + piece.numel]
            views.append(view.view(slot.shape) if slot.whole else view)
        return views

    # -- after a step: full parameters from the updated shards ---------------------------------
    def refresh_compute_shard(self) -> None:
        """Cast the updated master shard into the compute copy (mixed precision, offload)."""
        if self.separate_masters:
            self.shard(self.data).copy_(self.shard_data)

    def start_gather_replicas(self) -> Pending:
        """Optimizer state sharded over replicas: each replica stepped its sub-shard of the
        master shard; gather them into every replica's shard (nothing without it)."""
        if self.replica_group is None:
            return Pending([])
        return start_all_gather_(self.shard_data, self.replica_group, ranges=self.replica_ranges)

    def start_gather_updated(self) -> Pending:
        """Full parameters kept ('os', 'os_g'): spread every rank's updated shard to all (first
        across replicas, where each stepped a sub-shard of it)."""
        if self.replica_group is None:
            self.refresh_compute_shard()
            return start_all_gather_(self.data, self.group, ranges=self.ranges)
        return (
            self.start_gather_replicas()
            .then(self.refresh_compute_shard)
            .then(lambda: start_all_gather_(self.data, self.group, ranges=self.ranges).finish())
        )

    # -- storage life cycle ('p_g_os') ---------------------------------------------------------
    def start_unshard(self) -> None:
        if self.storage is not Storage.SHARDED:
            return
        self.data.untyped_storage().resize_(self._nbytes)
        self.shard(self.data).copy_(self.shard_data)  # the compute dtype: a cast under bf16
        self._pending = start_all_gather_(self.data, self.group, ranges=self.ranges)
        self.storage = Storage.GATHERING

    def wait_for_unshard(self) -> None:
        self.start_unshard()
        if self.storage is Storage.GATHERING:
            self._pending.finish()
            self._pending = None
            for i, param in enumerate(self.params):
                param.data = self.slot_view(self.data, i)
            self.storage = Storage.GATHERED

    def reshard(self) -> None:
        """Free the full buffer (only where parameters are sharded)."""
        if not self.shards_params:
            return
        if self.storage is Storage.GATHERING:
            self.wait_for_unshard()  # never free memory a collective is writing into
        if self.storage is Storage.GATHERED:
            for param in self.params:
                param.data = self._empty
            self.data.untyped_storage().resize_(0)
            self.storage = Storage.SHARDED

    @property
    def gathered_numel(self) -> int:
        """Elements of the full buffer that have storage now (0 when sharded)."""
        return 0 if self.storage is Storage.SHARDED else self.layout.padded_numel
