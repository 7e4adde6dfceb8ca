"""Time ways to move the same bytes on the current backend, to choose zerokit's collectives.

python benchmarks/collectives.py --nproc 2 --mbytes 108
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from zerokit.tools.launch import spawn_local


def worker(rank: int, world_size: int, args) -> None:
    n = int(args.mbytes * 2**20 / 4) // world_size * world_size
    full, shard = torch.randn(n), torch.randn(n // world_size)
    recv, out = torch.empty(n), torch.empty(n)
    replicated = shard.repeat(world_size)
    chunks = out.view(world_size, -1)

    def a2a_reduce_scatter():
        dist.all_to_all_single(recv, full)
        torch.sum(recv.view(world_size, -1), 0, out=shard)

    def peer_reduce_scatter():  # zerokit's on gloo: one send and one receive per peer, a sum
        chunks, parts = full.view(world_size, -1), recv.view(world_size, -1)
        works = []
        for k in range(1, world_size):
            to, source = (rank + k) % world_size, (rank - k) % world_size
            works += [dist.isend(chunks[to], to), dist.irecv(parts[source], source)]
        for work in works:
            work.wait()
        parts[rank].copy_(chunks[rank])
        torch.sum(parts, 0, out=shard)

    def reduce_per_owner():  # no receive buffer: each chunk is summed in place on its owner
        staged = full.view(world_size, -1)
        works = [dist.reduce(staged[r], group_dst=r, async_op=True) for r in range(world_size)]
        for work in works:
            work.wait()

    candidates = {
        "all_reduce": lambda: dist.all_reduce(full),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(shard, full),
        "all_to_all + sum (reduce-scatter)": a2a_reduce_scatter,
        "reduce per owner (reduce-scatter)": reduce_per_owner,
        "send/receive per peer (reduce-scatter)": peer_reduce_scatter,
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(out, shard),
        "all_to_all (all-gather)": lambda: dist.all_to_all_single(out, replicated),
        "broadcast per rank (all-gather)": lambda: [
            dist.broadcast(chunks[r], group_src=r) for r in range(world_size)
        ],
    }
    results = {}
    for name, fn in candidates.items():
        fn()  # warm-up
        times = []
        for _ in range(args.reps):
            dist.barrier()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        results[name] = statistics.median(times)
    if rank == 0:
        backend = dist.get_backend()
        print(f"{backend}, {world_size} ranks, {n * 4 / 1e6:.0f} MB fp32, median of {args.reps}")
        for name, seconds in results.items():
            print(f"{name:<36}{seconds * 1e3:>9.1f} ms")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help keeps the docstring's layout and shows every default."""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="ranks to start")
    p.add_argument("--mbytes", type=float, default=108, help="MB moved by each collective")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions of each (median)")
    spawn_local(worker, p.parse_args().nproc, p.parse_args())


if __name__ == "__main__":
    main()
