"""The tests' spawn helper: N local gloo CPU ranks (zerokit.launch.spawn_local)."""

from zerokit.launch import spawn_local


def run_distributed(fn, world_size: int, *args) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; re-raise a failure.

    ``fn`` must be a module-level function (it is pickled into the child processes).
    """
    spawn_local(fn, world_size, *args)
