"""Start N local ranks without torchrun: gloo on CPU, one thread each.

Used by the examples, benchmarks and tests; under torchrun, call your function directly.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import socket
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.constants import default_pg_timeout


def local_backend(nproc: int) -> str:
    """NCCL, one GPU per rank, when this machine has ``nproc`` GPUs; else gloo on CPU."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= nproc:
        return "nccl"
    return "gloo"


def spawn_local(fn: Callable[..., Any], nproc: int, *args: Any, backend: str = "gloo") -> None:
    """Run ``fn(rank, world_size, *args)`` on ``nproc`` local ranks and wait for them.

    ``backend="nccl"`` gives each rank its own GPU (``cuda:rank``); the default is gloo on CPU.

    ``fn`` must be importable (a module-level function). A failure on any rank is re-raised.
    Ranks meet through a TCP store this process serves on a loopback port the system picks,
    so runs never race for a port and no other host can reach it; as under torchrun (a
    ``FileStore`` would poll: each of zerokit's agreements took 10 ms more through one, 2 ms
    through this).
    """
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {nproc}")
    with socket.socket() as listening:  # bound here: TCPStore alone listens on every address
        listening.bind(("127.0.0.1", 0))
        listening.listen(128)
        port = listening.getsockname()[1]
        server = dist.TCPStore(  # noqa: F841 (serves the ranks until they have all ended)
            "127.0.0.1", port, nproc, is_master=True, wait_for_workers=False,
            timeout=default_pg_timeout, master_listen_fd=listening.fileno(),
        )  # fmt: skip
        mp.spawn(_entry, args=(nproc, port, backend, fn, args), nprocs=nproc, join=True)


def _entry(rank: int, world_size: int, rendezvous: str | int, backend: str, fn, args) -> None:
    """One rank: ``rendezvous`` is a file for a ``FileStore`` (the tests' forked ranks), or
    the port of the parent's ``TCPStore`` on this machine (``spawn_local``)."""
    faulthandler.enable()  # a native abort in a rank prints that rank's Python stack
    os.environ["OMP_NUM_THREADS"] = "1"  # ranks share the machine's cores
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    if isinstance(rendezvous, int):
        store = dist.TCPStore(  # the process group's timeout, as an init_method's store gets
            "127.0.0.1", rendezvous, world_size, is_master=False, timeout=default_pg_timeout
        )
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    else:
        init = f"file://{rendezvous}"
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        # zerokit makes no reference cycle (tests/test_core_lifecycle.py frees a wrapped model
        # by reference counting alone), but ``fn`` can: a caught exception's traceback holds
        # its frames and their models. Collect those while the group they hold still works.
        gc.collect()
        dist.destroy_process_group()
    # Note: a rank whose work succeeded leaves without interpreter finalization. torch 2.13's
    # gloo teardown sometimes aborts at exit ("terminate called without an active
    # exception"), in plain DDP processes too (seen in `zerokit compare`'s DDP level), after
    # every result was delivered. A rank that raised exits normally above, so its error
    # reaches the parent.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch_script(
    strategy_path: str, script: str, args: list[str], nproc: int | None = None
) -> int:
    """``zerokit launch --strategy FILE script args``: torchrun ``script`` on this machine with
    as many ranks as the strategy's dp * tp * pp (or ``nproc``, checked against it), each rank
    finding the file in ``$ZEROKIT_STRATEGY``, where ``Strategy.from_env()`` and
    ``zerokit.parallelize`` (given no mesh) read it. Returns torchrun's exit status."""
    import subprocess

    from ..strategy import ENV, Strategy

    strategy = Strategy.load(strategy_path)  # a bad file fails here, before any rank starts
    nproc = strategy.world_size if nproc is None else nproc
    strategy.check_world(nproc)
    env = {**os.environ, ENV: os.path.abspath(strategy_path)}
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", str(nproc), script, *args]
    return subprocess.call(cmd, env=env)
