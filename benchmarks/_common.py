"""Shared pieces of the benchmark scripts: counting the bytes a rank holds."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def held_bytes(model: torch.nn.Module, optimizer) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds, each storage once.

    Gradients are those visible on the model's parameters and on the optimizer's parameters
    (zerokit's pieces are views of its gradient buffers or shards), plus zerokit's own gradient
    buffers, including the staging pool 'os_g' reuses during backward.
    """
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its own
    seen: set[int] = set()

    def count(tensors) -> int:
        total = 0
        for t in tensors:
            if t is None or not isinstance(t, torch.Tensor):
                continue
            if isinstance(t, DTensor):  # FSDP2: the local shard is what this rank holds
                t = t.to_local()
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    zk = getattr(model, "_zerokit", None)
    shards = [b.shard_data for b in zk.grad_sync.buckets] if zk is not None else []
    # stage 3 parameters are empty between uses: their shards are what the rank holds
    params = count([p.data for p in model.parameters()] + shards)
    opt_params = [p for g in inner.param_groups for p in g["params"]]
    grads = count([p.grad for p in model.parameters()] + [p.grad for p in opt_params])
    if zk is not None:  # count zerokit's gradient buffers even where no .grad points at them
        sync = zk.grad_sync
        staging = sync.staging.buffers if getattr(sync, "staging", None) else []
        grads += count(
            getattr(sync, "grad_buffers", []) + getattr(sync, "grad_shards", []) + staging
        )
    state = count(v for s in inner.state.values() for v in s.values())
    return {"params": params, "grads": grads, "optimizer": state}
