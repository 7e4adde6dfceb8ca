"""The tests' spawn helper: N local gloo CPU ranks (zerokit.tools.launch.spawn_local)."""

import os
import tempfile

import torch.multiprocessing as mp

from zerokit.tools.launch import _entry


def run_distributed(fn, world_size: int, *args) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` forked ranks; re-raise a failure.

    Note: forked, not spawned as ``zerokit.tools.launch.spawn_local`` does: a spawned rank imports
    torch again (seconds of CPU each), which was most of the fast subset's time. The ranks
    start from the test process as it is; each sets one thread before any work. Nothing in
    the test process may have started a thread pool a rank needs: conftest.py keeps
    inductor's compile pool off for that reason.
    """
    with tempfile.TemporaryDirectory(prefix="zerokit-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        ranks = mp.start_processes(
            _entry,
            args=(world_size, init_file, "gloo", fn, args),
            nprocs=world_size,
            join=False,
            start_method="fork",
        )
        try:
            while not ranks.join():
                pass
        except BaseException:
            # a failed rank, or the test's time limit (conftest.py) interrupting the wait:
            # no rank outlives the test, stuck in a collective its peers left
            for process in ranks.processes:
                if process.is_alive():
                    process.kill()
                process.join()
            raise


def run_torchrun(script, nproc: int, *args: str, cwd=None, timeout: int = 300):
    """``torchrun --standalone --nproc-per-node N script args`` as a user runs it, one thread
    per rank; returns the finished ``subprocess.CompletedProcess`` (stdout and stderr as text).
    torchrun and its ranks run in a session of their own: past ``timeout``, or when the test's
    time limit interrupts the wait, the whole session is killed, ranks included (killing
    torchrun alone would leave its ranks in a collective for the rest of the suite)."""
    import signal
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", str(nproc), str(script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, text=True, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
