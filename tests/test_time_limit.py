"""The suite never hangs: a test past its time limit fails with every thread's stack and its
forked ranks killed (conftest.py), and a rank forked from a process that compiled with inductor
compiles too, on a cold kernel cache (the hang that held README's test command on a fresh
machine)."""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _session(pytester, body: str, *args: str):
    pytester.makeconftest((ROOT / "conftest.py").read_text())
    pytester.makepyfile(test_planted=textwrap.dedent(body))
    started = time.perf_counter()
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *args)
    return result, time.perf_counter() - started


def test_a_sleeping_test_fails_at_its_limit_with_its_stack(pytester):
    result, took = _session(
        pytester,
        """
        import time

        def test_sleeps():
            time.sleep(60)

        def test_after_it_runs():
            pass
        """,
        "--time-limit",
        "2",
    )
    result.assert_outcomes(failed=1, passed=1)
    out = result.stdout.str() + result.stderr.str()
    assert "test_sleeps ran past its time limit of 2 s" in out
    assert "in test_sleeps" in out  # the dumped stack shows where it waited
    assert took < 40, took


def test_a_hung_rank_is_killed_when_its_test_runs_out_of_time(pytester, tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    result, _ = _session(
        pytester,
        f"""
        import os, sys, time
        import pytest
        sys.path.insert(0, {str(ROOT)!r})
        from tests.dist_helpers import run_distributed

        def _hang(rank, world):
            open(os.path.join({str(pids)!r}, str(os.getpid())), "w").close()
            if rank == 0:
                time.sleep(600)  # rank 1 waits in the barrier for ever
            import torch.distributed as dist
            dist.barrier()

        @pytest.mark.time_limit(8)
        def test_hangs():
            run_distributed(_hang, 2)
        """,
    )
    result.assert_outcomes(failed=1)
    assert "ran past its time limit of 8 s" in result.stdout.str()
    ranks = [int(p.name) for p in pids.iterdir()]
    assert len(ranks) == 2
    for pid in ranks:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        raise AssertionError(f"rank process {pid} outlived its test")


COMPILE_THEN_FORK = """
import sys
import torch
sys.path.insert(0, {root!r})
from tests.dist_helpers import run_distributed

def _step(x):
    return (x.sin() * 2).sum()

def _rank(rank, world):
    # a kernel the parent never compiled: the rank must compile it itself
    out = torch.compile(lambda x: (x.cos() + 3).exp().sum())(torch.ones(4))
    assert torch.isfinite(out)

if __name__ == "__main__":
    torch.compile(_step)(torch.ones(8))  # the parent compiles first, as a test's reference does
    run_distributed(_rank, 2)
    print("ranks compiled")
"""


def test_ranks_forked_after_a_compile_compile_on_a_cold_cache(tmp_path):
    script = tmp_path / "compile_then_fork.py"
    script.write_text(COMPILE_THEN_FORK.format(root=str(ROOT)))
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cold-inductor-cache"),
        "TORCHINDUCTOR_COMPILE_THREADS": os.environ["TORCHINDUCTOR_COMPILE_THREADS"],
        "OMP_NUM_THREADS": "1",
    }
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ranks compiled" in done.stdout
