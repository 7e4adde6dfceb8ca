"""Shared pieces of the benchmark scripts: spawning gloo ranks and counting held bytes."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def spawn(fn, world_size: int, *args) -> None:
    """Run ``fn(rank, world_size, *args)`` on gloo CPU ranks, one thread each."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_entry, args=(world_size, port, fn, args), nprocs=world_size, join=True)


def _entry(rank, world_size, port, fn, args):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def held_bytes(model: torch.nn.Module, optimizer) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds, each storage once.

    Gradients are those visible on the model's parameters and on the optimizer's parameters
    (zerokit's pieces are views of its gradient buffers or shards).
    """
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its own
    seen: set[int] = set()

    def count(tensors) -> int:
        total = 0
        for t in tensors:
            if t is None or not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    params = count(p.data for p in model.parameters())
    opt_params = [p for g in inner.param_groups for p in g["params"]]
    grads = count([p.grad for p in model.parameters()] + [p.grad for p in opt_params])
    zk = getattr(model, "_zerokit", None)
    if zk is not None:  # count zerokit's gradient buffers even where no .grad points at them
        sync = zk.grad_sync
        grads += count(getattr(sync, "grad_buffers", []) + getattr(sync, "grad_shards", []))
    state = count(v for s in inner.state.values() for v in s.values())
    return {"params": params, "grads": grads, "optimizer": state}
