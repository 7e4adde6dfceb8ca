"""``zerokit plan``'s host-memory rows: what checkpoint I/O allocates in host memory, per rank.

Read from the dry run's wrapped model and optimizer (after its two steps, so the optimizer
holds its state) through ``checkpoint.holdings.collect``, the very list of chunks a save
writes and a load reads: on meta tensors, so only sizes are read, nothing is allocated.

Note: what each figure is, following the code it plans.
- **async save**: ``checkpoint.staging.StagingBuffers`` copies every *primary* chunk (what
  this rank writes: its pieces of the buckets and their optimizer state; whole tensors, such
  as buffers and frozen parameters, on shard rank 0 only; nothing on a replica but the first,
  nor for an unsplit tensor on a tp rank but the first) into host buffers of its own. The
  first save allocates them, later saves reuse them; they stay held between saves. The extra
  state's tensors are cloned beside them (none in a plan: they are the caller's).
- **load**: ``loading`` reads every chunk this rank holds (primary or not: a replica loads
  what it holds too) into a fresh tensor, validates, and only then applies; the staged
  tensors of the optimizer state *become* its state. Each read goes through one more copy of
  its range (``ShardFile.read`` copies out of the mapping before it lands), freed at once: the
  peak is the staged bytes so far plus the chunk being read, taken over the reading order.
  Optimizer scalars kept as tensors (Adam's ``step``) are made afresh too.
- **consolidate** (one process): tensors without a tp split go from the mapped shards to the
  output file without a copy (nothing allocated; the page cache holds what was read, and the
  kernel may drop it); a tp-split tensor is read part by part and assembled (``read_full``,
  ``tensor_parallel.topology``'s ``assemble``: its parts, the blocks and their concatenation
  at once, 3x its bytes), beside the tensor written before it if that one was assembled too
  (``streaming.write_safetensors``'s loop holds its last buffer until the next is produced).
  The figure is for one output file; ``--max-shard-size`` only ends files sooner (each new
  file lets the previous tensor go), so it is at most that.
"""

from __future__ import annotations

import math

import torch

from ..checkpoint.holdings import Chunk, Holdings, collect


def host_memory_of(model, optimizer) -> dict | None:
    """The host-memory figures of this rank's checkpoint I/O (see the module's note), from
    the chunks a save and a load of ``model`` and ``optimizer`` go through."""
    h = collect(model, optimizer)
    return {
        "async_save": sum(_nbytes(c) for c in h.chunks if c.primary),
        "load": _load_peak(h),
        "consolidate": _consolidate_peak(h),
    }


def _nbytes(chunk: Chunk) -> int:
    return chunk.tensor.numel() * chunk.tensor.element_size()


def _load_peak(h: Holdings) -> int:
    """The staged bytes at their most: every chunk read in order, each through one transient
    copy of its range, then the optimizer's scalars made as tensors."""
    held = peak = 0
    for c in h.chunks:  # parameters, buffers, then the optimizer state: the order loads read
        held += _nbytes(c)
        peak = max(peak, held + _nbytes(c))
    scalars = sum(
        _itemsize(s["tensor_dtype"]) for state in h.scalars.values() for s in state.values()
    )
    return max(peak, held + scalars)


def _itemsize(dtype_name: str | None) -> int:
    return getattr(torch, dtype_name).itemsize if dtype_name else 0


def _consolidate_peak(h: Holdings) -> int:
    """Tensors in the checkpoint's order (the index's, which consolidate writes in), into one
    file: a tp-split one is 3x its bytes at once (its parts, then ``assemble``'s blocks and
    their concatenation: two ``torch.cat``), beside the tensor written before it if that one
    was assembled too (the writer's loop holds its last buffer until the next is produced);
    an unsplit one is a view of the mapped file."""
    peak = previous = 0
    for name in h.param_names:
        meta = h.metas[name]
        nbytes = math.prod(meta.shape) * meta.dtype.itemsize if meta.split is not None else 0
        peak, previous = max(peak, previous + 3 * nbytes), nbytes
    return peak
